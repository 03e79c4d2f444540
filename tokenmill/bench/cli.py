"""`tokenmill bench latency | throughput | serve`: the engine offline in this process, or any
OpenAI-compatible server over HTTP."""
from __future__ import annotations

import argparse
import logging
import sys

from tokenmill.flags import add_engine_args, emit_json, engine_kwargs


def add_parsers(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks: latency, throughput (offline), serve (any OpenAI server)")
    bsub = b.add_subparsers(dest="bench", required=True)
    for name, text in (("latency", "one request: TTFT, decode tokens/s, weight bandwidth"),
                       ("throughput", "offline: N requests at once, tokens/s"),
                       ("serve", "load an OpenAI-compatible server, report TTFT/TPOT/ITL/E2E percentiles")):
        sp = bsub.add_parser(name, help=text)
        sp.add_argument("--input-len", type=int, default=32, help="prompt tokens (random prompts)")
        sp.add_argument("--output-len", type=int, default=256, help="tokens to generate (EOS ignored)")
        sp.add_argument("--workload-seed", type=int, default=0, help="seed of random prompts and arrivals")
        sp.add_argument("--output-json", default=None, help="also write the JSON result here")
        if name == "latency":
            sp.add_argument("--repeats", type=int, default=3, help="measured runs after one warm-up")
            sp.add_argument("--prompt-file", default=None,
                            help="a real prompt (text) instead of random tokens; the run then stops at EOS or "
                                 "--output-len, and decode speed counts the tokens produced")
            sp.add_argument("--chat", action="store_true", help="send --prompt-file as a user message (chat template)")
        else:
            sp.add_argument("--num-prompts", type=int, default=64)
            sp.add_argument("--workload", default=None,
                            help="JSONL of {prompt|prompt_token_ids, max_tokens} (e.g. ../shared/bench/workload_*.jsonl)")
            sp.add_argument("--mt-bench", default=None, help="question.jsonl: first turns as prompts")
        if name == "serve":
            sp.add_argument("--base-url", default="http://127.0.0.1:8000")
            sp.add_argument("--model-name", default="default", help="the `model` field to send")
            sp.add_argument("--concurrency", default="16", help="closed-loop streams; a list like 1,4,16 runs each")
            sp.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals (req/s) instead")
            sp.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
            sp.add_argument("--eos-mode", default="ignore_eos", help="ignore_eos | min_tokens | none")
            sp.add_argument("--api-key", default=None)
            sp.add_argument("--plot", default=None, help="PNG: throughput vs concurrency and TTFT CDF")
        else:
            add_engine_args(sp)
        sp.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from tokenmill.bench import workload

    if args.bench == "serve":
        import asyncio

        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the report
        from tokenmill.bench import serving

        items = workload.load(args.workload, args.num_prompts, args.workload_seed, args.input_len, args.output_len,
                              50000, args.mt_bench)
        levels = [int(c) for c in str(args.concurrency).split(",")]
        summaries = []
        for c in levels:
            summary = asyncio.run(serving.run(args.base_url, args.model_name, items, c, args.request_rate,
                                              args.endpoint, args.eos_mode, args.api_key, args.workload_seed))
            print(f"c={c}: {summary['output_tokens_per_s']:.1f} out tok/s, TTFT p50 {summary['ttft_p50_s']} s, "
                  f"p99 {summary['ttft_p99_s']} s, errors {summary['errors']}", file=sys.stderr)
            summaries.append(summary)
        if args.plot:
            serving.plot(summaries, args.plot)
        emit_json({"base_url": args.base_url, "runs": [{k: v for k, v in s.items() if k != "ttft_values"}
                                                   for s in summaries]}, args.output_json)
        return 0

    from tokenmill.bench import offline
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_kwargs(**engine_kwargs(args)))
    if args.bench == "latency":
        if args.prompt_file:
            prompt = _prompt_from_file(engine, args.prompt_file, args.chat)
        else:
            prompt = workload.load(None, 1, args.workload_seed, args.input_len, args.output_len,
                                   engine.arch.vocab_size)[0].prompt
        result = offline.latency(engine, prompt, args.output_len, args.repeats, ignore_eos=not args.prompt_file)
    else:
        items = workload.load(args.workload, args.num_prompts, args.workload_seed, args.input_len, args.output_len,
                              engine.arch.vocab_size, args.mt_bench)
        result = offline.throughput(engine, items)
    from tokenmill import kernels

    result["model"] = engine.model_path
    result["threads"] = __import__("torch").get_num_threads()
    result["cpu_kernels"] = kernels.isa() or "pytorch"  # the ISA variant that ran, or PyTorch's kernels
    result["activation_bits"] = engine.activation_bits
    emit_json(result, args.output_json)
    return 0


def _prompt_from_file(engine, path: str, chat: bool) -> list[int]:
    """A real prompt for `bench latency`: the file's text, as one user message with `--chat`."""
    tok = engine.tokenizer
    if tok is None:
        raise ValueError("--prompt-file needs the model's tokenizer.")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if chat:
        text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return tok.encode(text, add_special_tokens=False)
    return tok.encode(text)
