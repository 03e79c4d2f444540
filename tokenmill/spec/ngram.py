"""Prompt-lookup drafts: no model, only the request's own tokens. No torch here.

When the last n tokens of a sequence appeared before (in the prompt or the output so far), the
tokens that followed them then are a good guess for what follows now: code being edited, a
passage being quoted or summarised, a list being repeated. For each n in [n_min, n_max], longest
first, the proposer finds the latest earlier occurrence of the sequence's last n tokens and
proposes the (up to) k tokens after it.

Each request keeps one dict per n from n-gram to the end of its latest occurrence, extended with
the tokens added since the last call, so proposing costs a few dict operations per new token;
the prompt is indexed once, on the first call.
"""
from __future__ import annotations

from tokenmill.core.sched_output import DraftRequest


class _Index:
    __slots__ = ("tables", "upto")

    def __init__(self, sizes: range) -> None:
        self.tables = {n: {} for n in sizes}  # n -> {n-gram: end of its latest occurrence}
        self.upto = 0                          # n-grams ending at or before this are indexed


class NgramProposer:
    def __init__(self, n_min: int, n_max: int) -> None:
        assert 1 <= n_min <= n_max
        self.sizes = range(n_max, n_min - 1, -1)   # longest first
        self._indexes: dict[str, _Index] = {}

    def drop(self, req_id: str) -> None:
        self._indexes.pop(req_id, None)

    def preempted(self, req_id: str) -> None:
        """Nothing to give back: the index is the request's own tokens, which preemption keeps."""

    def draft_probs(self, req_id: str) -> None:
        """Prompt-lookup drafts are point masses (accepted when the target samples them)."""
        return None

    def propose(self, wanted: list[DraftRequest]) -> dict[str, list[int]]:
        """Drafts for the requests that found a match."""
        out = {}
        for w in wanted:
            drafts = self.propose_one(w.req_id, w.token_ids, w.num_drafts)
            if drafts:
                out[w.req_id] = drafts
        return out

    def propose_one(self, req_id: str, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens to follow `tokens`, or [] when no suffix n-gram occurred before."""
        index = self._indexes.get(req_id)
        if index is None:
            index = self._indexes[req_id] = _Index(self.sizes)
        end = len(tokens)
        # index every n-gram that ends before the last position (the suffix itself must not match itself)
        for e in range(index.upto + 1, end):
            for n, table in index.tables.items():
                if e >= n:
                    table[tuple(tokens[e - n:e])] = e
        index.upto = max(index.upto, end - 1)
        for n in self.sizes:
            if end <= n:
                continue
            e = index.tables[n].get(tuple(tokens[end - n:]))
            if e is not None:
                return tokens[e:e + k]
        return []
