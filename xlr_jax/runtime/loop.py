"""The always-on engine loop: requests from any thread, results as they come.

One loop thread per loaded model drives the engine. Callers `submit`
requests (tokenized in their own thread) into a bounded inbox; the loop takes
them between device steps, so a request joins a running batch instead of
waiting for it to end, and hands each request's text, token ids and result to
its `RequestHandle` as they come. Nothing holds a lock across a yield to the
caller: a handle's consumer only reads a queue.

Every request, plain or speculating, joins the one engine loop (`Engine.serve`)
between its steps, in the order it was submitted: the loop thread adds it to the
engine's scheduler, and aborts cancelled ones there.

The thread holds only a weak reference to its `EngineLoop` while idle, so a model
nobody references is collected (its thread then exits); `shutdown()` and
interpreter exit end every request in flight with finish_reason "abort" and
wait for the loop to stop.
"""
from __future__ import annotations

import asyncio
import atexit
import itertools
import queue
import threading
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from xlr_jax.errors import InvalidRequestError, QueueFullError, XlrError

_DONE = object()  # the last event of a request's stream


class _Channel:
    """What the loop tells one request's consumer: events in order, then the result."""

    def __init__(self, aio_loop: asyncio.AbstractEventLoop | None = None):
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.result = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.aio_loop = aio_loop
        self.aio_events: asyncio.Queue | None = asyncio.Queue() if aio_loop else None

    def push(self, event) -> None:
        self.events.put(event)
        if self.aio_loop is not None:
            try:
                self.aio_loop.call_soon_threadsafe(self.aio_events.put_nowait, event)
            except RuntimeError:  # the caller's event loop is closed: nobody listens
                pass

    def finish(self, result=None, error: BaseException | None = None) -> None:
        if self.done.is_set():
            return
        self.result, self.error = result, error
        self.done.set()
        self.push(_DONE)


class RequestHandle:
    """One submitted request. Iterate it for text pieces (`tokens()` for token ids);
    `result()` blocks for the `GenerationResult`; `cancel()` stops it and frees its
    pages. A handle dropped unfinished cancels its request; so does closing, or
    dropping, an iterator over it before the end."""

    def __init__(self, request_id: int, channel: _Channel, loop: "EngineLoop"):
        self.id = request_id
        self._channel = channel
        self._loop = loop
        self._consumed = False
        weakref.finalize(self, loop.cancel, request_id)

    @property
    def done(self) -> bool:
        return self._channel.done.is_set()

    def result(self, timeout: float | None = None):
        if not self._channel.done.wait(timeout):
            raise TimeoutError(f"request {self.id} is still running after {timeout} s")
        if self._channel.error is not None:
            raise self._channel.error
        return self._channel.result

    def cancel(self) -> None:
        """Stop the request (a no-op once it ended); its result says "abort"."""
        self._loop.cancel(self.id)

    def force(self, token_ids) -> None:
        """Append these tokens to the output at the next step boundary, as if generated
        (to close a thought, say); generation goes on after them. Returns once they
        are appended; a request that ended (or speculates) raises."""
        self._loop.force(self.id, [int(t) for t in token_ids])

    def __iter__(self) -> Iterator[str]:
        for piece, _ in self._events():
            if piece:
                yield piece

    def tokens(self) -> Iterator[int]:
        """The request's token ids as they are accepted."""
        for _, ids in self._events():
            yield from ids

    def _events(self):
        if self._consumed:
            raise XlrError("a request's output can be iterated once; use result() for "
                           "the whole of it")
        self._consumed = True
        ended = False
        try:
            while (event := self._channel.events.get()) is not _DONE:
                yield event
            ended = True
            self.result()  # a failed request raises its error here
        finally:
            if not ended:  # closed or collected early: nobody wants the rest
                self.cancel()

    async def aresult(self):
        """`result()` for asyncio (the handle must come from an async submit)."""
        async for _ in self._aevents():
            pass
        return self.result()

    async def __aiter__(self):
        async for piece, _ in self._aevents():
            if piece:
                yield piece

    async def _aevents(self):
        if self._channel.aio_events is None:
            raise XlrError("this request was submitted without an event loop; "
                           "use Model.agenerate / Model.astream from async code")
        ended = False
        try:
            while (event := await self._channel.aio_events.get()) is not _DONE:
                yield event
            ended = True
            self.result()
        finally:
            if not ended:
                self.cancel()


@dataclass
class _Submission:
    """A request waiting in the inbox: the engine's request and its channel."""
    request: Any                     # runtime.request.Request
    channel: _Channel
    sent: int = 0                    # token ids already passed to the channel
    started: bool = False            # admitted to a running batch (no longer waiting)


@dataclass
class _Inbox:
    """The state the caller threads and the loop thread share, under one condition."""
    cond: threading.Condition = field(default_factory=threading.Condition)
    queue: deque = field(default_factory=deque)   # _Submission, in order
    cancelled: set = field(default_factory=set)   # request ids
    calls: deque = field(default_factory=deque)   # (fn, Future) to run on the loop
    in_engine: int = 0                            # in a loop's waiting queue, not started
    closed: bool = False


class EngineLoop:
    """Owns the loop thread of one engine. `submit` queues prepared requests; `call` runs
    a function on the loop thread between steps (what must not race the engine)."""

    def __init__(self, engine, max_waiting: int):
        self.engine = engine
        self.max_waiting = max_waiting
        self._inbox = _Inbox()
        self._ids = itertools.count()
        self._live: dict[int, _Submission] = {}  # the loop thread's requests, by id
        self._thread = threading.Thread(target=_serve, args=(self._inbox, weakref.ref(self)),
                                        name="xlr-engine-loop", daemon=True)
        self._thread.start()
        weakref.finalize(self, _close, self._inbox)
        # the loop thread outlives a collected loop object for a moment (it lets go of the
        # engine's device arrays as it ends): exit must wait for it too, not just close it
        _LOOPS[:] = [(t, i) for t, i in _LOOPS if t.is_alive()] + [(self._thread, self._inbox)]
        # registered now, after JAX made its backend: exit handlers run last-in first-out,
        # so the loop is stopped while the backend is still there (a thread left inside a
        # device call when the interpreter finalizes aborts the process)
        atexit.unregister(_shutdown_all)
        atexit.register(_shutdown_all)

    def new_id(self) -> int:
        return next(self._ids)

    def submit(self, requests: list, aio_loop: asyncio.AbstractEventLoop | None = None
               ) -> list[RequestHandle]:
        """Queue engine requests (all or none: past max_waiting, QueueFullError)."""
        subs = [_Submission(r, _Channel(aio_loop)) for r in requests]
        with self._inbox.cond:
            if self._inbox.closed:
                raise XlrError("the model was shut down; load it again to generate")
            waiting = len(self._inbox.queue) + self._inbox.in_engine
            if waiting + len(subs) > self.max_waiting:
                raise QueueFullError(
                    f"{waiting} requests are already waiting (max_waiting "
                    f"{self.max_waiting}); retry later, or load the model with a larger "
                    "max_waiting")
            self._inbox.queue.extend(subs)
            self._inbox.cond.notify()
        return [RequestHandle(s.request.index, s.channel, self) for s in subs]

    def cancel(self, request_id: int) -> None:
        with self._inbox.cond:
            self._inbox.cancelled.add(request_id)
            self._inbox.cond.notify()

    def force(self, request_id: int, token_ids: list[int]) -> None:
        """Queue forced tokens for a running plain request (see RequestHandle.force)."""
        def append():
            sub = self._live.get(request_id)
            if sub is None or sub.request.finish_reason is not None:
                raise InvalidRequestError(f"request {request_id} is not running (it ended, "
                                          "or has not started); nothing to force")
            if sub.request.spec is not None:
                raise InvalidRequestError("forced tokens are not supported under "
                                          "speculative decoding")
            self.engine.scheduler.force(sub.request, token_ids)
        self.call(append)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` on the loop thread between steps; return its value (or raise)."""
        if threading.current_thread() is self._thread:
            return fn()
        future: Future = Future()
        with self._inbox.cond:
            if self._inbox.closed:
                raise XlrError("the model was shut down; load it again to use it")
            self._inbox.calls.append((fn, future))
            self._inbox.cond.notify()
        return future.result()

    def counts(self) -> dict:
        """Requests running (in an engine loop's batch) and waiting (queued, or in a
        loop's queue); exact when called on the loop thread (`call`)."""
        with self._inbox.cond:
            waiting = len(self._inbox.queue) + self._inbox.in_engine
            return {"running": len(self._live) - self._inbox.in_engine, "waiting": waiting}

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the loop: requests in flight or queued end with finish_reason "abort"
        and give their pages back. Later submits raise."""
        _close(self._inbox)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # ------------------------------------------------------------ the loop thread

    def _run_next(self) -> None:
        """Run the engine loop until it drains."""
        with self._inbox.cond:
            if not self._inbox.queue:
                return
        scheduler = self.engine.scheduler
        self._poll(scheduler)
        try:
            for index, piece, result in self.engine.serve(self._poll):
                self._deliver(index, piece, result)
        except Exception as error:  # noqa: BLE001 - it goes to the requests it ended
            self._fail_running(scheduler.forget()[0], error)

    def _poll(self, scheduler, engine_running: bool = True) -> None:
        """Between steps: add newcomers to the engine's scheduler, end cancelled requests
        (all of them when closing), then run queued calls (`engine_running`: False while
        the loop is idle: newcomers stay in the inbox). With nothing of that to do it only
        takes the lock once (it runs every step)."""
        inbox = self._inbox
        with inbox.cond:
            calls, inbox.calls = inbox.calls, deque()
            cancelled, inbox.cancelled = inbox.cancelled, set()
            closed = inbox.closed
            dropped = [s for s in inbox.queue if s.request.index in cancelled] if cancelled \
                else []
            for sub in dropped:
                inbox.queue.remove(sub)
            while engine_running and not closed and inbox.queue:
                sub = inbox.queue.popleft()
                self._live[sub.request.index] = sub
                scheduler.add(sub.request)
                inbox.in_engine += 1
            starting = inbox.in_engine > 0
        for sub in dropped:  # cancelled before they reached a loop
            sub.channel.finish(sub.request.abort())
        if starting:  # admitted since the last step: running now (SMC delivers at its end)
            for r in scheduler.running:
                self._started(r.index)
        if cancelled or closed:
            for r in [*scheduler.waiting, *scheduler.running]:
                if (closed or r.index in cancelled) and r.finish_reason is None:
                    # its pages back now: a call queued after the cancel sees them
                    self._deliver(r.index, "", scheduler.abort(r))
        for fn, future in calls:
            _run_call(fn, future)

    def _started(self, index: int) -> None:
        """The request left the waiting queue: it runs (or ended)."""
        sub = self._live.get(index)
        if sub is not None and not sub.started:
            sub.started = True
            with self._inbox.cond:
                self._inbox.in_engine -= 1

    def _deliver(self, index: int, piece: str, result) -> None:
        sub = self._live.get(index)
        if sub is None:
            return
        self._started(index)
        ids = result.token_ids if result is not None else sub.request.generated
        new, sub.sent = list(ids[sub.sent:]), len(ids)
        if piece or new:
            sub.channel.push((piece, new))
        if result is not None:
            del self._live[index]
            sub.channel.finish(result)

    def _fail_running(self, waiting: list, error: BaseException) -> None:
        """An engine loop raised: its running requests and the first waiting one (the
        one admission refused) get the error; the other waiting ones queue again."""
        retry = [self._live.pop(r.index) for r in list(waiting)[1:] if r.index in self._live]
        for sub in self._live.values():
            sub.channel.finish(error=error)
        self._live.clear()  # the engine gave every page back
        with self._inbox.cond:
            self._inbox.queue.extendleft(reversed(retry))
            self._inbox.in_engine = 0

    def _abort_queued(self) -> None:
        """On close: every request still in the inbox ends with "abort"."""
        with self._inbox.cond:
            subs, self._inbox.queue = list(self._inbox.queue), deque()
            calls, self._inbox.calls = list(self._inbox.calls), deque()
        for sub in subs:
            sub.channel.finish(sub.request.abort())
        for _, future in calls:
            future.set_exception(XlrError("the model was shut down"))


def _run_call(fn, future: Future) -> None:
    try:
        future.set_result(fn())
    except BaseException as error:  # noqa: BLE001 - handed to the caller
        future.set_exception(error)


def _serve(inbox: _Inbox, loop_ref) -> None:
    """The loop thread: wait for work, run it; only a weak reference while idle."""
    while True:
        with inbox.cond:
            while not (inbox.queue or inbox.calls or inbox.closed):
                inbox.cond.wait()
        loop = loop_ref()
        if loop is None:
            return
        if inbox.closed:
            loop._abort_queued()
            return
        loop._poll(loop.engine.scheduler, engine_running=False)  # calls made while idle
        loop._run_next()
        del loop


def _close(inbox: _Inbox) -> None:
    with inbox.cond:
        inbox.closed = True
        inbox.cond.notify_all()


_LOOPS: list[tuple[threading.Thread, _Inbox]] = []  # every loop thread not known ended


def _shutdown_all() -> None:
    """At exit: stop every model's loop, its loop object collected or not, and wait for it
    (a step ends in bounded time). A daemon thread still inside XLA when the interpreter
    finalizes aborts the process ("terminate called ... exception not rethrown")."""
    for _, inbox in _LOOPS:
        _close(inbox)
    for thread, _ in _LOOPS:
        thread.join(timeout=120.0)
