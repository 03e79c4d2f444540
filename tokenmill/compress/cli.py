"""`tokenmill eval ppl` and `tokenmill compress quantize | prune | distill | qat`: offline model
work, each writing a JSON report (and the compress commands a checkpoint directory)."""
from __future__ import annotations

import argparse
import sys

from tokenmill.flags import emit_json


def add_eval_parser(sub) -> None:
    e = sub.add_parser("eval", help="model quality")
    esub = e.add_subparsers(dest="eval", required=True)
    pp = esub.add_parser("ppl", help="sliding-window perplexity on a text file")
    pp.add_argument("--model", default=None, help="GGUF file or HF directory (default: the default model)")
    pp.add_argument("--data", default=None, help="text file to evaluate (required), e.g. WikiText-2's test split")
    pp.add_argument("--context-len", type=int, default=512)
    pp.add_argument("--stride", type=int, default=256)
    pp.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens of the text")
    pp.add_argument("--scoring", default="sliding", choices=["sliding", "chunks"],
                    help="sliding: windows of --context-len advancing by --stride (Hugging Face's recipe); chunks: "
                         "llama-perplexity's (non-overlapping chunks, BOS first, second half scored)")
    pp.add_argument("--dtype", default="auto")
    pp.add_argument("--device", default="auto")
    pp.add_argument("--quantization", default="auto", help="auto | none | int8 | int4 | awq | gptq (as for serving)")
    pp.add_argument("--quantization-group-size", type=int, default=32)
    pp.add_argument("--activation-bits", default="auto", type=lambda v: v if v == "auto" else int(v),
                    help="auto | 16 | 8 (as for serving)")
    pp.add_argument("--kv-cache-dtype", default=None, choices=["float32", "float16", "bfloat16", "int8", "fp8_e5m2"],
                    help="score through a paged KV cache of this dtype, each window fed --kv-chunk tokens at a time "
                         "(attention reads earlier tokens' K/V back from the cache, as a server's does); default: "
                         "no cache, attention over float K/V")
    pp.add_argument("--kv-chunk", type=int, default=32, help="tokens per forward pass with --kv-cache-dtype")
    pp.add_argument("--output-json", default=None)
    pp.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    import contextlib
    import os

    import torch

    from tokenmill.compress.evaluate import chunked_perplexity, paged_cache, perplexity
    from tokenmill.models import loader
    from tokenmill.utils import default_model_path, resolve_device

    if args.data is None:
        raise ValueError("--data FILE is required: the text to measure perplexity on (e.g. WikiText-2's test split).")
    data = args.data
    if not os.path.exists(data):
        raise ValueError(f"evaluation text {data} not found; pass --data FILE.")
    model_path = args.model or default_model_path()
    loaded = loader.load(model_path, args.dtype, resolve_device(args.device), quantization=args.quantization,
                         group_size=args.quantization_group_size, activation_bits=args.activation_bits)
    chunks = args.scoring == "chunks"
    with open(data, encoding="utf-8") as f:
        ids = loaded.tokenizer.encode(f.read(), add_special_tokens=chunks)
    if args.max_tokens:
        ids = ids[:args.max_tokens]
    torch.manual_seed(0)
    paged = paged_cache(loaded.model, args.kv_cache_dtype, args.context_len, args.kv_chunk) \
        if args.kv_cache_dtype else contextlib.nullcontext(None)
    with paged as scorer:
        if chunks:
            bos = loaded.tokenizer.encode("", add_special_tokens=True)
            result = chunked_perplexity(loaded.model, ids, args.context_len, bos[0] if bos else None, scorer=scorer)
        else:
            result = perplexity(loaded.model, ids, args.context_len, args.stride, scorer=scorer)
    result.update(model=model_path, data=os.path.abspath(data), quantization=args.quantization,
                  activation_bits=loaded.activation_bits, kv_cache_dtype=args.kv_cache_dtype or "none",
                  kv_chunk=args.kv_chunk if args.kv_cache_dtype else None)
    emit_json(result, args.output_json)
    return 0


def cmd_compress(args: argparse.Namespace) -> int:
    from tokenmill.compress import commands

    run = {"quantize": commands.run_quantize, "prune": commands.run_prune, "distill": commands.run_distill,
           "qat": commands.run_qat}
    report = run[args.cmd](args)
    emit_json({k: v for k, v in report.items() if k != "history"}, args.output_json)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def add_compress_parsers(sub) -> None:
    """quantize | prune | distill | qat: each writes a Hugging Face checkpoint directory, atomically."""
    calib_help = ("calibration source (required by the methods that calibrate): a text file, or a .jsonl of chats "
                  "rendered with the model's template; repeat to mix sources, windows drawn equally from each")

    def common(p: argparse.ArgumentParser, dtype: str) -> None:
        p.add_argument("--output", required=True, help="directory to write (must not exist or be empty)")
        p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
        p.add_argument("--dtype", default=dtype, choices=["float32", "bfloat16", "float16"],
                       help="dtype of the float tensors written")
        p.add_argument("--output-json", default=None, help="also write the report here")
        p.add_argument("--quiet", action="store_true", help="no progress bar")
        p.set_defaults(func=cmd_compress)

    q = sub.add_parser("quantize", help="quantize a float model: rtn-int8, rtn-int4, awq, gptq")
    q.add_argument("--model", default=None, help="GGUF file or HF directory (default: the default model)")
    q.add_argument("--method", required=True, help="rtn-int8 | rtn-int4 | awq | gptq")
    q.add_argument("--group-size", type=int, default=128, help="inputs per int4 scale (32, 64, 128, 256)")
    q.add_argument("--allow-partial-groups", action="store_true",
                   help="accept a group size that does not divide an input dimension (shorter last group)")
    q.add_argument("--calib", action="append", default=None, help=calib_help)
    q.add_argument("--calib-samples", type=int, default=128, help="calibration windows")
    q.add_argument("--calib-seq-len", type=int, default=512, help="tokens per calibration window")
    q.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=None,
                   help="GPTQ: columns by decreasing activation energy, groups kept contiguous (default: on)")
    q.add_argument("--damp", type=float, default=0.01, help="GPTQ: Hessian damping (fraction of mean diagonal)")
    q.add_argument("--hessian-shrink", type=float, default=0.25,
                   help="GPTQ: pull X^T X's off-diagonal toward 0 by this fraction (0: plain GPTQ; robustness to text "
                        "unlike the calibration's)")
    q.add_argument("--awq-clip", action=argparse.BooleanOptionalAction, default=False,
                   help="AWQ: also search each group's clipping range after the scales (default: off; "
                        "benchmarks/quantize_ood.sh measures both)")
    q.add_argument("--compute-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                   help="the calibration's matrix products (auto: bfloat16 where the CPU has AVX512-BF16 or AMX)")
    q.add_argument("--output-format", default="safetensors", choices=["safetensors", "gguf"],
                   help="safetensors: an AWQ/GPTQ checkpoint directory; gguf: one file llama.cpp runs "
                        "(Q4_1/Q8_0 blocks holding the chosen integers; needs a GGUF --model)")
    common(q, "float16")

    pr = sub.add_parser("prune", help="prune: magnitude, wanda, 2:4, heads, ffn, layers")
    pr.add_argument("--model", default=None, help="GGUF file or HF directory (default: the default model)")
    pr.add_argument("--method", required=True, help="magnitude | wanda | 2:4 | heads | ffn | layers")
    pr.add_argument("--sparsity", type=float, default=None,
                    help="fraction in (0, 1): of weights (magnitude, wanda), of query heads per KV group (heads), "
                         "of FFN channels (ffn), of layers (layers); 2:4 is 0.5")
    pr.add_argument("--calib", action="append", default=None, help=calib_help)
    pr.add_argument("--calib-samples", type=int, default=64)
    pr.add_argument("--calib-seq-len", type=int, default=512)
    common(pr, "bfloat16")

    def training(p: argparse.ArgumentParser, lr: float) -> None:
        p.add_argument("--data", default=None, help="training text file (required)")
        p.add_argument("--eval-data", default=None, help="text for the periodic perplexity (e.g. wikitext-2/test.txt)")
        p.add_argument("--eval-tokens", type=int, default=4096, help="tokens of --eval-data scored each time")
        p.add_argument("--eval-every", type=int, default=50, help="steps between perplexity evaluations (0: never)")
        p.add_argument("--steps", type=int, required=True)
        p.add_argument("--batch-size", type=int, default=4, help="sequences per step")
        p.add_argument("--seq-len", type=int, default=256)
        p.add_argument("--lr", type=float, default=lr, help="peak learning rate (AdamW, warmup then cosine)")
        p.add_argument("--warmup-steps", type=int, default=10)
        p.add_argument("--temperature", type=float, default=2.0, help="softening of both distributions in the KL")
        p.add_argument("--hidden-loss-weight", type=float, default=0.0, help="weight of the final-hidden-state MSE")
        p.add_argument("--save-every", type=int, default=25, help="steps between resumable checkpoints")
        p.add_argument("--checkpoint-dir", default=None, help="resume state (default: OUTPUT.ckpt; removed when done)")
        p.add_argument("--seed", type=int, default=0)

    d = sub.add_parser("distill", help="knowledge distillation of a student from a teacher")
    d.add_argument("--teacher", default=None, help="teacher model (default: the default model)")
    d.add_argument("--student", required=True, help="student model (e.g. a pruned checkpoint)")
    training(d, 2e-4)
    common(d, "bfloat16")

    t = sub.add_parser("qat", help="quantization-aware training from an RTN, AWQ or GPTQ start, distilled from "
                                   "the float model; writes the AWQ/GPTQ checkpoint quantize writes")
    t.add_argument("--model", default=None, help="float model to quantize (default: the default model)")
    t.add_argument("--teacher", default=None, help="teacher (default: --model itself, in float)")
    t.add_argument("--bits", type=int, default=4, help="4 (group-wise) or 8 (per-channel symmetric)")
    t.add_argument("--group-size", type=int, default=None, help="inputs per int4 scale (default 128; -1 for --bits 8)")
    t.add_argument("--allow-partial-groups", action="store_true",
                   help="accept a group size that does not divide an input dimension (shorter last group)")
    t.add_argument("--init", default="rtn", help="the post-training quantization to start from: rtn | awq | gptq")
    t.add_argument("--act-order", action=argparse.BooleanOptionalAction, default=None,
                   help="GPTQ start: columns by decreasing activation energy (default: on)")
    t.add_argument("--calib", action="append", default=None,
                   help="calibration source for --init awq|gptq, repeatable as for quantize (default: --data)")
    t.add_argument("--calib-samples", type=int, default=128, help="calibration windows")
    t.add_argument("--calib-seq-len", type=int, default=512, help="tokens per calibration window")
    t.add_argument("--scale-lr", type=float, default=1e-3,
                   help="peak learning rate of the log quantization scales (0: scales stay as initialised)")
    training(t, 2e-5)
    common(t, "float16")
