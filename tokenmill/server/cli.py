"""`tokenmill serve`: the OpenAI-compatible HTTP server over one engine in this process (the
data-parallel form, replicas behind a router, is router/cli.py's)."""
from __future__ import annotations

import argparse
import os
import sys

from tokenmill.flags import add_config_args, add_engine_args, api_keys, engine_kwargs, seconds
from tokenmill.server.config import ServerConfig


def add_parser(sub, command) -> None:
    """`command`: the function `serve` runs (the top-level cli's: one process, or data parallel)."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_config_args(s, ServerConfig)
    from tokenmill.server.transport import add_arguments as front_door_args
    front_door_args(s, seconds)
    s.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas on this host behind one router and port, each on its share of the cores "
                        "(--threads then counts per replica) and of the KV cache budget (default: 1)")
    s.add_argument("--router-policy", default="cache_aware", choices=["cache_aware", "least_load", "round_robin"],
                   help="how --data-parallel-size spreads requests (see `tokenmill router --help`)")
    s.add_argument("--cpu-cores", default=None,
                   help="pin the server to these CPU cores, e.g. 0-3,8 (Linux; default: all it may use)")
    add_engine_args(s)
    s.set_defaults(func=command, parser=s)


def check_args(args: argparse.Namespace) -> tuple[dict, list[str]]:
    """The serve flags checked before anything loads: (uvicorn's front-door settings, API keys)."""
    from tokenmill.server.transport import front_door

    for flag in ("max_queue_len", "max_connections", "max_request_bytes"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}.")
    for origin in args.allowed_origins or []:
        if origin != "*" and not origin.startswith(("http://", "https://")) or origin.endswith("/"):
            raise ValueError(f"--allowed-origins takes origins like https://app.example.com (or *), got {origin!r}.")
    door = front_door(args)  # its flags checked before the model loads
    keys = api_keys(args)
    if args.cache_salt_from_api_key and not keys:
        raise ValueError("--cache-salt-from-api-key needs API keys (--api-key or TOKENMILL_API_KEY).")
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}.")
    from tokenmill.server.lora_api import parse_modules
    parse_modules(args.lora_modules or [])
    if args.lora_modules or args.enable_lora_runtime_updates:
        args.enable_lora = True  # adapters named at start or to come at run time: the engine needs its slots
    return door, keys


def serve(args: argparse.Namespace, door: dict, keys: list[str]) -> int:
    """OpenAI-compatible HTTP server: engine on its own thread, uvicorn on the main one."""
    import uvicorn

    from tokenmill.config import EngineConfig
    from tokenmill.engine.async_engine import AsyncEngine
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.server.api import build_app
    from tokenmill.server.metrics import Metrics

    if args.cpu_cores:
        from tokenmill.cpus import parse_cores
        try:
            os.sched_setaffinity(0, parse_cores(args.cpu_cores))
        except OSError as e:
            raise ValueError(f"--cpu-cores {args.cpu_cores}: {e.strerror} (cores this process may use: "
                             f"{sorted(os.sched_getaffinity(0))})") from None
    from tokenmill.server.lora_api import parse_modules
    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    adapters = parse_modules(args.lora_modules or [])

    def build() -> LLMEngine:
        engine = LLMEngine(config)
        for lora in adapters:  # read and checked before the server opens: a bad adapter stops the start
            engine.add_lora(lora)
        return engine

    # built on its own thread, the one that steps it (AsyncEngine says why)
    client = AsyncEngine(build, max_queue_len=args.max_queue_len,
                         request_timeout=args.request_timeout, max_queue_time=args.max_queue_time)
    engine = client.engine
    names = args.served_model_names or [os.path.basename(engine.model_path)]
    metrics = Metrics(names[0])
    metrics.set_cache_config(engine.kv_capacity_tokens, engine.block_size, engine.kv_num_blocks, engine.kv_cache_dtype)
    if config.lora.enable_lora:
        metrics.set_max_loras(config.lora.max_loras)
    client.stat_logger = metrics.record
    app = build_app(client, ServerConfig.from_args(args, served_model_names=names, api_keys=keys), metrics, adapters)
    from tokenmill import kernels

    cpu = ""
    if engine.device.type == "cpu":
        bf16 = f"; products of {kernels.AMX['min_rows']}+ rows in bfloat16" if kernels.amx() else ""
        cpu = f", CPU kernels {kernels.isa()} ({engine.activation_bits}-bit activations{bf16})" \
            if kernels.isa() and engine.activation_bits else ", CPU kernels PyTorch"
    print(f"tokenmill serving {names[0]} ({engine.model_path}) at http://{args.host}:{args.port}/v1 — "
          f"KV cache {engine.kv_capacity_tokens} tokens ({engine.kv_cache_dtype}), max_model_len {engine.max_model_len}{cpu}"
          f"{f', LoRA adapters {[a.lora_name for a in adapters]}' if adapters else ''}"
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
