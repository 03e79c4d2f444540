"""Chat prompts for the speculative-decoding benchmark (benchmarks/spec.sh), one JSON list of
messages per line, the same for every server measured:

- `code`: input-grounded. A function from CPython's standard library with the instruction to
  rename one of its identifiers and return the whole function: most of the answer is a copy
  of the prompt, which is what prompt lookup (and llama.cpp's n-gram drafts) feed on.
- `mtbench`: MT-Bench second turns. The first turn's answer is the model's own greedy answer
  (generated here with tokenmill, speculation off), so every server continues the same
  conversation; second turns often revise the first answer ("rewrite your previous response").

    python benchmarks/spec_prompts.py --model M --set code --n 8 --out code.jsonl
    python benchmarks/spec_prompts.py --model M --set mtbench --n 10 --questions Q.jsonl --out mt.jsonl
"""
from __future__ import annotations

import argparse
import ast
import collections
import inspect
import json

# Functions of 14-50 lines of plain Python, from modules present in every CPython.
FUNCTIONS = ["textwrap.dedent", "difflib.get_close_matches", "base64.b64decode", "html.escape",
             "statistics.quantiles", "gettext.c2py", "ipaddress.ip_address", "statistics.mode",
             "statistics.median", "urllib.parse.quote_from_bytes", "colorsys.rgb_to_hsv", "textwrap.indent"]


def _source(dotted: str) -> str:
    import importlib

    mod_name, *attrs = dotted.split(".")
    obj = importlib.import_module(mod_name)
    for i, a in enumerate(attrs):
        try:
            obj = getattr(obj, a)
        except AttributeError:  # a submodule
            obj = importlib.import_module(".".join([mod_name, *attrs[:i + 1]]))
    return inspect.getsource(obj)


def _identifier(src: str) -> str:
    """The function's most used local name (argument or variable), the one to rename."""
    tree = ast.parse(src)
    names = collections.Counter(n.id for n in ast.walk(tree) if isinstance(n, ast.Name))
    args = {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments) for a in n.args + n.kwonlyargs}
    for name, _ in names.most_common():
        if name in args or (len(name) > 2 and not name[0].isupper() and name not in dir(__builtins__)):
            return name
    return names.most_common(1)[0][0]


def code_prompts(n: int) -> list[list[dict]]:
    out = []
    for dotted in FUNCTIONS[:n]:
        src = inspect.cleandoc("\n" + _source(dotted))
        old = _identifier(src)
        new = f"new_{old}"
        out.append([{"role": "user", "content": f"Rename the variable `{old}` to `{new}` in this Python function. "
                     f"Reply with the complete updated function in one code block and nothing else.\n\n"
                     f"```python\n{src}\n```"}])
    return out


def mtbench_prompts(model: str, questions: str, n: int, max_tokens: int) -> list[list[dict]]:
    from tokenmill import LLM, SamplingParams

    qs = [json.loads(line) for line in open(questions, encoding="utf-8")][:n]
    llm = LLM(model)
    firsts = llm.chat([[{"role": "user", "content": q["turns"][0]}] for q in qs],
                      SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [[{"role": "user", "content": q["turns"][0]},
             {"role": "assistant", "content": f.outputs[0].text},
             {"role": "user", "content": q["turns"][1]}] for q, f in zip(qs, firsts)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", choices=["code", "mtbench"], required=True)
    ap.add_argument("--model", default=None, help="mtbench: the model whose first answers are used")
    ap.add_argument("--questions", default="../shared/data/mt_bench/question.jsonl")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--first-turn-tokens", type=int, default=256)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    convs = code_prompts(args.n) if args.set == "code" else \
        mtbench_prompts(args.model, args.questions, args.n, args.first_turn_tokens)
    with open(args.out, "w", encoding="utf-8") as f:
        for c in convs:
            f.write(json.dumps(c) + "\n")


if __name__ == "__main__":
    main()
