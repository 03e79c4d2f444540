"""`tokenmill` command line: one subcommand per package that runs it (engine/cli.py: generate,
chat; server/cli.py: serve; router/cli.py: router and data-parallel serve; bench/cli.py: bench;
compress/cli.py: eval, compress). Engine flags are generated from the config dataclasses
(flags.py), so every option has one definition and one help text. Building the parser imports no
torch: the router's process never loads it."""
from __future__ import annotations

import argparse
import logging
import sys

from tokenmill.flags import api_keys, seconds


def cmd_serve(args: argparse.Namespace) -> int:
    from tokenmill.server import cli as server_cli

    door, keys = server_cli.check_args(args)
    if args.data_parallel_size > 1:
        from tokenmill.router.cli import serve_data_parallel
        return serve_data_parallel(args, keys)
    return server_cli.serve(args, door, keys)


def cmd_router(args: argparse.Namespace) -> int:
    from tokenmill.router.cli import cmd_router as run

    return run(args, api_keys(args))


def build_parser() -> argparse.ArgumentParser:
    from tokenmill.bench import cli as bench_cli
    from tokenmill.compress import cli as compress_cli
    from tokenmill.engine import cli as engine_cli
    from tokenmill.router.cli import add_router_args
    from tokenmill.server import cli as server_cli

    p = argparse.ArgumentParser(prog="tokenmill", description="Fast LLM inference with vLLM's API.")
    p.add_argument("--log-level", default="INFO")
    sub = p.add_subparsers(dest="cmd", required=True)
    engine_cli.add_parsers(sub)
    server_cli.add_parser(sub, cmd_serve)
    rt = sub.add_parser("router", help="load balancer over serve replicas (or any OpenAI-compatible servers)")
    add_router_args(rt, seconds)
    rt.set_defaults(func=cmd_router)
    compress_cli.add_eval_parser(sub)
    compress_cli.add_compress_parsers(sub)
    bench_cli.add_parsers(sub)
    return p


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
