"""Tokenizer: the `tokenizers` library built from `tokenizer.json` or from GGUF metadata, plus the
special tokens and chat template that come with the model.

GGUF files carry the vocabulary, merges and token types but not the pre-tokenizer; the split
regex is chosen by `tokenizer.ggml.pre`, as llama.cpp does, so ids match the original tokenizer.
"""
from __future__ import annotations

import json
import os
import threading

from tokenizers import (AddedToken, Regex, Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers,
                        processors)

from tokenmill.models import chat_template

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regexes applied in order (llama.cpp's table, the common entries)
_PRE_SPLITS = {
    "default": [_GPT2_SPLIT], "gpt2": [_GPT2_SPLIT], "smollm": [r"\p{N}", _GPT2_SPLIT],
    "starcoder": [r"\p{N}", _GPT2_SPLIT], "refact": [r"\p{N}", _GPT2_SPLIT],
    "llama3": [_LLAMA3_SPLIT], "llama-bpe": [_LLAMA3_SPLIT], "llama-v3": [_LLAMA3_SPLIT],
    "smaug-bpe": [_LLAMA3_SPLIT], "qwen2": [_QWEN2_SPLIT], "deepseek-r1-qwen": [_QWEN2_SPLIT],
}
_CONTROL, _USER_DEFINED = 3, 4
# SentencePiece pieces longer than this are not built from merges (only matched whole, as added or
# byte-fallback text would be): real vocabularies' pieces are far shorter, and the bound keeps
# loading a hostile file linear in its size
_MAX_MERGED_LEN = 256


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of every byte, the alphabet byte-level vocabularies are written in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class Tokenizer:
    def __init__(self, tok: HFTokenizer, bos_token: str | None, eos_token: str | None,
                 eos_token_ids: set[int], chat_template_src: str | None) -> None:
        self.tok = tok
        self.bos_token, self.eos_token = bos_token, eos_token
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template_src
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        # an upper bound on the characters one token decodes to (byte-level spellings are one
        # character per byte, byte-fallback pieces "<0x41>" six): N tokens never hold more text
        # than N times this, so longer prompts can be refused before they are tokenized
        self.max_token_chars = max(map(len, tok.get_vocab(with_added_tokens=True)), default=1)
        self.special_tokens = sorted((t.content for t in tok.get_added_tokens_decoder().values() if t.special),
                                     key=len, reverse=True)
        self._as_text: HFTokenizer | None = None  # a copy that reads special-token text as plain text
        self._truncating: HFTokenizer | None = None  # a copy with truncation on, for `encode_input`
        self._truncation_lock = threading.Lock()

    # ------------------------------------------------------------------ use
    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. `split_special_tokens`: special-token text ("<|im_start|>") is
        tokenized as the characters it is made of, not as the control token (Hugging Face's name).
        Goes through `encode_batch`, which releases the GIL: a long prompt tokenizing on a worker
        thread does not stall the server's event loop or the engine thread."""
        tok = self.tok
        if split_special_tokens and self.special_tokens:
            if self._as_text is None:
                self._as_text = HFTokenizer.from_str(self.tok.to_str())
                self._as_text.encode_special_tokens = True
            tok = self._as_text
        return tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def encode_input(self, text: str, pair: str | None = None, max_tokens: int | None = None
                     ) -> tuple[list[int], int | None]:
        """An embedding / scoring input with the model's special tokens: one text, or a pair (a
        cross-encoder's query and document), cut to `max_tokens` as Hugging Face truncates (the
        longer text first, special tokens kept). Returns the ids and where the pair's second text
        begins by token type (None: one text, or a model with one token type)."""
        if max_tokens is None:
            enc = self.tok.encode_batch([text if pair is None else (text, pair)])[0]
        else:
            with self._truncation_lock:  # truncation is a setting of the tokenizer object: a copy of our own
                if self._truncating is None:
                    self._truncating = HFTokenizer.from_str(self.tok.to_str())
                self._truncating.enable_truncation(max_tokens, strategy="longest_first")
                enc = self._truncating.encode(text, pair)
        return enc.ids, next((i for i, t in enumerate(enc.type_ids) if t == 1), None)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, tools: list | None = None,
                    template_kwargs: dict | None = None, split_special_tokens: bool = True,
                    continue_final_message: bool = False) -> list[int]:
        """The rendered conversation's token ids. With `split_special_tokens` (the default), special-
        token text inside the messages is read as text, so a user cannot forge a turn by typing
        "<|im_start|>system"; the template's own control tokens stay control tokens. Where no
        message holds such text (nearly always) the ids are exactly those of the rendered string."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs, continue_final_message)
        fields = [(i, k) for i, m in enumerate(messages) for k, v in m.items()
                  if k != "role" and isinstance(v, str) and any(t in v for t in self.special_tokens)]
        if not split_special_tokens or not fields:
            return self.encode(text, add_special_tokens=False)
        # render again with that text masked by as many private-use characters: where the two
        # renderings differ is where message text put special-token text
        masked = [dict(m) for m in messages]
        for i, k in fields:
            for t in self.special_tokens:
                masked[i][k] = masked[i][k].replace(t, "\ue000" * len(t))
        shadow = self.apply_chat_template(masked, add_generation_prompt, tools, template_kwargs, continue_final_message)
        if len(shadow) != len(text):
            raise ValueError("messages contain special-token text that this model's chat template rewrites; "
                             "remove it, or send split_special_tokens=false to let it act as control tokens.")
        ids, start, i = [], 0, 0
        while i < len(text):
            if shadow[i] == "\ue000" and text[i] != "\ue000":
                j = i
                while j < len(text) and shadow[j] == "\ue000" and text[j] != "\ue000":
                    j += 1
                ids += self.encode(text[start:i], add_special_tokens=False)
                ids += self.encode(text[i:j], add_special_tokens=False, split_special_tokens=True)
                start = i = j
            else:
                i += 1
        return ids + self.encode(text[start:], add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list | None = None, template_kwargs: dict | None = None,
                            continue_final_message: bool = False) -> str:
        """`template_kwargs`: extra template variables (the API's chat_template_kwargs), passed as a
        dict so that one named like an argument here is refused by `render`, not a TypeError.
        `continue_final_message`: the rendering ends inside the last message (an assistant's answer
        begun by the client, Anthropic's prefill), cut after its text as transformers cuts it."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; use plain completions (generate) instead of chat.")
        special = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        text = chat_template.render(self.chat_template, messages, add_generation_prompt, special, tools,
                                    template_kwargs)
        if continue_final_message:
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str) or not final.strip() or final.strip() not in text:
                raise ValueError("continue_final_message needs a last message whose text the chat template renders")
            text = text[:text.rindex(final.strip()) + len(final.strip())]
        return text

    def save(self, path: str) -> None:
        """Write tokenizer.json, tokenizer_config.json and generation_config.json, which
        `from_hf_dir` (and transformers) read back: a GGUF model's tokenizer becomes a HF one."""
        self.tok.save(os.path.join(path, "tokenizer.json"))
        cfg = {"bos_token": self.bos_token, "eos_token": self.eos_token, "chat_template": self.chat_template,
               "tokenizer_class": "PreTrainedTokenizerFast"}
        with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump({k: v for k, v in cfg.items() if v is not None}, f, indent=2, ensure_ascii=False)
        with open(os.path.join(path, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump({"eos_token_id": sorted(self.eos_token_ids)}, f, indent=2)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_hf_dir(cls, path: str) -> "Tokenizer":
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.exists(tok_file):
            raise ValueError(f"{path} has no tokenizer.json; tokenmill needs the fast-tokenizer file "
                             "(save it with `AutoTokenizer.from_pretrained(...).save_pretrained(dir)`).")
        tok = HFTokenizer.from_file(tok_file)
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        gen = _read_json(os.path.join(path, "generation_config.json"))
        template = cfg.get("chat_template")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if template is None and os.path.exists(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        bos, eos = _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token"))
        eos_ids = set()
        if eos is not None and tok.token_to_id(eos) is not None:
            eos_ids.add(tok.token_to_id(eos))
        gen_eos = gen.get("eos_token_id")
        eos_ids |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        return cls(tok, bos, eos, eos_ids, template)

    @classmethod
    def from_gguf(cls, meta: dict) -> "Tokenizer":
        kind = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("the GGUF file carries no tokenizer (tokenizer.ggml.tokens is missing).")
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        if kind == "gpt2":
            tok = _byte_level_bpe(tokens, meta.get("tokenizer.ggml.merges") or [], meta.get("tokenizer.ggml.pre", "default"))
            add_bos = False  # as Hugging Face's converter: byte-level vocabularies add no BOS
        elif kind == "llama":
            tok = _sentencepiece_bpe(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens), types)
            add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
        elif kind == "bert":
            return cls(_wordpiece(tokens, types, meta), None, None, set(), None)
        else:
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level BPE), "
                             "'llama' (SentencePiece BPE), 'bert' (WordPiece).")
        spelled = set(_bytes_to_unicode().values()) if kind == "gpt2" else None
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
                                if ty == _CONTROL and (spelled is None or set(t) <= spelled)])
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
                        if ty == _USER_DEFINED])

        def special(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        bos, eos = special("bos_token_id"), special("eos_token_id")
        if add_bos and bos is not None:
            tok.post_processor = processors.TemplateProcessing(
                single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, meta["tokenizer.ggml.bos_token_id"])])
        eos_ids = {meta[f"tokenizer.ggml.{k}"] for k in ("eos_token_id", "eot_token_id", "eom_token_id")
                   if meta.get(f"tokenizer.ggml.{k}") is not None}
        return cls(tok, bos, eos, eos_ids, meta.get("tokenizer.chat_template"))


def _wordpiece(tokens: list[str], types: list[int], meta: dict) -> HFTokenizer:
    """BERT's WordPiece from llama.cpp's spelling of it: a word's first piece carries a leading
    "▁", a continuation piece none (BERT's "##" prefix), control tokens ("[CLS]") as they are.
    Lower-cased and accents stripped where the file says so (llama.cpp's normalizer keys), split on
    whitespace and punctuation, [CLS] text [SEP] (text [SEP] after it for a pair's second text)."""
    vocab: dict[str, int] = {}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        piece = t if ty == _CONTROL else t[1:] if t.startswith("\u2581") else f"##{t}"
        vocab.setdefault(piece, i)

    def special(key: str, default: str, alias: str | None = None) -> tuple[str, int]:
        i = meta.get(f"tokenizer.ggml.{key}")
        if (i is None or not 0 <= i < len(tokens)) and alias is not None:
            i = meta.get(f"tokenizer.ggml.{alias}")
        if i is None or not 0 <= i < len(tokens):
            i = vocab.get(default)
        if i is None:
            raise ValueError(f"the GGUF WordPiece vocabulary has no {default} token (tokenizer.ggml.{key}).")
        return tokens[i], i

    unk = special("unknown_token_id", "[UNK]")[0]
    tok = HFTokenizer(models.WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    lower = bool(meta.get("tokenizer.ggml.normalizer.lowercase", False))
    tok.normalizer = normalizers.BertNormalizer(
        lowercase=lower, strip_accents=bool(meta.get("tokenizer.ggml.normalizer.strip_accents", lower)))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.BertProcessing(special("seperator_token_id", "[SEP]"),
                                                   special("cls_token_id", "[CLS]", alias="bos_token_id"))
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
                            if ty == _CONTROL])
    return tok


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> HFTokenizer:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for i, t in enumerate(tokens):
        key = t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
        vocab.setdefault(key, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    splits = _PRE_SPLITS.get(pre, [_GPT2_SPLIT])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int]) -> HFTokenizer:
    """SentencePiece-BPE vocabularies (Llama 2, TinyLlama, Mistral) list scores but no merges;
    the merges are recovered from the vocabulary: every split of a token into two tokens, ranked
    by the merged token's score (what SentencePiece's BPE does at encode time)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    lengths = sorted({len(t) for t in tokens})
    for t, score in zip(tokens, scores):
        # both halves are tokens, so only split points at token lengths are candidates: a file
        # with one enormous token costs its length once, not its length squared
        if len(t) > _MAX_MERGED_LEN:
            continue
        for k in lengths:
            if k >= len(t):
                break
            left, right = t[:k], t[k:]
            if left in vocab and right in vocab:
                merges.append((score, vocab[left], vocab[right], left, right))
    merges.sort(key=lambda m: (-m[0], m[1], m[2]))
    unk = next((t for t, ty in zip(tokens, types) if ty == 2), None)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges], unk_token=unk,
                                 fuse_unk=True, byte_fallback=True))
    # as Hugging Face's fast Llama tokenizer: spaces become "▁", one is prepended unless the text
    # already starts with one
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return tok


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_str(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok
