"""The engine loop: one thread steps the engine; asyncio handlers await their tokens.

The :class:`~attnmask.engine.Engine` is stepped from one thread only. :class:`EngineLoop` owns that
thread: it runs ``engine.step()`` while the engine has work and sleeps on a condition when it has
none. The thread is either a background one (:meth:`EngineLoop.start`, what tests and embedding
applications use) or the caller's (:meth:`EngineLoop.run_here`, what ``attnmask serve`` does with
its main thread, the HTTP server running on a background thread).

Why the main thread: the native kernels split their work with OpenMP, whose threads spin for a
while at the end of each parallel region before they sleep, so that the next region starts at
once. GNU OpenMP stops spinning almost at once when it manages more threads than there are CPUs,
and it counts every thread that has ever started a parallel region, with its team: the main thread
loaded the model (parallel regions), so a background engine thread with its own team makes it
manage twice the threads, and every region of every step then pays a sleep and a wake-up. On
2 cores SmolLM2's one-token step measured about 2.2× slower on a background thread than on the main
thread (docs/benchmarks.md, serving).

A handler :meth:`~EngineLoop.submit`\\ s a request and gets a :class:`RequestStream`: every
:class:`~attnmask.engine.TokenEvent` of that request is put on the stream's asyncio queue through
``loop.call_soon_threadsafe`` (one call per event loop and step, for all of the step's events), stamped
with the time the step ended (for time-to-first-token and inter-token latency). Leaving the stream before
the request has finished (the client went away, the handler was cancelled) cancels the request, so its
cache blocks are freed at the next step.

``engine.stats()`` reads the scheduler's lists, which only the loop thread may touch, so the loop
keeps a snapshot, taken after every step (:meth:`EngineLoop.stats`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from attnmask.engine import Engine, EngineStats, RequestParams, TokenEvent

__all__ = ["EngineFailed", "EngineLoop", "RequestStream", "ServerClosed", "Timed"]

log = logging.getLogger("attnmask.serve")


class ServerClosed(RuntimeError):
    """The loop is shutting down (or its engine failed): no new requests (HTTP 503)."""


class EngineFailed(RuntimeError):
    """The engine raised inside ``step``: a bug, delivered to every request that was running."""


@dataclass(frozen=True)
class Timed:
    """A token event and when its step ended (``time.perf_counter()``)."""

    event: TokenEvent | None  # None: the engine failed (``error`` says how)
    time: float
    error: BaseException | None = None


class RequestStream:
    """One request's events, as an async iterator of :class:`Timed`; an async context manager that
    cancels the request when left before it finished."""

    def __init__(self, owner: EngineLoop, request_id: str, prompt_len: int, loop: asyncio.AbstractEventLoop):
        self.owner, self.request_id, self.prompt_len = owner, request_id, prompt_len
        self.loop = loop
        self.queue: asyncio.Queue[Timed] = asyncio.Queue()
        self.created = time.perf_counter()
        self.finished = False

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop listening; cancel the request unless it has finished."""
        self.owner._release(self.request_id, cancel=not self.finished)
        self.finished = True

    def __aiter__(self):
        return self

    async def __anext__(self) -> Timed:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if item.error is not None:
            self.finished = True
            raise EngineFailed(f"the engine failed: {item.error!r}") from item.error
        if item.event.finished:
            self.finished = True
        return item


class EngineLoop:
    """Steps ``engine`` on a background thread (started by :meth:`start`) and routes its events.

    Args:
        engine: the :class:`~attnmask.engine.Engine`; nothing else may call its ``step``.
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._streams: dict[str, RequestStream] = {}
        self._streams_lock = threading.Lock()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._owned = False  # the thread is the loop's own (start), not a caller's (run_here)
        self._admitting = True
        self._stopping = False
        self._failed: BaseException | None = None
        self._stats = engine.stats()

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> EngineLoop:
        """Start the thread (once; later calls do nothing)."""
        with self._wake:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="attnmask-engine", daemon=True)
                self._owned = True
                self._thread.start()
        return self

    @property
    def admitting(self) -> bool:
        return self._admitting and self._failed is None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._failed is None

    def stop_admitting(self) -> None:
        """New requests are refused (:class:`ServerClosed`); running ones go on."""
        self._admitting = False

    def shutdown(self, grace: float = 0.0) -> None:
        """Stop admitting, let running requests finish for up to ``grace`` seconds, cancel the rest,
        and join the thread."""
        self.stop_admitting()
        deadline = time.monotonic() + grace
        while self.engine.has_work() and time.monotonic() < deadline and self.alive:
            time.sleep(0.01)
        with self._streams_lock:
            running = list(self._streams)
        for rid in running:
            self.engine.cancel(rid)
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None and self._owned and self._thread is not threading.current_thread():
            self._thread.join()  # (run_here's caller returns by itself, now told to stop)

    # ---- requests ----------------------------------------------------------------------------
    def submit(self, prompt: Sequence[int], params: RequestParams) -> RequestStream:
        """Queue a request from a coroutine; its events arrive on the returned stream.

        Raises:
            ServerClosed: the loop is shutting down or its engine failed.
            ValueError: the engine's :class:`~attnmask.errors.UserError` (a request that can never fit,
                token ids outside the vocabulary).
        """
        if not self.admitting:
            raise ServerClosed("the server is shutting down" if self._failed is None else "the engine has failed")
        rid = f"req-{uuid.uuid4().hex}"
        stream = RequestStream(self, rid, len(prompt), asyncio.get_running_loop())
        with self._streams_lock:  # registered first: the loop may step before add_request returns
            self._streams[rid] = stream
        try:
            self.engine.add_request(prompt, params, request_id=rid)
        except BaseException:
            self._release(rid, cancel=False)
            raise
        with self._wake:
            self._wake.notify()
        return stream

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)
        with self._wake:
            self._wake.notify()

    def _release(self, request_id: str, *, cancel: bool) -> None:
        with self._streams_lock:
            self._streams.pop(request_id, None)
        if cancel:
            self.cancel(request_id)

    def stats(self) -> EngineStats:
        """The engine's statistics after its latest step."""
        return self._stats

    def run_here(self, until: Callable[[], bool]) -> None:
        """Step the engine on the calling thread until ``until()`` is true (checked at least every
        ``poll`` seconds while idle) and the engine has no work left, or :meth:`shutdown`. Then the
        loop is closed: running requests are cancelled, new ones refused."""
        with self._wake:
            if self._thread is not None:
                raise RuntimeError("the loop already runs on its own thread")
            self._thread = threading.current_thread()
        try:
            self._run(until)
        finally:
            self.stop_admitting()
            with self._streams_lock:
                running = list(self._streams)
            for rid in running:
                self.engine.cancel(rid)
            with contextlib.suppress(Exception):
                self._deliver(self.engine.step(), time.perf_counter())  # the cancellations

    # ---- the thread --------------------------------------------------------------------------
    poll = 0.05  # seconds between checks of ``until`` while idle

    def _run(self, until: Callable[[], bool] | None = None) -> None:
        engine = self.engine
        while True:
            if until is not None and until():
                return
            with self._wake:
                while not self._stopping and not engine.has_work():
                    if until is not None and until():
                        return
                    self._wake.wait(self.poll if until is not None else None)
                if self._stopping and not engine.has_work():
                    return
            try:
                events = engine.step()
            except BaseException as err:  # a bug in the engine: every waiting client hears of it
                log.exception("the engine failed; no new requests are admitted")
                self._failed = err
                self._fail_all(err)
                return
            now = time.perf_counter()
            self._stats = engine.stats()
            self._deliver(events, now)

    def _deliver(self, events: Sequence[TokenEvent], now: float) -> None:
        """Put each event on its request's stream (a finished request's stream leaves the table): one call into
        each event loop for the whole step, not one per event (each call wakes the loop through a socket)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Timed]]] = {}
        with self._streams_lock:
            for event in events:
                rid = event.request_id
                stream = self._streams.pop(rid, None) if event.finished else self._streams.get(rid)
                if stream is not None:  # else the client has gone
                    batches.setdefault(stream.loop, []).append((stream.queue, Timed(event, now)))
        for loop, items in batches.items():
            with contextlib.suppress(RuntimeError):  # its event loop is closed
                loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, err: BaseException) -> None:
        with self._streams_lock:
            streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            with contextlib.suppress(RuntimeError):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, Timed(None, time.perf_counter(), err))


def _put_all(items: list[tuple[asyncio.Queue, Timed]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)
