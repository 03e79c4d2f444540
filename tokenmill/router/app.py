"""`tokenmill router`: an OpenAI-compatible front door over replicas (tokenmill or any OpenAI-
compatible server). It forwards bytes, never rewrites a body: the replicas validate and answer, so
errors keep their exact shape. What it adds: a choice of replica (policy.py), health and admission
(pool.py), a retry elsewhere for a request that failed before its first byte, and its own metrics.
It imports nothing of the engine (and so no torch).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policy import Policy
from tokenmill.router.pool import Pool, Rejected, Replica, fetch
from tokenmill.router.stored import StoredResponses
from tokenmill.server.guard import Guard, error_response

log = logging.getLogger("tokenmill.router")
# hop-by-hop and per-connection headers: each leg of the trip sets its own
_DROP_REQUEST = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
                 "proxy-authorization", "proxy-connection"}
_DROP_RESPONSE = {"connection", "keep-alive", "transfer-encoding", "server", "date"}
_PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class RouterConfig:
    replicas: list[str]
    policy: str = "cache_aware"
    api_keys: list[str] = field(default_factory=list)
    replica_api_key: str | None = None   # the key the router's own calls to replicas carry (probes, scrapes)
    forward_client_auth: bool = False    # requests carry the client's Authorization instead of replica_api_key
    health_interval: float = 2.0         # seconds between probes of each replica's /health
    eject_after: int = 2                 # consecutive failed probes that take a replica out
    readmit_after: int = 2               # consecutive good probes that bring it back
    max_in_flight: int = 256             # requests per replica at once; beyond, requests queue here
    max_queue_len: int = 1024            # queued requests beyond which the router answers 503
    queue_timeout: float = 30.0          # seconds a request may wait for a slot before a 503
    balance_threshold: int = 4           # cache_aware: in-flight excess that overrules a prefix match
    chunk_chars: int = 64                # cache_aware: granularity of the prefix picture
    capacity_chars: int = 4 << 20        # cache_aware: prompt characters remembered per replica
    connect_timeout: float = 5.0
    upstream_timeout: float = 1800.0     # seconds of silence from a replica before the request fails (504)
    metrics_public: bool = False
    max_request_bytes: int = 8 << 20
    client_timeout: float = 30.0

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ValueError("the router needs at least one --replica URL.")
        for url in self.replicas:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--replica takes a base URL like http://10.0.0.5:8000, got {url!r}.")
        if len({u.rstrip("/") for u in self.replicas}) != len(self.replicas):
            raise ValueError("each --replica URL must be given once.")
        for name in ("health_interval", "queue_timeout", "connect_timeout", "upstream_timeout", "client_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds.")
        for name in ("eject_after", "readmit_after", "max_in_flight", "max_queue_len", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}.")


def _text(content) -> str:
    """A message's text: a string, or the text of its parts or blocks."""
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


def routing_key(body: bytes) -> tuple[str, str | None]:
    """The text a request's prompt starts with (what the replica's prefix cache will hold) and its
    model. Chat (and Anthropic's messages, Responses' input items): tools, the system text, then each
    message's role and text, in order, as templates render them."""
    try:
        obj = json.loads(body) if body else None
    except ValueError:
        return "", None
    if not isinstance(obj, dict):
        return "", None
    model = obj.get("model") if isinstance(obj.get("model"), str) else None
    parts: list[str] = []
    turns = obj.get("messages", obj.get("input"))
    if isinstance(turns, (list, str)) and ("messages" in obj or "input" in obj):
        if obj.get("tools"):
            parts.append(json.dumps(obj["tools"], sort_keys=True))
        system = obj.get("system", obj.get("instructions"))  # Anthropic's system, Responses' instructions
        if system:
            parts.append(f"<system>{_text(system)}")
        for m in [{"role": "user", "content": turns}] if isinstance(turns, str) else turns:
            if not isinstance(m, dict):
                break
            parts.append(f"<{m.get('role')}>{_text(m.get('content'))}")
    else:
        prompt = obj.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a list of prompts: they share the replica
        if isinstance(prompt, str):
            parts.append(prompt)
        elif isinstance(prompt, list):
            parts.append(",".join(str(t) for t in prompt))
    return "\n".join(parts), model


def build_router(config: RouterConfig, background: tuple = ()) -> Guard:
    """The router app. `background`: coroutine functions run for the app's lifetime beside the
    health checks (serve --data-parallel-size supervises its replica processes this way)."""
    urls = [u.rstrip("/") for u in config.replicas]
    metrics = RouterMetrics(urls, config.policy)
    policy = Policy(config.policy, len(urls), config.chunk_chars, config.capacity_chars, config.balance_threshold)
    stored = StoredResponses()  # which replica holds which stored response (Responses API)
    replica_auth = {"authorization": f"Bearer {config.replica_api_key}"} if config.replica_api_key else {}
    state: dict = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        # aiohttp rather than httpx on this path: its C parser costs less per request (RESULTS.md
        # §3); no decompression (bytes pass as they come), no headers the client did not send
        session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=config.connect_timeout,
                                          sock_read=config.upstream_timeout),
            # idle connections expire before the replicas' keep-alive (5 s) so a reused one is not
            # being closed by the other side at the moment a request goes out on it
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2.0), auto_decompress=False,
            skip_auto_headers=("Accept-Encoding", "User-Agent"))
        pool = Pool(urls, policy, session, replica_headers=replica_auth, health_interval=config.health_interval,
                    eject_after=config.eject_after, readmit_after=config.readmit_after,
                    max_in_flight=config.max_in_flight, max_queue_len=config.max_queue_len,
                    queue_timeout=config.queue_timeout, on_change=metrics.replica_changed)
        state.update(session=session, pool=pool)
        await asyncio.gather(*(pool.probe(r) for r in pool.replicas))  # admit what is up before serving
        tasks = [asyncio.ensure_future(pool.run_health_checks())] + [asyncio.ensure_future(f()) for f in background]
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await session.close()

    app = FastAPI(title="tokenmill router", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, e: StarletteHTTPException):  # Anthropic's shape on its paths (guard)
        return error_response(e.status_code, str(e.detail), "invalid_request_error", path=request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        return _internal_error(e, request.url.path)

    def upstream_headers(raw: Request) -> dict:
        h = {k: v for k, v in raw.headers.items() if k not in _DROP_REQUEST}
        if not config.forward_client_auth:
            h.pop("authorization", None)
            h.update(replica_auth)
        return h

    @app.get("/health")
    async def health():
        if any(r.healthy for r in state["pool"].replicas):
            return Response(status_code=200)
        return error_response(503, "no healthy replica", "server_overloaded")

    @app.get("/v1/models")
    async def models(raw: Request):
        up = [r for r in state["pool"].replicas if r.healthy]
        if not up:
            return error_response(503, "no healthy replica", "server_overloaded")
        answers = await asyncio.gather(*(fetch(state["session"], r.url + "/v1/models", upstream_headers(raw), 10.0)
                                         for r in up))
        seen: dict[str, dict] = {}
        first_error = None
        for a in answers:
            if a is not None and a[0] == 200:
                for m in json.loads(a[1]).get("data", []):
                    seen.setdefault(m.get("id"), m)
            elif a is not None and first_error is None:
                first_error = a
        if not seen and first_error is not None:
            return Response(first_error[1], first_error[0], media_type=first_error[2])
        return JSONResponse({"object": "list", "data": list(seen.values())})

    @app.get("/metrics")
    async def prometheus():
        metrics.queued.set(state["pool"].num_waiting)
        return Response(metrics.render(), media_type=_PROMETHEUS)

    @app.get("/metrics/replicas")
    async def replica_metrics(raw: Request):
        up = [r for r in state["pool"].replicas if r.healthy]
        h = replica_auth or ({"authorization": raw.headers["authorization"]} if "authorization" in raw.headers else {})
        answers = await asyncio.gather(*(fetch(state["session"], r.url + "/metrics", h, 3.0) for r in up))
        texts = {r.url: a[1].decode(errors="replace") for r, a in zip(up, answers) if a is not None and a[0] == 200}
        return Response(metrics.render_replicas(texts), media_type=_PROMETHEUS)

    async def forward(raw: Request) -> Response:
        return await _Forward(raw, state["pool"], state["session"], policy, metrics, upstream_headers(raw), stored,
                              config.upstream_timeout).run()

    app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])(forward)  # DELETE: a stored response
    own = {r.path for r in app.routes} - {"/{path:path}"}

    async def dispatch(scope, receive, send) -> None:
        """POSTs to the replicas' routes (every completion) go straight to the forwarder, past
        FastAPI's routing and exception layers, which they do not need: this is the router's cost
        per request, paid on every one. Everything else is the FastAPI app's."""
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] not in own:
            try:
                response = await forward(Request(scope, receive))
            except Exception as e:
                response = _internal_error(e, scope["path"])
            return await response(scope, receive, send)
        return await app(scope, receive, send)

    open_paths = {"/health"} | ({"/metrics", "/metrics/replicas"} if config.metrics_public else set())
    guarded = Guard(dispatch, api_keys=set(config.api_keys), max_bytes=config.max_request_bytes,
                    body_timeout=config.client_timeout, open_paths=open_paths)
    guarded.routes = app.routes  # type: ignore[attr-defined]  # what it serves, for inspection and tests
    return guarded


def _internal_error(e: Exception, path: str) -> Response:  # the details go to the log, never to the client
    ref = uuid.uuid4().hex[:12]
    log.error("internal error %s", ref, exc_info=e)
    return error_response(500, f"internal error (reference {ref} in the router log)", "internal_error", path=path)


class _Forward:
    """One request through the router: a slot on a replica, the request sent, its first byte
    awaited (a failure until then is retried on another replica), then the response relayed."""

    def __init__(self, raw: Request, pool: Pool, session: aiohttp.ClientSession, policy: Policy,
                 metrics: RouterMetrics, headers: dict, stored: StoredResponses, read_timeout: float) -> None:
        self.raw, self.pool, self.session, self.policy, self.metrics, self.headers, self.stored = \
            raw, pool, session, policy, metrics, headers, stored
        self.read_timeout = read_timeout
        self.t0 = time.perf_counter()

    async def run(self) -> Response:
        raw = self.raw
        body = await raw.body()
        target = raw.url.path + (f"?{raw.url.query}" if raw.url.query else "")
        text, model = routing_key(body) if raw.method == "POST" else ("", None)
        keys = self.policy.keys(text)
        pin = self.stored.pin(raw.method, raw.url.path, body)
        gone = asyncio.ensure_future(_disconnected(raw.receive))
        tried: set[int] = set()
        last_refusal: tuple[bytes, dict] | None = None
        last_error = ""
        relayed = False
        try:
            while True:
                try:
                    replica, choice = await self.pool.acquire(keys, model, tried, pin)
                except Rejected as e:
                    if last_refusal is not None:  # every replica said 503: theirs is the answer
                        return Response(last_refusal[0], 503, headers=last_refusal[1])
                    reason = "upstream_failed" if tried else e.reason
                    self.metrics.rejected.labels(reason=reason).inc()
                    msg = f"every replica failed before answering ({last_error})" if tried else str(e)
                    return error_response(503, msg, "server_overloaded", path=self.raw.url.path)
                self.metrics.decisions.labels(policy=self.policy.name, reason=choice.reason).inc()
                if keys:
                    self.metrics.query_chars.inc(len(keys) * self.policy.chunk_chars)
                    self.metrics.matched_chars.inc(choice.matched_chars)
                opened = asyncio.ensure_future(self._open(replica, raw.method, target, body))
                await asyncio.wait({opened, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not opened.done():  # the client left first: closing the upstream aborts the replica's work
                    opened.cancel()
                    await asyncio.gather(opened, return_exceptions=True)
                    await self.pool.release(replica)
                    return Response(status_code=499)
                try:
                    upstream, first = opened.result()
                except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
                    self.pool.eject(replica, f"connection failed: {e!r}")
                    last_error = f"{replica.url}: connection failed"
                except (aiohttp.ServerTimeoutError, asyncio.TimeoutError):
                    await self.pool.release(replica)
                    self._count(replica, 504)
                    return error_response(504, f"the replica sent nothing for {self.read_timeout:g} s", "timeout_error",
                                          path=self.raw.url.path)
                except aiohttp.ClientError as e:
                    last_error = f"{replica.url}: {type(e).__name__}"  # it died mid-request: health checks judge it
                else:
                    if upstream.status != 503:
                        self.stored.record(raw.method, raw.url.path, upstream.status, first, replica.index)
                        relayed = True  # the relay watches `gone` from here on
                        return _Relay(upstream, first, gone, self._finisher(replica, upstream.status), replica.index)
                    try:
                        body503 = first + await upstream.read()
                    except (aiohttp.ClientError, asyncio.TimeoutError):
                        body503 = first
                    last_refusal = (body503, _response_headers(upstream))
                    upstream.close()
                    last_error = f"{replica.url}: 503"
                tried.add(replica.index)
                await self.pool.release(replica)
                self.metrics.retries.labels(reason="upstream_503" if last_error.endswith("503") else "failed").inc()
                self._count(replica, 503 if last_error.endswith("503") else 502)
        finally:
            if not relayed:
                gone.cancel()

    async def _open(self, replica: Replica, method: str, target: str, body: bytes):
        upstream = await self.session.request(method, replica.url + target, data=body or None, headers=self.headers)
        try:
            first = await upstream.content.readany()
        except BaseException:
            upstream.close()  # never back to the pool: the replica sees the connection end
            raise
        return upstream, first

    def _count(self, replica: Replica, status: int) -> None:
        self.metrics.requests.labels(replica=replica.url, status=str(status)).inc()

    def _finisher(self, replica: Replica, status: int):
        self.metrics.ttfb.labels(replica=replica.url).observe(time.perf_counter() - self.t0)

        async def finished() -> None:
            await self.pool.release(replica)
            self._count(replica, status)
            self.metrics.duration.labels(replica=replica.url).observe(time.perf_counter() - self.t0)
        return finished


def _response_headers(upstream: aiohttp.ClientResponse) -> dict:
    return {k: v for k, v in upstream.headers.items() if k.lower() not in _DROP_RESPONSE and k.lower() != "content-length"}


async def _disconnected(receive) -> None:
    """Returns when the client has gone (the body was read already: only a disconnect can come)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _Relay(Response):
    """Relays the upstream response as its bytes arrive (no buffering); stops, and closes the
    upstream connection so the replica aborts the request, as soon as the client goes away."""

    def __init__(self, upstream: aiohttp.ClientResponse, first: bytes, gone: asyncio.Future, finished,
                 replica: int) -> None:
        self.upstream, self.first, self.gone, self.finished = upstream, first, gone, finished
        self.status_code, self.background = upstream.status, None
        self.raw_headers = [(k.lower(), v) for k, v in upstream.raw_headers if k.lower().decode() not in _DROP_RESPONSE]
        self.raw_headers.append((b"x-tokenmill-replica", str(replica).encode()))  # which one answered (its index)
        self.complete = False

    async def __call__(self, scope, receive, send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        try:
            await asyncio.wait({pump, self.gone}, return_when=asyncio.FIRST_COMPLETED)
            if pump.done():
                pump.result()
        finally:
            for t in (pump, self.gone):
                t.cancel()
            await asyncio.gather(pump, self.gone, return_exceptions=True)
            if self.complete:
                self.upstream.release()  # read to its end: the connection serves the next request
            else:
                self.upstream.close()    # cut: the replica sees the client leave and aborts
            await self.finished()

    async def _pump(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        chunk = self.first
        try:
            while chunk:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                chunk = await self.upstream.content.readany()
            self.complete = True
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:  # the replica died mid-response: the status is out
            log.warning("replica %s failed mid-response: %r", self.upstream.url, e)
            if self.upstream.headers.get("content-type", "").startswith("text/event-stream"):
                err = {"error": {"message": "the replica serving this stream failed; the stream is incomplete",
                                 "type": "internal_error", "param": None, "code": 502}}
                await send({"type": "http.response.body", "body": f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n"
                            .encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
