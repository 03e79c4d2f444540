"""Which replica serves a request: round_robin, least_load or cache_aware. Pure Python on plain
data (replica indices, in-flight counts, the prompt's text); no I/O, no clock.

cache_aware keeps, per replica, an approximate picture of that replica's prefix cache: the chain
hashes of the fixed-size character chunks of the prompts recently routed to it (the key of chunk i
hashes chunk i and the key of chunk i-1, as the engine's KV block keys do), in an LRU bounded to
about what the replica's KV cache holds. A request's match on a replica is the number of its leading
chunk keys that replica has seen. SGLang's router keeps an approximate radix tree of characters per
worker for the same question; chunk chains answer it at a 64-character granularity with one dict
lookup per chunk and no tree to rebalance, and like the tree they are only a guess: the router never
sees the replicas' evictions, so the LRU bound stands in for them.

The decision: the replica with the longest match wins unless it is busier than the least-loaded
eligible replica by more than `balance_threshold` in-flight requests (a hot prefix must not pile onto
one replica; then the least-loaded one wins). A prompt nobody holds goes to the next replica in
round-robin order that is within the threshold of the least loaded: placing those by least load
instead sends each new request to the replica that has just finished one, so arrivals that follow
completions (every closed-loop client, every chat turn) bunch onto one replica and queue behind each
other's prefills (measured in benchmarks/RESULTS.md §1).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

POLICIES = ("cache_aware", "least_load", "round_robin")


@dataclass(frozen=True)
class Choice:
    index: int            # the replica
    reason: str           # prefix | load | balance (a match overruled by load) | round_robin
    matched_chars: int    # prompt characters the chosen replica is believed to hold


def chunk_keys(text: str, chunk_chars: int) -> list[int]:
    """Chain keys of the text's full chunks: key i depends on every character before its end."""
    keys, key = [], 0
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        key = hash((key, text[start:start + chunk_chars]))
        keys.append(key)
    return keys


class PrefixIndex:
    """One replica's picture: chunk keys in least-recently-used order, at most `capacity` of them."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys: OrderedDict[int, None] = OrderedDict()

    def match(self, keys: list[int]) -> int:
        n = 0
        for k in keys:
            if k not in self.keys:
                break
            n += 1
        return n

    def insert(self, keys: list[int]) -> None:
        for k in keys:
            self.keys[k] = None
            self.keys.move_to_end(k)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)

    def clear(self) -> None:
        self.keys.clear()


class Policy:
    """choose() among eligible replicas (index -> in-flight requests), then routed() once the
    request is on its way; forget() when a replica's cache is lost (ejected or restarted)."""

    def __init__(self, name: str, num_replicas: int, chunk_chars: int = 64, capacity_chars: int = 4 << 20,
                 balance_threshold: int = 4) -> None:
        if name not in POLICIES:
            raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}.")
        if chunk_chars < 1 or capacity_chars < chunk_chars:
            raise ValueError(f"the prefix chunk ({chunk_chars}) must be >= 1 character and at most the capacity "
                             f"({capacity_chars}).")
        if balance_threshold < 0:
            raise ValueError(f"the balance threshold must be >= 0 requests, got {balance_threshold}.")
        self.name, self.chunk_chars, self.balance_threshold = name, chunk_chars, balance_threshold
        self.indexes = [PrefixIndex(capacity_chars // chunk_chars) for _ in range(num_replicas)]
        self._next = 0

    def keys(self, text: str) -> list[int]:
        return chunk_keys(text, self.chunk_chars) if self.name == "cache_aware" else []

    def choose(self, keys: list[int], loads: dict[int, int]) -> Choice:
        assert loads, "choose() needs at least one eligible replica"
        order = sorted(loads, key=lambda i: (i - self._next) % len(self.indexes))  # round-robin rotation
        self._next = (order[0] + 1) % len(self.indexes)
        if self.name == "round_robin":
            return Choice(order[0], "round_robin", 0)
        least = min(order, key=lambda i: (loads[i], len(self.indexes[i].keys)))
        if self.name == "least_load":
            return Choice(least, "load", 0)
        matches = {i: self.indexes[i].match(keys) for i in order}
        best = max(order, key=lambda i: (matches[i], -loads[i]))
        if matches[best] == 0:  # nobody holds it: the next in rotation that is not overloaded
            spare = next(i for i in order if loads[i] - loads[least] <= self.balance_threshold)
            return Choice(spare, "spread", 0)
        if loads[best] - loads[least] > self.balance_threshold:
            return Choice(least, "balance", matches[least] * self.chunk_chars)
        return Choice(best, "prefix", matches[best] * self.chunk_chars)

    def routed(self, index: int, keys: list[int]) -> None:
        if keys:
            self.indexes[index].insert(keys)

    def forget(self, index: int) -> None:
        self.indexes[index].clear()
