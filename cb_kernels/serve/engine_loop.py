"""EngineLoop: the one thread that owns the Engine.

The HTTP side (an asyncio event loop) never touches the Engine. It hands a `Ticket` in through a
thread-safe inbox (queue.SimpleQueue: its put is safe from a signal handler too) and reads the
request's deltas and final RequestOutput from the ticket's asyncio.Queue, which the engine thread
fills with `loop.call_soon_threadsafe` and never waits on: a slow client cannot stall a step.

Per pass the thread takes every command waiting in the inbox (blocking only when the engine is
idle), then runs one step, publishes the engine's stats, and hands each ticket its news: stream
deltas (streaming tickets only) and, when its request ended, the final output.

Admission is bounded: at most `max_waiting` requests may be accepted but not yet scheduled;
`submit` raises QueueFull past that (the server answers 503 with Retry-After). `drain(timeout)`
stops admission; requests still unfinished `timeout` seconds later are cancelled (finish_reason
"cancelled"), and a second drain cancels them at once.
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger("cb_kernels.serve")


class QueueFull(Exception):
    """The waiting queue holds max_waiting requests."""


class Draining(Exception):
    """The server is shutting down and takes no new request."""


@dataclass
class Ticket:
    """One engine request as the HTTP side sees it. `put(kind, item)` is how the engine thread
    talks to it: its queue gets (kind, index, item), kind "delta" or "final" with a
    RequestOutput, or "error" with a message."""

    request_id: str
    token_ids: list
    params: object
    stream: bool
    index: int = 0                   # which prompt of its HTTP request
    aio_loop: object = None          # the asyncio loop of `queue`
    queue: object = None             # asyncio.Queue
    scheduled: bool = False          # counted out of the waiting queue (engine thread only)
    abandoned: bool = False          # its client left: no more news (engine thread only)
    seq: object = None

    def put(self, kind: str, item) -> None:
        _deliver_soon(self.aio_loop, [(self.queue, (kind, self.index, item))])


def _deliver(items: list) -> None:
    for q, item in items:
        q.put_nowait(item)


def _deliver_soon(aio_loop, items: list) -> None:
    """Hand `items` ((asyncio.Queue, item) pairs) to `aio_loop` in one wake-up."""
    try:
        aio_loop.call_soon_threadsafe(_deliver, items)
    except RuntimeError:      # the event loop is closed: nobody is listening any more
        pass


class EngineLoop:
    def __init__(self, engine, max_waiting: int = 256, metrics=None, idle_poll_s: float = 0.5):
        self.engine = engine
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.idle_poll_s = idle_poll_s
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.num_queued = 0              # accepted, not yet scheduled (guarded by lock)
        self.draining = False
        self.drain_deadline: Optional[float] = None
        self.stopping = False
        self.snapshot = dict(engine.stats())   # published after every step (read by /health)
        self.error: Optional[str] = None       # set if the thread died
        self._tickets: dict = {}               # engine thread only
        self._thread = threading.Thread(target=self._run, name="cb-kernels-engine", daemon=True)

    # -- called from the HTTP side ---------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, tickets: list) -> None:
        """Queue `tickets` (all or none): QueueFull when they would overflow the waiting queue,
        Draining once shutdown began."""
        with self.lock:
            if self.draining or not self.alive:
                raise Draining()
            if self.num_queued + len(tickets) > self.max_waiting:
                raise QueueFull()
            self.num_queued += len(tickets)
        for t in tickets:
            self.inbox.put(("add", t))

    def cancel(self, request_id: str) -> None:
        self.inbox.put(("cancel", request_id))

    def call(self, fn) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread between two steps (the RL routes: pause,
        sleep, update_weights); the future holds its result or its exception."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.put(("call", (fn, future)))
        return future

    def drain(self, timeout: float) -> None:
        """Stop admission; cancel what is unfinished after `timeout` s (at once when called
        again). Safe from a signal handler."""
        self.draining = True
        self.inbox.put(("drain", timeout))

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel everything, end the thread."""
        self.draining = True
        self.inbox.put(("stop", None))
        self._thread.join(timeout)

    # -- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:       # the engine itself broke: every client gets told
            self.error = f"{type(e).__name__}: {e}"
            logger.exception("the engine thread failed")
            self.draining = True
            waiting = list(self._tickets.values())
            self._tickets.clear()
            while True:       # tickets handed in but never added get told too
                try:
                    kind, arg = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    waiting.append(arg)
            for t in waiting:
                t.put("error", f"the engine failed: {self.error}")

    def _loop(self) -> None:
        engine = self.engine
        while True:
            # Paused or asleep: step() computes nothing; poll, do not spin.
            busy = engine.has_unfinished() and not (engine.is_paused or engine.is_sleeping)
            self._take_commands(block=not busy)
            if self.stopping and not engine.has_unfinished():
                stats = engine.stats()
                logger.info("engine stopped: %d requests left, %d KV blocks used",
                            len(self._tickets), stats["used_blocks"])
                return
            if self.drain_deadline is not None and time.monotonic() >= self.drain_deadline:
                self._cancel_all()
            if not engine.has_unfinished():
                continue
            outputs = engine.step()
            ended = {o.request_id: o for o in outputs}
            self.snapshot = dict(engine.stats())
            if self.metrics is not None:
                self.metrics.observe_step(self.snapshot)
            self._dispatch(ended)

    def _take_commands(self, block: bool) -> None:
        try:
            cmd = self.inbox.get(timeout=self.idle_poll_s) if block else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*cmd)
            try:
                cmd = self.inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, kind: str, arg) -> None:
        if kind == "add":
            self._add(arg)
        elif kind == "cancel":
            t = self._tickets.get(arg)
            if t is not None:
                t.abandoned = True
                self._cancel(arg)
        elif kind == "drain":
            now = time.monotonic()
            if self.drain_deadline is not None or arg <= 0:
                self.drain_deadline = now        # a second signal: cancel now
            else:
                self.drain_deadline = now + arg
            logger.info("draining: %d requests unfinished, cancelled in %.1f s",
                        len(self._tickets), self.drain_deadline - now)
        elif kind == "call":
            fn, future = arg
            try:
                future.set_result(fn(self.engine))
            except Exception as e:    # noqa: BLE001 (the caller gets it)
                future.set_exception(e)
        elif kind == "stop":
            self.stopping = True
            self._cancel_all()

    def _add(self, t: Ticket) -> None:
        try:
            self.engine.add_request(t.token_ids, t.params, request_id=t.request_id)
        except (ValueError, TypeError) as e:     # checked on the HTTP side: should not happen
            self._unqueue(t)
            t.put("error", f"{type(e).__name__}: {e}")
            return
        t.seq = self.engine.sequence(t.request_id)
        self._tickets[t.request_id] = t
        if self.stopping or (self.drain_deadline is not None
                             and time.monotonic() >= self.drain_deadline):
            self._cancel(t.request_id)

    def _cancel(self, request_id: str) -> None:
        try:
            self.engine.cancel(request_id)
        except ValueError:      # ended already (its output comes with the next step)
            pass

    def _cancel_all(self) -> None:
        for rid in list(self._tickets):
            self._cancel(rid)

    def _unqueue(self, t: Ticket) -> None:
        if not t.scheduled:
            t.scheduled = True
            with self.lock:
                self.num_queued -= 1

    def _dispatch(self, ended: dict) -> None:
        """Every ticket's news of this step, handed to each event loop in one wake-up."""
        frontend = self.engine.frontend
        news: dict = {}         # asyncio loop -> [(queue, item)]
        for rid, t in list(self._tickets.items()):
            done = rid in ended
            if not t.scheduled and (done or t.seq.metrics.first_scheduled_time is not None):
                self._unqueue(t)
            if t.stream and not t.abandoned:
                for delta in frontend.deltas(t.seq, done):
                    news.setdefault(t.aio_loop, []).append((t.queue, ("delta", t.index, delta)))
            if done:
                del self._tickets[rid]
                out = ended[rid]
                if self.metrics is not None:
                    self.metrics.observe_request(out)
                if not t.abandoned:
                    news.setdefault(t.aio_loop, []).append((t.queue, ("final", t.index, out)))
        for aio_loop, items in news.items():
            _deliver_soon(aio_loop, items)
