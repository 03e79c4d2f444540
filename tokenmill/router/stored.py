"""Which replica holds which stored response. The Responses API keeps a response (`store: true`)
in the memory of the replica that made it, so a request that continues one (`previous_response_id`)
or reads or deletes one (GET / DELETE /v1/responses/{id}) must go to that replica: the router reads
the id from the first bytes of each response it relays (a JSON body's or the first event's) and
pins such requests to its replica while that one is healthy. Bounded: the oldest ids are
forgotten first, and a forgotten one is routed as any request (its replica answers, or another
answers 404). Pure Python: no I/O."""
from __future__ import annotations

import json
import re
from collections import OrderedDict

_ID = re.compile(rb'"id": ?"(resp_[A-Za-z0-9_-]{1,200})"')
PATH = "/v1/responses"


class StoredResponses:
    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._owner: OrderedDict[str, int] = OrderedDict()

    def pin(self, method: str, path: str, body: bytes) -> int | None:
        """The replica a request must reach, or None (any)."""
        rid = None
        if method in ("GET", "DELETE") and path.startswith(PATH + "/"):
            rid = path[len(PATH) + 1:].split("/", 1)[0]
        elif method == "POST" and path == PATH and b"previous_response_id" in body:
            try:
                obj = json.loads(body)
            except ValueError:
                return None
            rid = obj.get("previous_response_id") if isinstance(obj, dict) else None
        return self._owner.get(rid) if isinstance(rid, str) else None

    def record(self, method: str, path: str, status: int, first: bytes, index: int) -> None:
        """A relayed answer's first bytes: a new response's id, made by replica `index`."""
        if method != "POST" or path != PATH or status != 200:
            return
        m = _ID.search(first)
        if m is None:
            return
        self._owner[m.group(1).decode()] = index
        self._owner.move_to_end(m.group(1).decode())
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
