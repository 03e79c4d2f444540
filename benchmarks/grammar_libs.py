"""Why llguidance: compile time of one JSON schema, and per-token mask time along a valid output,
for llguidance and outlines-core on the same vocabulary (the model's own tokenizer). outlines-core
is not a tokenmill dependency: install it to a side directory to run this
(`pip install --target /tmp/oc outlines-core`, then PYTHONPATH=/tmp/oc). xgrammar is not measured:
its wheel requires transformers and triton, which a CPU server should not carry.

    PYTHONPATH=/tmp/oc python benchmarks/grammar_libs.py --model M [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from structured_client import SCHEMA  # noqa: E402

SAMPLE = json.dumps({"name": "Yann Le Goff", "age": 67, "city": "Brest", "job": "retired sailor",
                     "hobbies": ["knots", "chess"], "bio": "Forty years at sea, now he teaches knots."})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from tokenmill.models import loader
    from tokenmill.utils import default_model_path

    import torch
    path = args.model or default_model_path()
    lm = loader.load(path, "float32", torch.device("cpu"), load_tokenizer=True, quantization="none")
    tok, vocab = lm.tokenizer, lm.arch.vocab_size
    eos = sorted(tok.eos_token_ids)
    ids = tok.encode(SAMPLE, add_special_tokens=False)
    rows = {"model": path, "vocab": vocab, "output_tokens": len(ids)}

    import llguidance
    import numpy as np
    t = time.perf_counter()
    lt = llguidance.LLTokenizer(tok.tok.to_str(), n_vocab=vocab, eos_token=eos)
    rows["llguidance_tokenizer_s"] = time.perf_counter() - t
    buf = np.zeros((vocab + 31) // 32, dtype=np.int32)
    t = time.perf_counter()
    m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    m.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
    rows["llguidance_compile_and_first_mask_ms"] = 1e3 * (time.perf_counter() - t)
    per = []
    for i in ids:
        t = time.perf_counter()
        m.unsafe_compute_mask_ptr(buf.ctypes.data, buf.nbytes)
        per.append(time.perf_counter() - t)
        assert m.consume_token(i), m.get_error()
    rows["llguidance_mask_us_median"] = 1e6 * statistics.median(per)
    rows["llguidance_mask_us_max"] = 1e6 * max(per)

    try:
        from outlines_core import Guide, Index, Vocabulary
        from outlines_core.json_schema import build_regex_from_schema
    except ImportError:
        rows["outlines_core"] = "not installed"
    else:
        # the token strings as bytes: decode each id alone (byte-level tokens map back to their bytes)
        t = time.perf_counter()
        table: dict[bytes, list[int]] = {}
        for i in range(tok.vocab_size):
            if i in eos:
                continue
            piece = tok.tok.id_to_token(i)
            if piece is None:
                continue
            b = _piece_bytes(piece)
            table.setdefault(b, []).append(i)
        voc = Vocabulary(eos[0], table)
        rows["outlines_vocabulary_s"] = time.perf_counter() - t
        t = time.perf_counter()
        index = Index(build_regex_from_schema(json.dumps(SCHEMA)), voc)
        guide = Guide(index)
        rows["outlines_compile_and_first_mask_ms"] = 1e3 * (time.perf_counter() - t)
        per = []
        for i in ids:
            t = time.perf_counter()
            guide.get_tokens()
            per.append(time.perf_counter() - t)
            guide.advance(i)
        rows["outlines_mask_us_median"] = 1e6 * statistics.median(per)
        rows["outlines_mask_us_max"] = 1e6 * max(per)
    print(json.dumps(rows, indent=1))
    if args.json:
        with open(args.json, "a", encoding="utf-8") as f:
            f.write(json.dumps(rows) + "\n")


def _piece_bytes(piece: str) -> bytes:
    from tokenmill.models.tokenizer import _bytes_to_unicode
    inv = {c: b for b, c in _bytes_to_unicode().items()}
    if all(ch in inv for ch in piece):
        return bytes(inv[ch] for ch in piece)
    return piece.encode()


if __name__ == "__main__":
    main()
