"""Reasoning output: models that think before they answer write `<think>…</think>` first; with
`--reasoning-parser` the thinking comes back as `reasoning_content` (streamed as
`delta.reasoning_content`) and only the answer as `content`, vLLM's names and shapes. Pure Python.

- `deepseek_r1`: the chat template opens `<think>` in the prompt, so the output starts inside the
  thinking: everything before `</think>` is reasoning (all of it if the output stops first).
- `qwen3`: the output opens `<think>` itself when it thinks (`enable_thinking` false: it does not);
  text before `</think>` is reasoning only if the output began with `<think>`.
"""
from __future__ import annotations

from tokenmill.server.tools import partial_suffix

PARSERS = ("deepseek_r1", "qwen3")
OPEN, CLOSE = "<think>", "</think>"


def split(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a complete output."""
    body = text.lstrip()
    opened = body.startswith(OPEN)
    if opened:
        body = body[len(OPEN):]
    if parser == "qwen3" and not opened:
        return None, text
    reasoning, closed, content = body.partition(CLOSE)
    if not closed:
        return (reasoning or None), None
    return (reasoning or None), (content.lstrip("\n") or None)


class StreamingReasoning:
    """Deltas -> (reasoning delta, content delta). Text that may be the start of a tag is held
    back until it is known not to be."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.state = "start"  # start -> thinking -> answering (qwen3 without <think>: start -> answering)
        self.buf = ""
        self.after_close = False  # newlines right after </think> belong to neither part

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.buf += delta
        reasoning = content = ""
        if self.state == "start":
            stripped = self.buf.lstrip()
            if stripped.startswith(OPEN):
                self.buf, self.state = stripped[len(OPEN):], "thinking"
            elif OPEN.startswith(stripped) and not final:
                return "", ""  # maybe the opening tag, not complete yet
            else:
                self.state = "thinking" if self.parser == "deepseek_r1" else "answering"
        if self.state == "thinking":
            at = self.buf.find(CLOSE)
            if at >= 0:
                reasoning, self.buf, self.state = self.buf[:at], self.buf[at + len(CLOSE):], "answering"
                self.after_close = True
            else:
                keep = 0 if final else partial_suffix(self.buf, CLOSE)
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return reasoning, ""
        if self.state == "answering":
            if self.after_close:
                self.buf = self.buf.lstrip("\n")
                self.after_close = not self.buf
            content, self.buf = self.buf, ""
        return reasoning, content

