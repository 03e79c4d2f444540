"""Chat templates rendered the way Hugging Face's `apply_chat_template` renders them, inside
jinja2's immutable sandbox: a model file is untrusted input, its template must not reach Python."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own filter escapes HTML; templates expect plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the model's chat template does not parse: {e}") from None


RESERVED = ("messages", "add_generation_prompt", "tools", "documents")  # set by render itself


def render(source: str, messages: list[dict], add_generation_prompt: bool, special: dict[str, str],
           tools: list | None = None, extra: dict | None = None) -> str:
    """`extra`: the caller's own template variables (chat_template_kwargs); one that would
    replace a variable render sets itself (the conversation, the special tokens) is refused."""
    kwargs = dict(extra or {})
    clash = sorted(k for k in kwargs if k in RESERVED or k in special)
    if clash:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)}: the server sets "
                         f"{'it' if len(clash) == 1 else 'them'} from the request and the model.")
    try:
        return compile_template(source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                               tools=tools, documents=None, **special, **kwargs)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template rejected the conversation: {e}") from None
    except Exception as e:  # noqa: BLE001 - the template is the model file's code: its failures are its own
        raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from None
