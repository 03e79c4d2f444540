"""The replicas behind the router: their health (probes, ejection, re-admission), their load (the
router's own count of requests in flight on each) and admission (a slot on a replica, or a bounded
wait for one, or a 503 reason). Owns no HTTP routes; policy.py decides among the eligible ones.

Load is the router's own accounting, not the replicas' /metrics: it is exact for the traffic that
goes through this router, moves the instant a request is sent, and costs no scrape. Traffic that
reaches a replica around the router is invisible to it (put every client behind the router).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

import aiohttp

from tokenmill.router.policy import Choice, Policy

log = logging.getLogger("tokenmill.router")


async def fetch(session: aiohttp.ClientSession, url: str, headers: dict | None = None,
                timeout: float = 5.0) -> tuple[int, bytes, str] | None:
    """A small GET, whole: (status, body, content type), or None if the replica did not answer."""
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return r.status, await r.read(), r.headers.get("content-type", "")
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


MODELS_REFRESH_S = 5.0  # how often a healthy replica's model list (its LoRA adapters) is read again


@dataclass
class Replica:
    index: int
    url: str
    healthy: bool = False          # admitted; set by the first successful probe
    in_flight: int = 0
    failures: int = 0              # consecutive failed probes
    successes: int = 0             # consecutive good probes while ejected
    models: set[str] = field(default_factory=set)   # from /v1/models; empty: unknown, takes any model
    models_at: float = 0.0         # when `models` was read
    ejected_at: float | None = None


class Rejected(Exception):
    """No slot for the request: `reason` is no_replica | queue_full | queue_timeout (all 503)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class Pool:
    def __init__(self, urls: list[str], policy: Policy, session: aiohttp.ClientSession, *, replica_headers: dict,
                 health_interval: float = 2.0, eject_after: int = 2, readmit_after: int = 2,
                 max_in_flight: int = 256, max_queue_len: int = 1024, queue_timeout: float = 30.0,
                 on_change=None) -> None:
        self.replicas = [Replica(i, u.rstrip("/")) for i, u in enumerate(urls)]
        self.policy, self.session, self.replica_headers = policy, session, replica_headers
        self.health_interval, self.eject_after, self.readmit_after = health_interval, eject_after, readmit_after
        self.max_in_flight, self.max_queue_len, self.queue_timeout = max_in_flight, max_queue_len, queue_timeout
        self.on_change = on_change or (lambda replica: None)   # metrics hook: a replica's state moved
        self.num_waiting = 0
        self._slots = asyncio.Condition()

    # ------------------------------------------------------------ health
    async def run_health_checks(self) -> None:
        """Forever: probe every replica each `health_interval` seconds."""
        while True:
            await asyncio.gather(*(self.probe(r) for r in self.replicas))
            await asyncio.sleep(self.health_interval)

    async def probe(self, r: Replica) -> None:
        answer = await fetch(self.session, r.url + "/health", timeout=max(1.0, self.health_interval))
        if answer is not None and answer[0] == 200:
            r.failures = 0
            if r.healthy and time.monotonic() - r.models_at > MODELS_REFRESH_S:
                await self._refresh_models(r)  # LoRA adapters come and go at run time
            if not r.healthy:
                r.successes += 1
                if r.successes >= self.readmit_after or r.ejected_at is None:  # first admission: at once
                    await self._refresh_models(r)
                    self._set(r, True, "healthy again" if r.ejected_at is not None else "up")
        else:
            r.successes = 0
            r.failures += 1
            if r.healthy and r.failures >= self.eject_after:
                self._set(r, False, f"{r.failures} failed health checks")

    async def _refresh_models(self, r: Replica) -> None:
        r.models_at = time.monotonic()
        answer = await fetch(self.session, r.url + "/v1/models", self.replica_headers)
        try:
            r.models = {m["id"] for m in json.loads(answer[1])["data"]} if answer and answer[0] == 200 else set()
        except (ValueError, KeyError, TypeError):
            r.models = set()

    def eject(self, r: Replica, why: str) -> None:
        """A request could not reach the replica: out now, back after `readmit_after` good probes."""
        if r.healthy:
            r.failures = self.eject_after
            self._set(r, False, why)

    def _set(self, r: Replica, healthy: bool, why: str) -> None:
        r.healthy, r.successes = healthy, 0
        if healthy:
            log.info("replica %s admitted (%s)", r.url, why)
        else:
            r.ejected_at = time.monotonic()
            log.warning("replica %s ejected: %s", r.url, why)
        self.policy.forget(r.index)   # a replica that failed or came back may hold nothing
        self.on_change(r)
        asyncio.ensure_future(self._notify())

    async def _notify(self) -> None:
        async with self._slots:
            self._slots.notify_all()

    # ------------------------------------------------------------ admission
    def _eligible(self, model: str | None, exclude: set[int], pin: int | None = None) -> tuple[list[Replica], bool]:
        """Replicas that may take the request now, and whether any could later (not all down).
        `pin`: the one replica that holds what the request refers to (router/stored.py), while it is up."""
        up = [r for r in self.replicas if r.healthy and r.index not in exclude]
        serving = [r for r in up if not r.models or model is None or model in r.models]
        up = serving or up  # a model nobody serves: any replica answers the 404 in its own words
        up = [r for r in up if r.index == pin] or up
        return [r for r in up if r.in_flight < self.max_in_flight], bool(up)

    async def acquire(self, keys: list[int], model: str | None, exclude: set[int],
                      pin: int | None = None) -> tuple[Replica, Choice]:
        deadline = time.monotonic() + self.queue_timeout
        async with self._slots:
            queued = False
            try:
                while True:
                    free, any_up = self._eligible(model, exclude, pin)
                    if free:
                        choice = self.policy.choose(keys, {r.index: r.in_flight for r in free})
                        r = self.replicas[choice.index]
                        r.in_flight += 1
                        self.policy.routed(r.index, keys)
                        self.on_change(r)
                        return r, choice
                    if not any_up:
                        raise Rejected("no_replica", "no healthy replica can take the request; retry later")
                    if not queued:
                        if self.num_waiting >= self.max_queue_len:
                            raise Rejected("queue_full", f"every replica is at its limit of {self.max_in_flight} "
                                                         f"requests and {self.num_waiting} more are queued; retry later")
                        queued = True
                        self.num_waiting += 1
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise Rejected("queue_timeout", f"no replica had room within {self.queue_timeout:g} s; "
                                                        "retry later")
                    try:
                        await asyncio.wait_for(self._slots.wait(), left)
                    except asyncio.TimeoutError:
                        pass
            finally:
                if queued:
                    self.num_waiting -= 1

    async def release(self, r: Replica) -> None:
        r.in_flight -= 1
        self.on_change(r)
        async with self._slots:
            self._slots.notify_all()  # waiters may want different models: each re-checks
