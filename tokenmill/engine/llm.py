"""`LLM`: the offline API, as in vLLM — build once, then `generate` or `chat` over many prompts,
all batched together by the engine; `embed`, `classify` and `score` for pooling models."""
from __future__ import annotations

import itertools
import time
from typing import Sequence

from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.lora_request import LoRARequest
from tokenmill.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams

PromptType = str | list[int] | dict


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Prompts are strings, token-id lists or `{"prompt_token_ids": [...]}` dicts. Returns one
        RequestOutput per prompt, in order. `lora_request`: the LoRA adapter all prompts run under,
        or one per prompt (None: the base model); needs an LLM built with enable_lora."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params.")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(loras)} LoRA requests.")
        if any(lr is not None and not isinstance(lr, LoRARequest) for lr in loras):
            raise ValueError("lora_request takes LoRARequest objects (or None for the base model).")
        return self._run([_as_prompt(p) for p in prompts], [p or SamplingParams() for p in params], use_tqdm, loras)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("chat needs a tokenizer; this LLM was built with skip_tokenizer_init.")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in convs:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                           template_kwargs=chat_template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """One embedding per prompt (`outputs.embedding`), in order."""
        params = pooling_params or PoolingParams()
        if params.task != "embed":
            raise ValueError(f"embed takes PoolingParams of task 'embed', got {params.task!r}.")
        return self._pool(prompts, params, truncate_prompt_tokens, use_tqdm)

    def classify(self, prompts: PromptType | Sequence[PromptType], truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """A sequence classifier's probabilities per prompt (`outputs.probs`)."""
        return self._pool(prompts, PoolingParams(task="classify"), truncate_prompt_tokens, use_tqdm)

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Relevance of each text pair (`outputs.score`): one `data_1` against every `data_2`, or
        pairwise when both are lists of one length. A cross-encoder reads each pair as one input;
        an embedding model scores the cosine similarity of the two embeddings."""
        pairs = score_pairs(data_1, data_2)
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("score needs a tokenizer; this LLM was built with skip_tokenizer_init.")
        if "classify" in self.engine.tasks:
            prompts, params = [], []
            for a, b in pairs:
                ids, start = tok.encode_input(a, b, truncate_prompt_tokens)
                prompts.append((None, ids))
                params.append(PoolingParams(task="classify", pair_start=start))
            return self._run(prompts, params, use_tqdm)
        texts = [t for pair in pairs for t in pair]
        vecs = self._pool(texts, PoolingParams(normalize=True), truncate_prompt_tokens, use_tqdm)
        return [PoolingRequestOutput(f"score-{next(self._ids)}", None, a.prompt_token_ids + b.prompt_token_ids,
                                     PoolingOutput([sum(x * y for x, y in zip(a.outputs.data, b.outputs.data))]),
                                     True) for a, b in zip(vecs[::2], vecs[1::2])]

    def _pool(self, prompts: PromptType | Sequence[PromptType], params: PoolingParams, truncate: int | None,
              use_tqdm: bool) -> list[PoolingRequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        tok = self.engine.tokenizer
        items = []
        for p in prompts:
            text, prompt = _as_prompt(p)
            if isinstance(prompt, str) and tok is not None:  # the model's special tokens, cut as asked
                text, prompt = prompt, tok.encode_input(prompt, None, truncate)[0]
            elif truncate is not None and isinstance(prompt, list):
                prompt = prompt[:truncate]
            items.append((text, prompt))
        return self._run(items, [params] * len(items), use_tqdm)

    def _run(self, prompts: list[tuple[str | None, list[int] | str]], params: list[SamplingParams | PoolingParams],
             use_tqdm: bool, loras: list[LoRARequest | None] | None = None) -> list[RequestOutput | PoolingRequestOutput]:
        engine = self.engine
        ids = []
        try:
            for (text, prompt), p, lora in zip(prompts, params, loras or [None] * len(prompts)):
                req_id = f"gen-{next(self._ids)}"
                engine.add_request(req_id, prompt, p, prompt_text=text, lora_request=lora)
                ids.append(req_id)
        except ValueError:
            for req_id in ids:
                engine.abort_request(req_id)
            raise
        bar = _progress(len(ids)) if use_tqdm and len(ids) >= 8 else None
        final: dict[str, RequestOutput] = {}
        t0, num_tokens = time.monotonic(), 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if isinstance(out, RequestOutput):
                    num_tokens += sum(len(o.delta_token_ids) for o in out.outputs)
                if out.finished:
                    final[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix_str(f"{num_tokens / max(time.monotonic() - t0, 1e-9):.1f} tok/s")
        if bar is not None:
            bar.close()
        return [final[i] for i in ids]


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text against each of many, or two lists of one length pairwise."""
    one = [data_1] if isinstance(data_1, str) else list(data_1)
    two = [data_2] if isinstance(data_2, str) else list(data_2)
    if not one or not two or not all(isinstance(t, str) for t in one + two):
        raise ValueError("score takes non-empty texts: a string or a list of strings on each side.")
    if len(one) == 1:
        return [(one[0], t) for t in two]
    if len(one) != len(two):
        raise ValueError(f"score pairs lists of one length, or one text with many; got {len(one)} and {len(two)}.")
    return list(zip(one, two))


def _as_prompt(p: PromptType) -> tuple[str | None, list[int] | str]:
    if isinstance(p, str):
        return None, p
    if isinstance(p, dict):
        if "prompt_token_ids" in p:
            return p.get("prompt"), list(p["prompt_token_ids"])
        if "prompt" in p:
            return None, p["prompt"]
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'.")
    if isinstance(p, list):
        return None, p
    raise ValueError(f"a prompt must be a string, a list of token ids or a dict; got {type(p).__name__}.")


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="requests", unit="req", dynamic_ncols=True)
