"""The command lines of the router: `tokenmill router` over given replicas, and the data-parallel
form of `tokenmill serve` (replica processes on this host behind an in-process router)."""
from __future__ import annotations

import argparse
import os
import sys

from tokenmill.router.policy import POLICIES
from tokenmill.server.transport import add_arguments


def add_router_args(p: argparse.ArgumentParser, seconds) -> None:
    p.add_argument("--replica", action="append", required=True,
                   help="base URL of a replica, e.g. http://10.0.0.5:8000 (repeat for each; tokenmill serve or any "
                        "OpenAI-compatible server)")
    p.add_argument("--policy", default="cache_aware", choices=POLICIES,
                   help="cache_aware: to the replica that holds the prompt's prefix unless it is busier than the "
                        "least-loaded one by --balance-threshold; least_load; round_robin (default: cache_aware)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", dest="api_keys", action="append", default=None,
                   help="require 'Authorization: Bearer <key>' (repeatable; also TOKENMILL_API_KEY, comma-separated)")
    p.add_argument("--replica-api-key", default=os.environ.get("TOKENMILL_REPLICA_API_KEY"),
                   help="key the router sends to the replicas (also TOKENMILL_REPLICA_API_KEY; default: the "
                        "client's own Authorization header is passed through)")
    p.add_argument("--metrics-public", action="store_true", help="serve /metrics without the API key")
    p.add_argument("--health-interval", type=seconds, default=2.0, help="seconds between health probes (default: 2)")
    p.add_argument("--eject-after", type=int, default=2, help="failed probes in a row that eject a replica (default: 2)")
    p.add_argument("--readmit-after", type=int, default=2,
                   help="good probes in a row that re-admit an ejected replica (default: 2)")
    p.add_argument("--max-concurrency-per-replica", type=int, default=256,
                   help="requests in flight per replica; beyond, requests wait in the router's queue (default: 256)")
    p.add_argument("--max-queue-len", type=int, default=1024,
                   help="requests waiting for a replica beyond which new ones get 503 (default: 1024)")
    p.add_argument("--queue-timeout", type=seconds, default=30.0,
                   help="seconds a request may wait for a replica before a 503 (default: 30)")
    p.add_argument("--balance-threshold", type=int, default=4,
                   help="cache_aware: requests in flight by which the prefix's replica may exceed the least-loaded "
                        "one before load wins (default: 4)")
    p.add_argument("--upstream-timeout", type=seconds, default=1800.0,
                   help="seconds of silence from a replica before the request fails with 504 (default: 1800)")
    add_arguments(p, seconds)


def cmd_router(args: argparse.Namespace, keys: list[str]) -> int:
    from tokenmill.router.app import RouterConfig, build_router

    config = RouterConfig(replicas=args.replica, policy=args.policy, api_keys=keys,
                          replica_api_key=args.replica_api_key,
                          forward_client_auth=args.replica_api_key is None, metrics_public=args.metrics_public,
                          health_interval=args.health_interval, eject_after=args.eject_after,
                          readmit_after=args.readmit_after, max_in_flight=args.max_concurrency_per_replica,
                          max_queue_len=args.max_queue_len, queue_timeout=args.queue_timeout,
                          balance_threshold=args.balance_threshold, upstream_timeout=args.upstream_timeout,
                          max_request_bytes=args.max_request_bytes, client_timeout=args.client_timeout)
    print(f"tokenmill router ({args.policy}) at http://{args.host}:{args.port}/v1 over {len(args.replica)} "
          f"replica(s){', API key required' if keys else ''}", file=sys.stderr, flush=True)
    _run(build_router(config), args)
    return 0


def _run(app, args: argparse.Namespace) -> None:
    import uvicorn

    from tokenmill.server.transport import front_door

    uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, **front_door(args))).run()


# serve flags the parent keeps (the replicas get their own values) or hands over another way
_PARENT_ONLY = {"host", "port", "data_parallel_size", "router_policy", "threads", "cpu_cores", "kv_cache_memory",
                "api_keys", "log_level", "func", "parser"}


def serve_data_parallel(args: argparse.Namespace, keys: list[str]) -> int:
    """N replicas of `tokenmill serve` on loopback, each on its share of the cores and of the KV
    budget, behind a router on --host:--port; SIGTERM drains the router, then the replicas."""
    from tokenmill.config import CPU_KV_CACHE_BYTES, parse_bytes
    from tokenmill.router.app import RouterConfig, build_router
    from tokenmill.cpus import parse_cores
    from tokenmill.router.launcher import Launcher

    n = args.data_parallel_size
    cores = parse_cores(args.cpu_cores) if args.cpu_cores else sorted(os.sched_getaffinity(0))
    total_kv = parse_bytes(args.kv_cache_memory) if args.kv_cache_memory is not None else CPU_KV_CACHE_BYTES
    argv = replica_argv(args.parser, args) + ["--kv-cache-memory", str(total_kv // n)]
    launcher = Launcher(argv, cores, n, args.threads, ",".join(keys), args.log_level.upper(),
                        args.graceful_shutdown_timeout)
    # the client's key passes through to the replicas (which hold the same keys), so
    # --cache-salt-from-api-key keeps each key's prefix-cache namespace
    config = RouterConfig(replicas=[rp.url for rp in launcher.replicas], policy=args.router_policy, api_keys=keys,
                          replica_api_key=keys[0] if keys else None, forward_client_auth=True,
                          metrics_public=args.metrics_public, health_interval=1.0, readmit_after=1,
                          max_queue_len=args.max_queue_len, max_request_bytes=args.max_request_bytes,
                          client_timeout=args.client_timeout)
    app = build_router(config, background=(launcher.supervise,))
    print(f"tokenmill serving {n} replicas ({', '.join(f'cores {rp.cores}' for rp in launcher.replicas)}; "
          f"KV {total_kv // n >> 20} MiB each) behind a {args.router_policy} router at "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    launcher.start()
    try:
        _run(app, args)
    finally:
        launcher.stop(args.graceful_shutdown_timeout)
    return 0


def replica_argv(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The serve flags as given, minus the parent's own, written back as arguments."""
    out: list[str] = []
    for action in parser._actions:
        dest, value = action.dest, getattr(args, action.dest, None)
        if dest in _PARENT_ONLY or not action.option_strings or value is None or value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(action, argparse._StoreTrueAction):
            out.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for v in value:
                out += [flag, str(v)]
        else:
            out += [flag, str(value)]
    return out
