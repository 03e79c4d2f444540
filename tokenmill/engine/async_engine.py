"""AsyncEngine: the LLMEngine on its own thread behind an asyncio interface (the EngineClient).

Only the engine thread touches the engine. The event loop sends it commands (add, abort) through
a queue and receives RequestOutputs through per-request asyncio queues, so HTTP handling never
stalls a step and a step never stalls HTTP. PyTorch releases the GIL inside its kernels, which is
what lets the event loop breathe while a step runs.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import math
import queue
import threading
import time
from typing import AsyncIterator, Callable, Protocol

from tokenmill.core.sched_output import StepStats
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.outputs import PoolingRequestOutput, RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams

log = logging.getLogger("tokenmill")


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-queue-len: the server answers 503 instead of queueing."""


class EngineDeadError(RuntimeError):
    pass


class RequestFailedError(RuntimeError):
    """This request failed on its own (non-finite logits, a sampling error); the engine serves on."""


class RequestTimeoutError(RuntimeError):
    """The request ran past its time limit (--request-timeout) and was aborted in the engine."""


class QueueTimeoutError(RuntimeError):
    """The request waited past --max-queue-time without being scheduled; it never started."""


class EngineClient(Protocol):
    """What the server needs of an engine, wherever the engine runs."""
    tokenizer: object
    max_model_len: int
    tasks: frozenset[str]  # what the model serves: generate, embed, classify

    def generate(self, req_id: str, prompt: str | list[int], params: SamplingParams | PoolingParams,
                 priority: int = 0, cache_salt: str | None = None, lora_name: str | None = None
                 ) -> AsyncIterator[RequestOutput | PoolingRequestOutput]: ...
    @property
    def num_waiting(self) -> int:
        """Requests not yet running: queued for the engine plus the engine's own queue."""

    def abort(self, req_id: str) -> None: ...

    @property
    def dead(self) -> BaseException | None:
        """The error that stopped the engine, or None while it serves."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine],
                 stat_logger: Callable[[StepStats], None] | None = None,
                 max_queue_len: int | None = None, on_dead: Callable[[BaseException], None] | None = None,
                 request_timeout: float | None = None, max_queue_time: float | None = None) -> None:
        """`engine`: the engine, or (better) a function that builds it, called on the engine thread.
        The model's kernels run in OpenMP thread teams, one per thread that starts parallel work;
        when loading runs on one thread and steps on another there are two teams, more OpenMP
        threads than cores, and libgomp then stops spin-waiting between parallel regions: every
        region sleeps and wakes its workers through the kernel, which made single-stream decode
        in the server a fraction of the offline speed (RESULTS.md). Built and stepped on one thread,
        the engine has one team. A build error is raised here.
        `on_dead`: called (on the engine thread) once a step fails beyond one request, after every
        in-flight request has been failed; the server uses it to exit non-zero.
        `request_timeout` / `max_queue_time` (seconds from submission; None: no limit) are enforced
        on the engine thread between steps, so a request is stopped and its KV blocks freed even
        when nothing on the event loop is waiting on it."""
        self.stat_logger = stat_logger
        self.max_queue_len = max_queue_len
        self.on_dead = on_dead
        self.request_timeout, self.max_queue_time = request_timeout, max_queue_time
        self._deadlines: dict[str, tuple[float, float]] = {}  # req id -> (total, queue) deadline, monotonic
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._dead: BaseException | None = None
        self._engine_waiting = 0  # the scheduler's waiting queue as of the engine thread's last look
        self._pending_adds = 0    # submitted by the event loop, not yet taken by the engine thread
        self._lock = threading.Lock()
        ready, failed = threading.Event(), []
        self._thread = threading.Thread(target=self._main, args=(engine, ready, failed), name="tokenmill-engine",
                                        daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            self._thread.join()
            raise failed[0]

    def _main(self, engine: LLMEngine | Callable[[], LLMEngine], ready: threading.Event, failed: list) -> None:
        try:
            self.engine = engine if isinstance(engine, LLMEngine) else engine()
            self.tokenizer = self.engine.tokenizer
            self.max_model_len = self.engine.max_model_len
            self.tasks = self.engine.tasks
            # the one piece of the engine other threads may call: its thread-safe constraint compiler
            self._constraints = self.engine.constraint_compiler()
        except BaseException as e:  # noqa: BLE001 - handed to the constructor's caller
            failed.append(e)
            return
        finally:
            ready.set()
        self._run()

    # ---------------------------------------------------------------- event-loop side
    async def generate(self, req_id: str, prompt: str | list[int], params: SamplingParams | PoolingParams,
                       priority: int = 0, cache_salt: str | None = None, lora_name: str | None = None
                       ) -> AsyncIterator[RequestOutput | PoolingRequestOutput]:
        """The request's outputs as the engine makes them; with PoolingParams one, its vector.
        `lora_name`: a LoRA adapter loaded in the engine that it runs under (None: the base)."""
        if self._dead is not None:
            raise EngineDeadError("the engine has stopped after an internal error")
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:  # compiled here, off the engine thread (ValueError: 400)
            await asyncio.to_thread(self._constraints, params)
        with self._lock:
            waiting = self.num_waiting
            if self.max_queue_len is not None and waiting >= self.max_queue_len:
                raise QueueFullError(f"the server is at capacity: {waiting} requests are already waiting "
                                     f"(--max-queue-len {self.max_queue_len}); retry later.")
            self._pending_adds += 1
        loop = asyncio.get_running_loop()
        out_q: asyncio.Queue = asyncio.Queue()
        added: concurrent.futures.Future = concurrent.futures.Future()
        now = time.monotonic()
        deadlines = (now + (self.request_timeout or math.inf), now + (self.max_queue_time or math.inf))
        self._cmds.put(("add", req_id, prompt, params, priority, cache_salt, lora_name, added, (loop, out_q),
                        deadlines))
        self._wake.set()
        finished = False
        try:  # from here on a caller that goes away (cancellation) aborts the request, even mid-add
            await asyncio.wrap_future(added)  # raises the engine's ValueError for a bad request
            while True:
                item = await out_q.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:
                    finished = True
                    raise RequestFailedError(item.error)
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(req_id)

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: queued for the engine thread plus the scheduler's queue."""
        return self._pending_adds + self._engine_waiting

    @property
    def dead(self) -> BaseException | None:
        return self._dead

    def abort(self, req_id: str) -> None:
        self._cmds.put(("abort", req_id))
        self._wake.set()

    async def call(self, fn: Callable[[LLMEngine], object]) -> object:
        """fn(engine) run on the engine thread between steps (the engine is not thread-safe); its
        result, or its exception raised here. For the rare calls that change the engine: LoRA
        adapters loaded and unloaded at run time, the list of them."""
        if self._dead is not None:
            raise EngineDeadError("the engine has stopped after an internal error")
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(("call", fn, done))
        self._wake.set()
        return await asyncio.wrap_future(done)

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    # ---------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while not self._stopped:
                self._turn()
        except Exception as e:  # noqa: BLE001 - whatever breaks the loop fails requests, never hangs them
            log.exception("engine step failed; the engine stops")
            self._dead = e
            self._fail_all(EngineDeadError(f"the engine has stopped after an internal error{_cause(e)}"))
            self.engine.shutdown()
            if self.on_dead is not None:
                self.on_dead(e)
            return
        self._fail_all(EngineDeadError("the engine is shutting down"))
        self.engine.shutdown()

    def _turn(self) -> None:
        """One pass of the engine thread: commands, time limits, then a step if there is work."""
        engine = self.engine
        self._drain_commands()
        if self._deadlines:
            self._expire(time.monotonic())
        if not engine.has_unfinished_requests():
            engine.check_health()  # a lost tensor-parallel rank stops an idle engine too
            self._wake.wait(timeout=1.0)
            self._wake.clear()
            return
        outputs = engine.step()
        self._engine_waiting = engine.num_waiting()
        self._deliver(outputs)
        if self.stat_logger is not None:
            self.stat_logger(engine.stats())

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their event loops, one wake-up per loop and step: a call per
        output would write to the loop's self-pipe and wake it once per stream."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is None:
                continue
            loop, out_q = target
            batches.setdefault(loop, []).append((out_q, out))
            if out.finished:
                del self._streams[out.request_id]
                self._deadlines.pop(out.request_id, None)
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, req_id, prompt, params, priority, cache_salt, lora_name, added, target, deadlines = cmd
                try:
                    self.engine.add_request(req_id, prompt, params, priority=priority, cache_salt=cache_salt,
                                            lora_request=lora_name)
                except Exception as e:  # noqa: BLE001 - reported to the caller, engine unharmed
                    with self._lock:
                        self._pending_adds -= 1
                    _settle(added, error=e)
                    continue
                self._streams[req_id] = target
                if deadlines != (math.inf, math.inf):
                    self._deadlines[req_id] = deadlines
                with self._lock:
                    self._pending_adds -= 1
                    self._engine_waiting = self.engine.num_waiting()
                _settle(added)  # a caller that left meanwhile has queued an abort behind this add
            elif cmd[0] == "call":
                _, fn, done = cmd
                try:
                    result = fn(self.engine)
                except Exception as e:  # noqa: BLE001 - reported to the caller, engine unharmed
                    _settle(done, error=e)
                else:
                    _settle(done, result)
            else:
                self._abort(cmd[1])

    def _abort(self, req_id: str, err: BaseException | None = None) -> None:
        """Stops the request in the engine; `err` goes to its stream (a client that aborted itself
        is not waiting for anything)."""
        self.engine.abort_request(req_id)
        target = self._streams.pop(req_id, None)
        self._deadlines.pop(req_id, None)
        if err is not None and target is not None:
            target[0].call_soon_threadsafe(target[1].put_nowait, err)
        if self.stat_logger is not None:  # the stopped sequences count as finished with "abort"
            self.stat_logger(self.engine.stats())

    def _expire(self, now: float) -> None:
        for req_id, (total, queued) in list(self._deadlines.items()):
            if now >= queued and not self.engine.was_scheduled(req_id):
                self._abort(req_id, QueueTimeoutError(
                    f"the request waited {self.max_queue_time:g} s (--max-queue-time) without being scheduled; "
                    f"the server is overloaded, retry later."))
            elif now >= total:
                self._abort(req_id, RequestTimeoutError(
                    f"the request ran past its time limit of {self.request_timeout:g} s (--request-timeout) "
                    f"and was stopped."))

    def _fail_all(self, err: BaseException) -> None:
        for loop, out_q in self._streams.values():
            loop.call_soon_threadsafe(out_q.put_nowait, err)
        self._streams.clear()


def _cause(e: BaseException) -> str:
    """What a client may read of the error that stopped the engine: a lost tensor-parallel rank
    says so; anything else stays in the server's log."""
    from tokenmill.distributed.errors import WorkerDiedError
    return f": {e}" if isinstance(e, WorkerDiedError) else ""


def _settle(future: concurrent.futures.Future, result: object = None, error: BaseException | None = None) -> None:
    """Resolve the caller's future unless the caller cancelled it (it went away)."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for out_q, out in items:
        out_q.put_nowait(out)
