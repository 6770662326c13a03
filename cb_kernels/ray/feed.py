"""EngineFeed: one replica's Engine, stepped by one thread, fed by every batch the replica holds.

Ray Data hands a replica its next batch while the current one runs (EngineReplica's
`batches_in_flight`, 2 by default: Ray runs that many `__call__`s of the actor at once, each in its
own thread). Each call puts its rows in the feed's inbox and waits for its own; the feed's thread
adds them to the engine as they come and steps it, so the next batch's rows queue behind the
current one's in the engine's scheduler and take the slots its last rows free, instead of the
engine draining to one row and then waiting for Ray to return that batch and bring the next.

The Engine is not thread-safe: only the feed's thread touches it (and the tokenizer, which
add_request and the chat template use). No call can wait forever: every batch put in the inbox is
answered by that thread, with its results or with the error that stopped it; once it has stopped,
a new call fails at once with that error.
"""
from __future__ import annotations

import queue
import threading


class _Batch:
    """One call's rows: `makers[i]()` gives row i's (prompt, SamplingParams) or raises
    ValueError/TypeError; results[i] becomes its RequestOutput or that exception."""

    def __init__(self, makers: list):
        self.makers = makers
        self.results = [None] * len(makers)
        self.left = 0                      # rows still in the engine
        self.done = threading.Event()
        self.error = None                  # what stopped the feed, if it stopped


class EngineFeed:
    """Runs `engine` in a daemon thread. run(makers) -> the rows' results, in order; callable from
    several threads at once. stats(): batches, rows, joined_batches (batches whose rows entered
    while an earlier batch still had rows in the engine), steps, shared_steps (steps taken while
    rows of two or more batches were in the engine)."""

    def __init__(self, engine):
        self.engine = engine
        self._inbox = queue.SimpleQueue()
        self._lock = threading.Lock()      # orders run()'s put against the thread's failure
        self._failure = None
        self._owner = {}                   # request id -> (batch, row)
        self._live = []                    # batches with rows in the engine, oldest first
        self._stats = dict(batches=0, rows=0, joined_batches=0, steps=0, shared_steps=0)
        self._thread = threading.Thread(target=self._loop, name="cbk-engine-feed", daemon=True)
        self._thread.start()

    def run(self, makers: list) -> list:
        batch = _Batch(list(makers))
        with self._lock:
            if self._failure is not None:
                raise RuntimeError(f"this replica's engine stopped: {self._failure!r}") \
                    from self._failure
            self._inbox.put(batch)
        batch.done.wait()
        if batch.error is not None:
            raise RuntimeError(f"this replica's engine stopped: {batch.error!r}") from batch.error
        return batch.results

    def stats(self) -> dict:
        return dict(self._stats)

    def close(self) -> None:
        """Stops the thread; a batch still running gets an error (for a replica's teardown)."""
        with self._lock:
            if self._failure is None:
                self._inbox.put(None)
        self._thread.join()

    def _loop(self) -> None:
        try:
            while True:
                # Idle: sleep until a batch comes. Busy: take what came, then step.
                wait = not self.engine.has_unfinished()
                while True:
                    try:
                        batch = self._inbox.get(block=wait)
                    except queue.Empty:
                        break
                    if batch is None:
                        raise _Closed
                    self._admit(batch)
                    wait = False
                if self.engine.has_unfinished():
                    self._stats["steps"] += 1
                    self._stats["shared_steps"] += len(self._live) > 1
                    for out in self.engine.step():
                        self._finish(out)
        except BaseException as e:          # noqa: BLE001 (answered to every waiting batch)
            self._stop(e)

    def _admit(self, batch: _Batch) -> None:
        self._stats["batches"] += 1
        self._stats["rows"] += len(batch.makers)
        for i, make in enumerate(batch.makers):
            try:
                prompt, params = make()
                self._owner[self.engine.add_request(prompt, params)] = (batch, i)
                batch.left += 1
            except (ValueError, TypeError) as e:
                batch.results[i] = e
        if not batch.left:
            batch.done.set()
            return
        self._stats["joined_batches"] += bool(self._live)
        self._live.append(batch)

    def _finish(self, out) -> None:
        batch, i = self._owner.pop(out.request_id)
        batch.results[i] = out
        batch.left -= 1
        if not batch.left:
            self._live.remove(batch)
            batch.done.set()

    def _stop(self, error: BaseException) -> None:
        with self._lock:
            self._failure = error if not isinstance(error, _Closed) else \
                RuntimeError("the feed was closed")
            waiting = list(self._live)
            while True:
                try:
                    waiting.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
        for batch in waiting:
            if batch is not None:
                batch.error = self._failure
                batch.done.set()


class _Closed(Exception):
    pass
