"""`tokenmill` command line: generate, chat. Engine flags are generated from the config
dataclasses, so every option has one definition and one help text."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from dataclasses import MISSING, fields

from tokenmill.config import CacheConfig, ModelConfig, ParallelConfig, SchedulingConfig


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    for cls in (ModelConfig, CacheConfig, SchedulingConfig, ParallelConfig):
        for f in fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata.get("help", "")
            default = None if f.default is MISSING else f.default
            if f.type in ("bool", bool):
                p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                               help=f"{help_text} (default: {'on' if f.default else 'off'})")
                continue
            kind = _scalar_type(f.type)
            suffix = "" if "default" in help_text else f" (default: {default})"
            p.add_argument(flag, type=kind, default=default, help=help_text + suffix)


def _scalar_type(annotation) -> type:
    text = str(annotation)
    if "float" in text:
        return float
    if "int" in text and "str" not in text:
        return int
    return str


def _engine_kwargs(args: argparse.Namespace) -> dict:
    names = {f.name for cls in (ModelConfig, CacheConfig, SchedulingConfig, ParallelConfig) for f in fields(cls)}
    return {k: v for k, v in vars(args).items() if k in names}


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None, help="seed of this generation")


def _params(args: argparse.Namespace):
    from tokenmill.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.sampling_seed)


def cmd_generate(args: argparse.Namespace) -> int:
    from tokenmill import LLM

    params = _params(args)
    llm = LLM(**_engine_kwargs(args))
    if args.chat_template:
        outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=False)
    else:
        outs = llm.generate(args.prompt, params, use_tqdm=False)
    for out in outs:
        if len(outs) > 1:
            print(f"--- {out.prompt!r}")
        print(out.outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive chat: reads a line, streams the answer token by token, keeps the history."""
    from tokenmill import LLM

    params = _params(args)
    llm = LLM(**_engine_kwargs(args))
    engine, tok = llm.engine, llm.get_tokenizer()
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print("tokenmill chat — empty line or Ctrl-D to quit.", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        history.append({"role": "user", "content": line})
        ids = tok.encode(tok.apply_chat_template(history, add_generation_prompt=True), add_special_tokens=False)
        req_id = f"chat-{turn}"
        turn += 1
        try:
            engine.add_request(req_id, ids, params)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            continue
        answer = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                delta = out.outputs[0].delta_text
                answer.append(delta)
                print(delta, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": "".join(answer)})
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """OpenAI-compatible HTTP server: engine on its own thread, uvicorn on the main one."""
    import uvicorn

    from tokenmill.config import EngineConfig
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.server.api import ServerConfig, build_app
    from tokenmill.server.metrics import Metrics
    from tokenmill.server.transport import front_door

    for flag in ("max_queue_len", "max_connections", "max_request_bytes"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}.")
    for origin in args.allowed_origins or []:
        if origin != "*" and not origin.startswith(("http://", "https://")) or origin.endswith("/"):
            raise ValueError(f"--allowed-origins takes origins like https://app.example.com (or *), got {origin!r}.")
    door = front_door(args)  # its flags checked before the model loads
    keys = _api_keys(args)
    if args.cache_salt_from_api_key and not keys:
        raise ValueError("--cache-salt-from-api-key needs API keys (--api-key or TOKENMILL_API_KEY).")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}.")
    if args.data_parallel_size > 1:
        from tokenmill.router.cli import serve_data_parallel
        return serve_data_parallel(args, keys)
    if args.cpu_cores:
        from tokenmill.cpus import parse_cores
        try:
            os.sched_setaffinity(0, parse_cores(args.cpu_cores))
        except OSError as e:
            raise ValueError(f"--cpu-cores {args.cpu_cores}: {e.strerror} (cores this process may use: "
                             f"{sorted(os.sched_getaffinity(0))})") from None
    config = EngineConfig.from_kwargs(**_engine_kwargs(args))
    # built on its own thread, the one that steps it (AsyncEngine says why)
    client = AsyncEngine(lambda: LLMEngine(config), max_queue_len=args.max_queue_len,
                         request_timeout=args.request_timeout, max_queue_time=args.max_queue_time)
    engine = client.engine
    names = args.served_model_name or [os.path.basename(engine.model_path)]
    metrics = Metrics(names[0])
    client.stat_logger = metrics.record
    app = build_app(client, ServerConfig(served_model_names=names, api_keys=keys,
                                         max_request_bytes=args.max_request_bytes,
                                         client_timeout=args.client_timeout, metrics_public=args.metrics_public,
                                         allowed_origins=args.allowed_origins or [],
                                         cache_salt_from_api_key=args.cache_salt_from_api_key,
                                         tool_call_parser=args.tool_call_parser,
                                         reasoning_parser=args.reasoning_parser), metrics)
    from tokenmill import kernels

    cpu = ""
    if engine.device.type == "cpu":
        cpu = f", CPU kernels {kernels.isa()} ({engine.activation_bits}-bit activations)" if kernels.isa() else \
            ", CPU kernels PyTorch"
    print(f"tokenmill serving {names[0]} ({engine.model_path}) at http://{args.host}:{args.port}/v1 — "
          f"KV cache {engine.kv_capacity_tokens} tokens, max_model_len {engine.max_model_len}{cpu}"
          f"{', API key required' if keys else ''}", file=sys.stderr, flush=True)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, **door,
                                           timeout_keep_alive=args.timeout_keep_alive))
    # the engine died: uvicorn drains and the process exits 1 (also if it died before this line)
    client.on_dead = lambda _: setattr(server, "should_exit", True)
    server.should_exit = client.dead is not None
    try:
        server.run()
    finally:
        client.shutdown()
    if client.dead is not None:
        print("tokenmill: the engine stopped after an internal error (see the log above); exiting with status 1",
              file=sys.stderr, flush=True)
        return 1
    return 0


def _api_keys(args: argparse.Namespace) -> list[str]:
    env = os.environ.get("TOKENMILL_API_KEY", "")
    keys = list(args.api_key or []) + (env.split(",") if env else [])
    if any(not k.strip() for k in keys):  # an empty key would look like auth while letting "Bearer " in
        raise ValueError("--api-key must not be empty, nor any comma-separated entry of TOKENMILL_API_KEY.")
    return [k.strip() for k in keys]


def cmd_router(args: argparse.Namespace) -> int:
    from tokenmill.router.cli import cmd_router as run

    return run(args, _api_keys(args))


def _emit(result: dict, path: str | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text + "\n")


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
        _emit({"base_url": args.base_url, "runs": [{k: v for k, v in s.items() if k != "ttft_values"}
                                                   for s in summaries]}, args.output_json)
        return 0

    from tokenmill.bench import offline
    from tokenmill.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig.from_kwargs(**_engine_kwargs(args)))
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
    _emit(result, args.output_json)
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


def cmd_eval(args: argparse.Namespace) -> int:
    import os

    import torch

    from tokenmill.compress.evaluate import perplexity
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
    with open(data, encoding="utf-8") as f:
        ids = loaded.tokenizer.encode(f.read(), add_special_tokens=False)
    if args.max_tokens:
        ids = ids[:args.max_tokens]
    torch.manual_seed(0)
    result = perplexity(loaded.model, ids, args.context_len, args.stride)
    result.update(model=model_path, data=os.path.abspath(data), quantization=args.quantization,
                  activation_bits=loaded.activation_bits)
    _emit(result, args.output_json)
    return 0


def cmd_compress(args: argparse.Namespace) -> int:
    from tokenmill.compress import commands

    run = {"quantize": commands.run_quantize, "prune": commands.run_prune, "distill": commands.run_distill,
           "qat": commands.run_qat}
    report = run[args.cmd](args)
    _emit({k: v for k, v in report.items() if k != "history"}, args.output_json)
    print(f"wrote {args.output}", file=sys.stderr)
    return 0


def _compress_parsers(sub) -> None:
    """quantize | prune | distill | qat: each writes a Hugging Face checkpoint directory, atomically."""
    calib_help = "calibration text file (required by the methods that calibrate)"

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
    q.add_argument("--calib", default=None, help=calib_help)
    q.add_argument("--calib-samples", type=int, default=128, help="calibration windows")
    q.add_argument("--calib-seq-len", type=int, default=512, help="tokens per calibration window")
    q.add_argument("--act-order", action="store_true", help="GPTQ: columns by decreasing activation energy")
    q.add_argument("--damp", type=float, default=0.01, help="GPTQ: Hessian damping (fraction of mean diagonal)")
    common(q, "float16")

    pr = sub.add_parser("prune", help="prune: magnitude, wanda, 2:4, heads, ffn, layers")
    pr.add_argument("--model", default=None, help="GGUF file or HF directory (default: the default model)")
    pr.add_argument("--method", required=True, help="magnitude | wanda | 2:4 | heads | ffn | layers")
    pr.add_argument("--sparsity", type=float, default=None,
                    help="fraction in (0, 1): of weights (magnitude, wanda), of query heads per KV group (heads), "
                         "of FFN channels (ffn), of layers (layers); 2:4 is 0.5")
    pr.add_argument("--calib", default=None, help=calib_help)
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
    t.add_argument("--act-order", action="store_true", help="GPTQ start: columns by decreasing activation energy")
    t.add_argument("--calib", default=None, help="calibration text for --init awq|gptq (default: --data)")
    t.add_argument("--calib-samples", type=int, default=128, help="calibration windows")
    t.add_argument("--calib-seq-len", type=int, default=512, help="tokens per calibration window")
    t.add_argument("--scale-lr", type=float, default=1e-3,
                   help="peak learning rate of the log quantization scales (0: scales stay as initialised)")
    training(t, 2e-5)
    common(t, "float16")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tokenmill", description="Fast LLM inference with vLLM's API.")
    p.add_argument("--log-level", default="INFO")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="complete one or more prompts and print the results")
    g.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    g.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user chat message")
    _sampling_args(g)
    _add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat that streams its answers")
    c.add_argument("--system", default=None, help="system prompt")
    _sampling_args(c)
    _add_engine_args(c)
    c.set_defaults(func=cmd_chat)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", action="append", default=None,
                   help="name(s) clients use for the model (default: the model file name)")
    s.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer <key>' (repeatable; also TOKENMILL_API_KEY, comma-separated)")
    s.add_argument("--metrics-public", action="store_true",
                   help="serve /metrics without the API key (default: behind it when keys are set)")
    s.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                   help="how the model writes tool calls (default: the format its chat template renders)")
    s.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="return a thinking model's <think>...</think> as reasoning_content (default: off)")
    s.add_argument("--cache-salt-from-api-key", action="store_true",
                   help="give each API key its own prefix cache (no tenant can probe another's prompts through "
                        "cache hits); needs --api-key")
    s.add_argument("--allowed-origins", action="append", default=None,
                   help="browser origins allowed by CORS, e.g. https://app.example.com (repeatable; default: none)")
    s.add_argument("--max-queue-len", type=int, default=1024,
                   help="waiting requests beyond which new ones get 503 (default: 1024)")
    s.add_argument("--request-timeout", type=_seconds, default=None,
                   help="seconds a request may take from arrival to its last token; past it the request stops "
                        "and gets 504 (an error event if streaming). Default: no limit")
    s.add_argument("--max-queue-time", type=_seconds, default=None,
                   help="seconds a request may wait before it is first scheduled; past it 503. Default: no limit")
    s.add_argument("--timeout-keep-alive", type=_seconds, default=5.0,
                   help="seconds an idle keep-alive connection stays open (default: 5)")
    from tokenmill.server.transport import add_arguments as front_door_args
    front_door_args(s, _seconds)
    s.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas on this host behind one router and port, each on its share of the cores "
                        "(--threads then counts per replica) and of the KV cache budget (default: 1)")
    s.add_argument("--router-policy", default="cache_aware", choices=["cache_aware", "least_load", "round_robin"],
                   help="how --data-parallel-size spreads requests (see `tokenmill router --help`)")
    s.add_argument("--cpu-cores", default=None,
                   help="pin the server to these CPU cores, e.g. 0-3,8 (Linux; default: all it may use)")
    _add_engine_args(s)
    s.set_defaults(func=cmd_serve, parser=s)

    rt = sub.add_parser("router", help="load balancer over serve replicas (or any OpenAI-compatible servers)")
    from tokenmill.router.cli import add_router_args
    add_router_args(rt, _seconds)
    rt.set_defaults(func=cmd_router)

    e = sub.add_parser("eval", help="model quality")
    esub = e.add_subparsers(dest="eval", required=True)
    pp = esub.add_parser("ppl", help="sliding-window perplexity on a text file")
    pp.add_argument("--model", default=None, help="GGUF file or HF directory (default: the default model)")
    pp.add_argument("--data", default=None, help="text file to evaluate (required), e.g. WikiText-2's test split")
    pp.add_argument("--context-len", type=int, default=512)
    pp.add_argument("--stride", type=int, default=256)
    pp.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens of the text")
    pp.add_argument("--dtype", default="auto")
    pp.add_argument("--device", default="auto")
    pp.add_argument("--quantization", default="auto", help="auto | none | int8 | int4 | awq | gptq (as for serving)")
    pp.add_argument("--quantization-group-size", type=int, default=32)
    pp.add_argument("--activation-bits", default="auto", type=lambda v: v if v == "auto" else int(v),
                    help="auto | 16 | 8 (as for serving)")
    pp.add_argument("--output-json", default=None)
    pp.set_defaults(func=cmd_eval)

    _compress_parsers(sub)

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
            _add_engine_args(sp)
        sp.set_defaults(func=cmd_bench)
    return p


def _seconds(text: str) -> float:
    import math
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive number of seconds")
    return value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
