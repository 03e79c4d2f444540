"""LLMEngine: owns the scheduler, the executor (the one way into the runner: runner/executor.py,
or distributed/ for tensor-parallel ranks) and the detokenizer, and turns one call of `step()`
into one batched forward pass plus the outputs it produced.

A request with n > 1 becomes n child sequences (`<id>#<i>`) that run independently; their
outputs are gathered back under the parent id.

Request state, by owner (only the owner writes; the others read what they are handed):
- AsyncEngine (server side): the caller's stream and deadlines, by request id.
- OutputProcessor (engine/output.py): the prompt as given and as tokenized (what the outputs
  show), the n sibling sequences, their detokenizers, and text, logprobs and finish so far.
- Scheduler (core/): the sequences' `Request`s, the one copy of their token ids (prompt + output)
  in the process, computed counts, block tables, status and finish reason (a stop string ends one
  through `Scheduler.stop_at`), and the draft policy's per-request estimate; the BlockManager the
  blocks. It appends each step's tokens once the step is done (`Scheduler.update`).
- ModelRunner (runner/): per sequence, what sampling needs between steps (`ReqState`: params, the
  block table as deltas left it, a grammar matcher, and the scheduler's token list itself, read
  only), learnt from the SchedulerOutput and dropped at `finished_req_ids`. A worker rank in
  another process holds the copy it was sent and never reads it (only rank 0 samples).
- Proposers (spec/): the n-gram indexes, and the draft model's own requests, whose tokens are the
  step's view the runner hands them (history + this step's tokens, built per step).
The RequestOutputs handed out are snapshots (output ids sliced once per step): callers may keep them.
"""
from __future__ import annotations

import functools
import logging
import time
from typing import Callable

import torch

from tokenmill.config import EngineConfig
from tokenmill.core.block_manager import BlockManager, cdiv
from tokenmill.core.request import Request
from tokenmill.core.sched_output import StepStats
from tokenmill.core.scheduler import Scheduler, SchedulerConfig
from tokenmill.core.speculation import DraftPolicy
from tokenmill.lora_request import LoRARequest
from tokenmill.engine.adapters import Adapters
from tokenmill.engine.output import OutputProcessor
from tokenmill.engine.threads import ThreadGovernor, default_threads
from tokenmill.engine import tasks
from tokenmill.models import encoder, encoder_loader, loader
from tokenmill.outputs import PoolingRequestOutput, RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.runner import kv_cache
from tokenmill.runner.executor import UniprocExecutor
from tokenmill.runner.model_runner import ModelRunner
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec import proposers
from tokenmill.structured.grammar import GrammarCompiler
from tokenmill.utils import default_model_path, huge_pages_after_load, resolve_device

log = logging.getLogger("tokenmill")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        mc = config.model
        self.config = config
        self.model_path = mc.model or default_model_path()
        self.device = resolve_device(mc.device)
        # tensor parallelism: workers started and this process pinned as rank 0 before anything loads
        self.executor: UniprocExecutor = UniprocExecutor()
        if config.parallel.tensor_parallel_size > 1:
            from tokenmill.distributed import launch
            self.executor = launch.start(config)
        self.governor = None
        if config.parallel.tensor_parallel_size == 1 and self.device.type == "cpu":
            # process-wide: ATen's pool, which the CPU kernels share
            threads, why = (mc.threads, "--threads") if mc.threads is not None else default_threads()
            torch.set_num_threads(threads)
            log.info("CPU threads: %d (%s)", threads, why)
            self.governor = ThreadGovernor(threads)
        elif mc.threads is not None:
            torch.set_num_threads(mc.threads)
        try:
            with huge_pages_after_load():  # the weights' huge pages are taken after start-up (utils)
                self._build(config)
        except BaseException as e:
            self.executor.abandon(f"{type(e).__name__}: {e}")
            raise

    def _build(self, config: EngineConfig) -> None:
        torch.manual_seed(config.model.seed)
        if encoder.is_encoder(self.model_path):
            self._build_encoder(config)
        else:
            self._build_decoder(config)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) if self.tokenizer else set()
        self.output = OutputProcessor(self.tokenizer, self.scheduler)
        self.adapters = Adapters(self.executor, self.config.lora.enable_lora)
        self._stats: StepStats | None = None   # the last step's, until `stats()` takes it
        self._aborted: list[Request] = []      # sequences aborts ended since `stats()` was last taken

    def _build_encoder(self, config: EngineConfig) -> None:
        """An encoder (models/encoder.py): no KV cache, inputs run whole, each ends with its vector."""
        from tokenmill.runner.encoder_runner import EncoderRunner

        mc, cc, sc = config.model, config.cache, config.scheduling
        if config.parallel.tensor_parallel_size > 1 or sc.speculative_config is not None or config.lora.enable_lora:
            raise ValueError("an encoder model runs on one rank without speculative decoding or LoRA adapters.")
        loaded = encoder_loader.load(self.model_path, not mc.skip_tokenizer_init, mc.dtype, mc.quantization,
                                     mc.quantization_group_size, mc.activation_bits, self.device)
        model = loaded.model
        self.arch, self.dtype, self.activation_bits = model.cfg, next(model.parameters()).dtype, loaded.activation_bits
        self.serves = tasks.for_encoder(self.model_path, mc.task, model.cfg.num_labels, loaded.pooling,
                                        model.cfg.hidden_size, loaded.matryoshka)
        self.tokenizer = loaded.tokenizer
        self.max_model_len = self._max_len(mc, model.cfg.max_tokens)
        self.grammars = None
        self.executor.attach(EncoderRunner(model, loaded.pooling, self.device))
        # no KV cache: block ids only count the seats (enough for every seat's longest input)
        self.block_size = cc.block_size
        self.block_manager = BlockManager(sc.max_num_seqs * cdiv(self.max_model_len, cc.block_size), cc.block_size,
                                          enable_prefix_caching=False)
        self.kv_capacity_tokens, self.kv_num_blocks, self.kv_cache_dtype = 0, 0, "none"
        # an input runs whole in one step: the step's budget holds at least the longest one
        self.scheduler = Scheduler(SchedulerConfig(sc.max_num_seqs, max(sc.max_num_batched_tokens, self.max_model_len),
                                                   self.max_model_len, sc.scheduling_policy, whole_prompts=True),
                                   self.block_manager)
        log.info("loaded %s (%s encoder, %d layers, task %s) on %s, %s%s", self.model_path, model.cfg.family,
                 model.cfg.num_layers, sorted(self.serves.tasks)[0], self.device, str(self.dtype)[6:],
                 f", {mc.quantization} weights" if self.activation_bits else "")

    def _max_len(self, mc, limit: int) -> int:
        max_len = int(mc.max_model_len or limit)
        if max_len > limit:
            raise ValueError(f"max_model_len {max_len} exceeds the model's context of {int(limit)} tokens.")
        return max_len

    def _build_decoder(self, config: EngineConfig) -> None:
        mc, cc, sc, lc = config.model, config.cache, config.scheduling, config.lora
        if lc.enable_lora and config.parallel.tensor_parallel_size > 1:
            raise ValueError("LoRA adapters run on one rank; tensor_parallel_size > 1 does not serve them yet.")
        t0 = time.monotonic()
        tp_group = self.executor.group
        loaded = loader.load(self.model_path, mc.dtype, self.device, load_tokenizer=not mc.skip_tokenizer_init,
                             quantization=mc.quantization, group_size=mc.quantization_group_size,
                             keep_float=mc.keep_float_weights, activation_bits=mc.activation_bits,
                             tp_group=tp_group, reserve_bytes=kv_cache.cpu_budget(cc.kv_cache_memory, self.device),
                             weight_cache=mc.weight_cache)
        self.arch, self.tokenizer = loaded.arch, loaded.tokenizer
        self.activation_bits = loaded.activation_bits
        self.dtype = next(loaded.model.parameters()).dtype

        self.max_model_len = self._max_len(mc, self.arch.context_length)
        no_yes = None if mc.classifier_from_token is None else tuple(
            tasks.token_id(self.tokenizer, self.arch.vocab_size, t.strip()) for t in mc.classifier_from_token.split(","))
        self.serves = tasks.for_decoder(self.model_path, mc.task, self.arch.hidden_size, no_yes)
        self.kv_dtype = kv_cache.resolve_dtype(cc.kv_cache_dtype, self.dtype, self.device)
        spec = sc.speculative_config
        draft = None
        if spec is not None and spec.method == "draft_model":
            draft = proposers.load_draft(spec, loaded, mc.dtype, self.device)
        # a draft model's cache holds as many blocks as the target's, inside the same budget
        draft_block_bytes = 0 if draft is None else kv_cache.bytes_per_block(draft.arch, cc.block_size, self.kv_dtype)
        # per rank: rank 0 holds the largest share of the KV heads, every rank the same block ids
        num_blocks, budget = kv_cache.num_blocks_for(loaded.model.cfg, cc.block_size, self.kv_dtype, self.device,
                                                     cc.kv_cache_memory, cc.gpu_memory_utilization,
                                                     draft_block_bytes)
        self.executor.handshake(num_blocks)
        self.block_size = cc.block_size
        proposer = None if spec is None else proposers.build(spec, draft, num_blocks, cc.block_size, self.device,
                                                             self.kv_dtype, cc.enable_prefix_caching)
        # structured outputs need the tokenizer's vocabulary (a tokenizer-less engine refuses them)
        self.grammars = None if self.tokenizer is None else GrammarCompiler(
            self.tokenizer.tok.to_str(), self.arch.vocab_size, sorted(self.tokenizer.eos_token_ids))
        pooled = self.serves.pooling
        self.executor.attach(ModelRunner(loaded.model, num_blocks, cc.block_size, self.device, self.kv_dtype,
                                         proposer, grammars=self.grammars,
                                         normalize_embeddings=pooled is not None and pooled.normalize,
                                         classifier_tokens=self.serves.classifier_tokens,
                                         lora_slots=(lc.max_loras, lc.max_lora_rank, lc.lora_dtype)
                                         if lc.enable_lora else None))
        self.block_manager = BlockManager(num_blocks, cc.block_size, cc.enable_prefix_caching)
        draft_cost = 0.0 if draft is None else draft.model.decode_weight_bytes() / loaded.model.decode_weight_bytes()
        policy = None if spec is None else DraftPolicy(spec.num_speculative_tokens, spec.disable_by_batch_size,
                                                       spec.adaptive, draft_cost=draft_cost)
        # a draft model reads the same block ids in its own cache and attends to everything: then
        # no block is given back early
        window = self.arch.sliding_window if draft is None else None
        self.scheduler = Scheduler(SchedulerConfig(sc.max_num_seqs, sc.max_num_batched_tokens, self.max_model_len,
                                                   sc.scheduling_policy, window, sc.long_prefill_slowdown,
                                                   max_loras=lc.max_loras if lc.enable_lora else 0),
                                   self.block_manager, policy)
        self.kv_capacity_tokens, self.kv_num_blocks = num_blocks * cc.block_size, num_blocks
        self.kv_cache_dtype = kv_cache.dtype_name(self.kv_dtype)
        log.info("loaded %s (%s, %d layers) on %s in %.1fs%s; KV cache %d blocks x %d = %d tokens (%.2f GiB, %s)",
                 self.model_path, self.arch.family, self.arch.num_layers, self.device, time.monotonic() - t0,
                 " (packed weights mapped from the weight cache)" if loaded.from_cache else "",
                 num_blocks, cc.block_size, self.kv_capacity_tokens, budget / 2**30, self.kv_cache_dtype)

    # ------------------------------------------------------------------ intake
    def add_request(self, req_id: str, prompt: str | list[int], params: SamplingParams | PoolingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
                    prompt_text: str | None = None, lora_request: LoRARequest | str | None = None) -> None:
        """`cache_salt`: requests share cached prefix blocks only with requests of the same salt
        (vLLM's field; one per tenant keeps tenants from probing each other's prompts).
        `prompt_text`: the prompt the outputs show, where token ids are given for a text (a
        rendered chat). PoolingParams make it a pooling request: one vector, no tokens.
        `lora_request`: the LoRA adapter it runs under (added on first use), or the name of one
        added before; None: the base model."""
        params = params or SamplingParams()
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r:.100}.")
        if req_id in self.output:
            raise ValueError(f"request id {req_id!r} is already in use.")
        lora = self.adapters.resolve(lora_request)
        if isinstance(params, PoolingParams):
            self._add_pooling(req_id, prompt, params, arrival_time, priority, cache_salt, prompt_text, lora)
            return
        if "generate" not in self.tasks:
            raise ValueError(f"this model serves {sorted(self.tasks)}; it does not generate text.")
        text, ids = self._tokenize(prompt)
        self._check_length(len(ids), params)
        vocab = self.arch.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids below the vocabulary size {vocab}, got "
                             f"{[t for t in params.stop_token_ids if t >= vocab][:5]}.")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias keys must be token ids below the vocabulary size {vocab}, got "
                             f"{[t for t in params.logit_bias if t >= vocab][:5]}.")
        self.compile_constraint(params)
        params_list = [params] if params.n == 1 else [params.child(i) for i in range(params.n)]
        children = [Request(req_id if params.n == 1 else f"{req_id}#{i}", ids, p, self.eos_token_ids, arrival_time,
                            priority, cache_salt, lora_name=lora) for i, p in enumerate(params_list)]
        for req in children:
            self.scheduler.add_request(req)
        self.output.add(req_id, text if prompt_text is None else prompt_text, ids, children)

    def _add_pooling(self, req_id: str, prompt: str | list[int], params: PoolingParams, arrival_time: float | None,
                     priority: int, cache_salt: str | None, prompt_text: str | None, lora: str | None) -> None:
        text, ids = self._tokenize(prompt)
        self.serves.check(params, len(ids), self.max_model_len)
        if cdiv(len(ids), self.block_size) > self.block_manager.num_blocks:
            raise ValueError(f"this input needs {len(ids)} tokens of KV cache but the cache holds only "
                             f"{self.kv_capacity_tokens}; raise kv_cache_memory.")
        req = Request(req_id, ids, SamplingParams(max_tokens=1), set(), arrival_time, priority, cache_salt, params, lora)
        self.scheduler.add_request(req)
        self.output.add(req_id, text if prompt_text is None else prompt_text, ids, [req])

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, lora: LoRARequest) -> None:
        """Reads and checks an adapter so requests can name it (engine/adapters.py)."""
        self.adapters.add(lora)

    def remove_lora(self, name: str) -> None:
        """Unloads an adapter once no request uses it; KeyError if none has this name."""
        self.adapters.remove(name)
        self.adapters.reap(self.scheduler.requests.values())

    def list_loras(self) -> list[LoRARequest]:
        return self.adapters.list()

    def compile_constraint(self, params: SamplingParams) -> None:
        """Compile (and cache) a request's structured-output constraint, or raise ValueError
        saying what is wrong with it."""
        _compile_constraint(self.grammars, params)

    def constraint_compiler(self) -> Callable[[SamplingParams], None]:
        """`compile_constraint` without the engine: the server calls it on a worker thread, so a
        slow schema never stalls a step (the engine's own call is then a cache hit); the compiler
        is thread-safe, the engine is not."""
        return functools.partial(_compile_constraint, self.grammars)

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine was started without a tokenizer; pass prompt token ids.")
            ids = self.tokenizer.encode(prompt)
            text = prompt
        else:
            ids, text = list(prompt), None
            vocab = self.arch.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}.")
        if not ids:
            raise ValueError("the prompt is empty; give at least one token.")
        return text, ids

    def _check_length(self, prompt_len: int, params: SamplingParams) -> None:
        if prompt_len >= self.max_model_len:
            raise ValueError(f"the prompt has {prompt_len} tokens but the model's context (max_model_len) is "
                             f"{self.max_model_len}; shorten the prompt.")
        if params.max_tokens is not None and prompt_len + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = "
                             f"{prompt_len + params.max_tokens} exceeds the context of {self.max_model_len} tokens; "
                             f"ask for at most {self.max_model_len - prompt_len} new tokens.")
        total = min(prompt_len + (params.max_tokens or self.max_model_len), self.max_model_len)
        if cdiv(total, self.block_size) > self.block_manager.num_blocks:
            raise ValueError(f"this request needs up to {total} tokens of KV cache but the cache holds only "
                             f"{self.kv_capacity_tokens}; raise kv_cache_memory or lower max_tokens.")

    # ------------------------------------------------------------------ exit
    def abort_request(self, req_id: str) -> RequestOutput | None:
        """Stops a request now and frees its KV blocks; returns its final output (finish_reason
        'abort' on the sequences that had not finished), or None if it is unknown or done."""
        out, stopped = self.output.abort(req_id)
        self._aborted += stopped
        self._release_if_idle()
        self.adapters.reap(self.scheduler.requests.values())
        return out

    def was_scheduled(self, req_id: str) -> bool:
        """Whether any sequence of the request has been scheduled (unknown ids count as scheduled)."""
        return self.output.was_scheduled(req_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        """Requests (not sequences) the engine holds: added, not yet finished or aborted."""
        return len(self.output)

    def num_waiting(self) -> int:
        """Sequences waiting to be scheduled (not yet admitted, or preempted)."""
        return len(self.scheduler.waiting)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def stats(self) -> StepStats:
        """What happened since the last call, for metrics: the last step's numbers and samples,
        the sequences aborts ended, and the gauges as they are now. Each sample is handed out once."""
        st, self._stats = self._stats or StepStats(), None
        st.finished += self._aborted
        self._aborted = []
        st.num_running, st.num_waiting = len(self.scheduler.running), len(self.scheduler.waiting)
        st.kv_cache_usage = self.block_manager.usage
        if self.adapters.enabled:
            st.running_loras, st.waiting_loras = Adapters.of(self.scheduler.running), Adapters.of(self.scheduler.waiting)
        return st

    # ------------------------------------------------------------------ one step
    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        sched = self.scheduler.schedule()
        if not sched and not sched.finished_req_ids:
            return []
        self._mark_scheduled(sched)
        result = self._execute(sched)
        if self.governor is not None:
            self.governor.tick()
        advanced = self.scheduler.update(sched, result)
        outputs, finished = self.output.process(advanced)
        self._stats = self.scheduler.stats
        self._stats.finished += finished
        self._release_if_idle()
        self.adapters.reap(self.scheduler.requests.values())
        return outputs

    def _release_if_idle(self) -> None:
        """With nothing left to run no step would tell the runner which requests finished: tell
        it now, so their sampling state (and a draft model's KV blocks) do not wait for the next
        request."""
        if not self.scheduler.has_unfinished() and self.scheduler.has_finished_to_report():
            self._execute(self.scheduler.schedule())

    def _execute(self, sched):
        return self.executor.execute(sched)

    @property
    def tasks(self) -> frozenset[str]:
        """What the model serves: generate, embed, classify (engine/tasks.py)."""
        return self.serves.tasks

    @property
    def runner(self) -> ModelRunner:
        """Rank 0's runner, to look at (its model, for byte counts and tests); steps go through
        the executor."""
        return self.executor.runner

    def check_health(self) -> None:
        """Raises if the engine can no longer run (a tensor-parallel rank died); called while idle."""
        self.executor.check_health()

    def shutdown(self) -> None:
        """Stops the worker ranks, if any (the engine is unusable afterwards)."""
        self.executor.close()

    def _mark_scheduled(self, sched) -> None:
        now = time.monotonic()
        for entry in sched.scheduled:
            m = self.scheduler.requests[entry.req_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now


def _compile_constraint(grammars: GrammarCompiler | None, params: SamplingParams) -> None:
    spec = params.structured_outputs
    if spec is None:
        return
    if grammars is None:
        raise ValueError("structured outputs need the model's tokenizer; this engine was started without one.")
    if params.ignore_eos:
        raise ValueError("ignore_eos cannot be combined with structured outputs: the constraint decides "
                         "where the output ends.")
    grammars.compile(spec)
