"""Incremental detokenization and stop strings.

Text deltas never split a UTF-8 character: a byte-level token that ends mid-character decodes to
U+FFFD, and the delta waits until the next token completes it. Stop strings are searched across
step boundaries; while a request may still be in the middle of one, the last `max_stop_len - 1`
characters are held back so a stop string never reaches a stream.
"""
from __future__ import annotations

from tokenmill.models.tokenizer import Tokenizer
from tokenmill.sampling_params import SamplingParams

_CONTEXT_TOKENS = 5  # prompt tokens decoded along, so the first output token keeps its leading space


class DetokState:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.num_emitted = 0  # characters of text already handed out
        self.max_stop_len = max((len(s) for s in params.stop_strings), default=0)

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append new tokens; returns the stop string that ended the request, if one did."""
        skip = self.params.skip_special_tokens
        for tok in token_ids:
            self.ids.append(tok)
            prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], skip)
            full = self.tokenizer.decode(self.ids[self.prefix_offset:], skip)
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                start = len(self.text)
                self.text += full[len(prefix):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                hit = self._find_stop(start)
                if hit is not None:
                    return hit
        return None

    def _find_stop(self, new_start: int) -> str | None:
        if not self.max_stop_len:
            return None
        search_from = max(0, new_start - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.params.stop_strings:
            i = self.text.find(stop, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return None
        i, stop = best
        self.text = self.text[:i + len(stop)] if self.params.include_stop_str_in_output else self.text[:i]
        return stop

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out, minus a tail that might still grow into a stop string."""
        end = len(self.text)
        if not finished and self.max_stop_len:
            end = max(self.num_emitted, end - (self.max_stop_len - 1))
        delta = self.text[self.num_emitted:end]
        self.num_emitted = end
        return delta
