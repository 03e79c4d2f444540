"""The output processor: from the tokens the scheduler accepted to the RequestOutputs callers see.

It owns, per request: the prompt as the caller gave it, the `n` sibling sequences gathered back
under the parent id, their incremental detokenizers (text deltas, stop strings) and the
CompletionOutputs built so far. A stop string found in a step's tokens ends the sequence through
`Scheduler.stop_at`, which owns the sequence's tokens; this module never edits them. (vLLM v1's
OutputProcessor, in one process.)
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.detokenizer import DetokState
from tokenmill.models.tokenizer import Tokenizer
from tokenmill.outputs import CompletionOutput, Logprob, PoolingOutput, PoolingRequestOutput, RequestOutput


@dataclass
class _Parent:
    req_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detoks: list[DetokState | None]
    outputs: list[CompletionOutput]  # text, logprobs and finish so far; token ids stay the scheduler's
    sent: list[int]                  # output tokens each sequence has reported
    error: str | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, scheduler: Scheduler) -> None:
        self.tokenizer, self.scheduler = tokenizer, scheduler
        self._parents: dict[str, _Parent] = {}
        self._child_parent: dict[str, tuple[_Parent, int]] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._parents

    def __len__(self) -> int:
        """Requests with a sequence not yet finished."""
        return len(self._parents)

    def add(self, req_id: str, prompt: str | None, ids: list[int], children: list[Request]) -> None:
        """A request's sequences, already handed to the scheduler; `ids`: its prompt as tokenized,
        which the outputs show (the sequences grow copies of their own)."""
        parent = _Parent(req_id, prompt, ids, children, [], [], [0] * len(children))
        for i, req in enumerate(children):
            detok = self.tokenizer is not None and req.pooling is None  # a pooling request makes no text
            parent.detoks.append(DetokState(self.tokenizer, ids, req.params) if detok else None)
            parent.outputs.append(CompletionOutput(index=i, text="", token_ids=[]))
            self._child_parent[req.req_id] = (parent, i)
        self._parents[req_id] = parent

    def was_scheduled(self, req_id: str) -> bool:
        """Whether any sequence of the request has been scheduled (unknown ids count as scheduled)."""
        parent = self._parents.get(req_id)
        return parent is None or any(c.metrics.first_scheduled_time is not None for c in parent.children)

    def abort(self, req_id: str) -> tuple[RequestOutput | None, list[Request]]:
        """Ends every unfinished sequence of the request: its final output (finish_reason 'abort'
        on those) and the sequences it stopped; (None, []) if the id is unknown or done."""
        parent = self._parents.get(req_id)
        if parent is None:
            return None, []
        stopped = []
        for i, req in enumerate(parent.children):
            if not req.is_finished:
                self.scheduler.finish_request(req.req_id, "abort")
                self._finish_child(parent, i)
                stopped.append(req)
        return self._request_output(parent, set(range(len(parent.children)))), stopped

    def process(self, advanced: list[tuple[Request, int]]) -> tuple[list[RequestOutput], list[Request]]:
        """Text deltas and stop strings for the tokens each sequence gained; a stop string inside a
        step's tokens ends the sequence there (the tokens after it are dropped). Returns the outputs
        and the sequences that finished."""
        touched: dict[str, tuple[_Parent, set[int]]] = {}
        finished: list[Request] = []
        for req, num_new in advanced:
            if req.req_id not in self._child_parent:  # a sibling failed earlier in this loop
                continue
            parent, i = self._child_parent[req.req_id]
            if req.error is not None:  # one sequence failed: the request fails, its siblings stop
                parent.error = req.error
                for j, sib in enumerate(parent.children):
                    if not sib.is_finished:
                        self.scheduler.finish_request(sib.req_id, "abort")
                    if sib.req_id in self._child_parent:
                        self._finish_child(parent, j)
                touched[parent.req_id] = (parent, set(range(len(parent.children))))
                continue
            detok = parent.detoks[i]
            if detok is not None:
                for pos in range(req.num_tokens - num_new, req.num_tokens):
                    stop = detok.add_tokens([req.token_ids[pos]])
                    if stop is not None:
                        self.scheduler.stop_at(req, pos + 1, stop)
                        break
            if req.is_finished:
                self._finish_child(parent, i)
                finished.append(req)
            touched.setdefault(parent.req_id, (parent, set()))[1].add(i)
        return [self._request_output(p, idx) for p, idx in touched.values()], finished

    def _finish_child(self, parent: _Parent, i: int) -> None:
        req = parent.children[i]
        req.metrics.finished_time = time.monotonic()
        self._child_parent.pop(req.req_id, None)
        if all(c.is_finished for c in parent.children):
            self._parents.pop(parent.req_id, None)

    def _request_output(self, parent: _Parent, changed: set[int]) -> RequestOutput | PoolingRequestOutput:
        """The caller's snapshot: each sequence's output ids sliced once from the scheduler's list
        (this module keeps no copy of them between steps); a pooling request's vector."""
        first = parent.children[0]
        if first.pooling is not None:
            return PoolingRequestOutput(parent.req_id, parent.prompt, parent.prompt_token_ids,
                                        PoolingOutput(first.pooled or []), first.is_finished, first.metrics,
                                        parent.error)
        ids = [req.output_token_ids for req in parent.children]
        for i in changed:
            req, out, detok = parent.children[i], parent.outputs[i], parent.detoks[i]
            out.delta_token_ids = ids[i][parent.sent[i]:]
            parent.sent[i] = len(ids[i])
            out.finish_reason, out.stop_reason = req.finish_reason, req.stop_reason
            if detok is not None:
                out.delta_text = detok.take_delta(req.is_finished)
                out.text = detok.text[:detok.num_emitted]
            if req.params.logprobs is not None:
                done = out.logprobs or []
                out.logprobs = done + [self.logprobs_for(tid, entry) for tid, entry in
                                       zip(ids[i][len(done):], req.logprobs[len(done):])]
                out.cumulative_logprob = sum(e[0] for e in req.logprobs)
        for i in set(range(len(parent.outputs))) - changed:
            parent.outputs[i].delta_text, parent.outputs[i].delta_token_ids = "", []
        finished = all(c.is_finished for c in parent.children)
        metrics = parent.children[0].metrics
        return RequestOutput(parent.req_id, parent.prompt, parent.prompt_token_ids,
                             [_snapshot(o, t) for o, t in zip(parent.outputs, ids)], finished, metrics, parent.error)

    def logprobs_for(self, token_id: int, entry: tuple[float, int, list[tuple[int, float]]]) -> dict[int, Logprob]:
        """One position's logprobs: the sampled token first, then the top-k alternatives."""
        chosen, rank, top = entry
        dec = (lambda t: self.tokenizer.decode([t], skip_special_tokens=False)) if self.tokenizer else (lambda t: None)
        d = {token_id: Logprob(chosen, rank, dec(token_id))}
        for r, (tid, lp) in enumerate(top, start=1):
            d.setdefault(tid, Logprob(lp, r, dec(tid)))
        return d


def _snapshot(o: CompletionOutput, token_ids: list[int]) -> CompletionOutput:
    """`token_ids` and the delta are fresh slices, never changed after; the logprobs list grows, so
    the caller gets a copy of it."""
    return CompletionOutput(o.index, o.text, token_ids, o.cumulative_logprob,
                            list(o.logprobs) if o.logprobs is not None else None, o.finish_reason, o.stop_reason,
                            o.delta_text, o.delta_token_ids)
