"""`tokenmill generate` and `tokenmill chat`: the engine in this process, from the command line."""
from __future__ import annotations

import argparse
import sys

from tokenmill.flags import add_engine_args, engine_kwargs


def add_parsers(sub) -> None:
    g = sub.add_parser("generate", help="complete one or more prompts and print the results")
    g.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    g.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user chat message")
    _sampling_args(g)
    add_engine_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat that streams its answers")
    c.add_argument("--system", default=None, help="system prompt")
    _sampling_args(c)
    add_engine_args(c)
    c.set_defaults(func=cmd_chat)


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
    from tokenmill.engine.llm import LLM

    params = _params(args)
    llm = LLM(**engine_kwargs(args))
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
    from tokenmill.engine.llm import LLM

    params = _params(args)
    llm = LLM(**engine_kwargs(args))
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
