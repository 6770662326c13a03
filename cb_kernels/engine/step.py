"""What one step is once issued (LaunchedStep) and where the time of steps goes (StepClock)."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

import torch

from cb_kernels.engine.scheduler import ScheduledBatch


@dataclass
class LaunchedStep:
    """A step issued to the device.

    sampled[i] gets row i of the step's tokens: `tokens` is a PendingTokens (greedy rows, on their
    way to the host) or a list of ints (the Sampler ran on the host); device_tokens is int64
    [len(sampled)] on the device (greedy only), what the next step's placeholders are filled from.
    """

    batch: ScheduledBatch
    sampled: list
    tokens: object
    device_tokens: Optional[torch.Tensor]
    start: float                 # perf_counter at launch
    launch_s: float              # host seconds the launch took (the whole step on a CPU)
    late_commits: list           # (seq, num_new_tokens): blocks to hash once tokens are known

    @property
    def pending(self) -> bool:
        return self.device_tokens is not None and not isinstance(self.tokens, list)


class StepClock:
    """Where the time of steps goes.

    host_wait_s: seconds the host blocked on sampled tokens (PendingTokens.result).
    launch_s: host seconds spent issuing steps (packing, launches; on a CPU the whole forward).
    With `device_events` on (CUDA only; the bench turns it on, a step then records two timing
    events on the compute stream, ~10 us): device_busy_s, from each step's first input copy to its
    sampled tokens, and device_idle_s, the gaps between one step's end and the next one's start
    while requests were running (a pause with no request in the engine does not count).
    """

    def __init__(self, on_cuda: bool):
        self.on_cuda = on_cuda
        self.device_events = False
        self.host_wait_s = 0.0
        self.launch_s = 0.0
        self.device_busy_s = 0.0
        self.device_idle_s = 0.0
        self.timed_steps = 0
        self._last_end = None
        self._unread: deque = deque()    # (previous end or None, start, end) events

    def start(self):
        if not (self.on_cuda and self.device_events):
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def end(self, start) -> None:
        if start is None:
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self._unread.append((self._last_end, start, event))
        self._last_end = event

    def wait(self, tokens) -> list:
        t0 = time.perf_counter()
        out = tokens.result()
        self.host_wait_s += time.perf_counter() - t0
        return out

    def idle(self) -> None:
        """No request is left: the next step's gap is not device idle time of this workload."""
        self._last_end = None

    def stats(self) -> dict:
        while self._unread and self._unread[0][2].query():
            prev_end, start, end = self._unread.popleft()
            self.device_busy_s += start.elapsed_time(end) / 1e3
            if prev_end is not None:
                self.device_idle_s += prev_end.elapsed_time(start) / 1e3
            self.timed_steps += 1
        return {"host_wait_s": self.host_wait_s, "launch_s": self.launch_s,
                "device_busy_s": self.device_busy_s,
                "device_idle_s": self.device_idle_s, "timed_steps": self.timed_steps}
