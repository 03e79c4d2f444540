"""Stored responses of the Responses API (`store: true`, its default): what `previous_response_id`
continues and GET / DELETE /v1/responses/{id} read. In this process's memory, bounded by the
stored bytes (a response with its whole conversation, which grows along a chain of responses):
past the bound the least recently used go first, and a response that was dropped is answered as
one that never existed. Pure Python; the event loop is its only user."""
from __future__ import annotations

import json
from collections import OrderedDict

DEFAULT_BYTES = 64 << 20


class ResponseStore:
    def __init__(self, max_bytes: int = DEFAULT_BYTES) -> None:
        self.max_bytes = max_bytes
        self.used = 0
        self._entries: OrderedDict[str, tuple[dict, list[dict], int]] = OrderedDict()

    def put(self, rid: str, response: dict, conversation: list[dict]) -> None:
        """Keep `response` and the conversation a later request continues (without instructions)."""
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(conversation, ensure_ascii=False))
        if size > self.max_bytes:
            return  # larger than the whole store: kept nowhere, as if evicted at once
        self.delete(rid)
        self._entries[rid] = (response, conversation, size)
        self.used += size
        while self.used > self.max_bytes:
            _, (_, _, dropped) = self._entries.popitem(last=False)
            self.used -= dropped

    def get(self, rid: str) -> tuple[dict, list[dict]] | None:
        entry = self._entries.get(rid)
        if entry is None:
            return None
        self._entries.move_to_end(rid)
        return entry[0], entry[1]

    def delete(self, rid: str) -> bool:
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self.used -= entry[2]
        return entry is not None

    def __len__(self) -> int:
        return len(self._entries)
