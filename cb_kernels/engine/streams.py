"""StreamOrchestrator: which stream each piece of a step runs on, and where they wait for each other.

On CUDA there are three named streams: `compute` (the forward pass and sampling), `h2d` (swap-ins
and step inputs), `d2h` (swap-outs and the sampled tokens). The engine issues step N on compute,
asks for its tokens with `tokens_to_host` (a copy on d2h behind an event) and, with overlap on,
schedules and launches step N+1 before it calls `PendingTokens.result()` (step_loop.py). Every cross-stream dependency is made in exactly
one method:

- `_copy_stream`: a copy waits for the compute issued so far (it reads or overwrites blocks the
  forward may still touch) and for the other copy stream (a swap-out may reuse a host block a
  swap-in is still reading, and the reverse);
- `begin_compute`: compute waits for every swap issued since the last step (swap-ins it will read,
  swap-outs whose device blocks it may overwrite), never for the token copy, which nothing on the
  device reads;
- `PendingTokens.result`: the host waits for the token copy's event.

Without CUDA, or with overlap="off", the same calls run synchronously on the current stream and
return the same values; overlap="on" without CUDA logs that it runs synchronously (a documented
fallback, not an error), since a CPU backend has no asynchronous device to overlap with.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from cb_kernels.engine.config import OVERLAP_MODES

logger = logging.getLogger("cb_kernels.engine")


def check_overlap(overlap) -> str:
    if overlap not in OVERLAP_MODES:
        raise ValueError(f"overlap must be one of {OVERLAP_MODES}, got {overlap!r}")
    return overlap


class PendingTokens:
    """Sampled token ids on their way to the host; `result()` waits for them (a list of ints)."""

    def __init__(self, host: torch.Tensor, event=None):
        self._host = host
        self._event = event

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def result(self) -> list[int]:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host.tolist()


class StreamOrchestrator:
    """Streams and events of one engine on one device.

    Parameters
    ----------
    device : torch.device or str
        The device of the KV pool and the model.
    overlap : "auto" | "on" | "off"
        "auto" overlaps when the device is CUDA; "on" asks for it (synchronous with a logged
        notice on CPU); "off" runs every copy on the compute stream in program order.
    """

    def __init__(self, device, overlap: str = "auto"):
        self.device = torch.device(device)
        self.overlap = check_overlap(overlap)
        is_cuda = self.device.type == "cuda"
        if overlap == "on" and not is_cuda:
            logger.info("overlap='on' on %s: no asynchronous device to overlap with, steps run "
                        "synchronously (same results)", self.device)
        self.asynchronous = is_cuda and overlap != "off"
        self._pending_copies: list = []
        self._last_copy = {"h2d": None, "d2h": None}
        self._in_flight: list = []
        if self.asynchronous:
            with torch.cuda.device(self.device):
                self.compute = torch.cuda.current_stream(self.device)
                self.h2d = torch.cuda.Stream(self.device)
                self.d2h = torch.cuda.Stream(self.device)
        else:
            self.compute = self.h2d = self.d2h = None

    def _copy_stream(self, name: str):
        """The copy stream `name`, made to wait for compute and for the other copy stream."""
        stream = getattr(self, name)
        stream.wait_stream(self.compute)
        other = self._last_copy["d2h" if name == "h2d" else "h2d"]
        if other is not None:
            stream.wait_event(other)
        return stream

    def _issue_copy(self, name: str, fn: Callable, keep_alive=None, ordered: bool = True):
        """Run `fn(stream)` on copy stream `name`; returns the event after it (None when
        synchronous). `ordered` copies (swaps) are waited for by the next compute and by the
        other copy stream; an unordered one (the sampled tokens' trip to the host, which nothing
        on the device reads) is not, so the next step never waits for it."""
        if not self.asynchronous:
            fn(None)
            return None
        stream = self._copy_stream(name)
        with torch.cuda.stream(stream):
            fn(stream)
        event = torch.cuda.Event()
        event.record(stream)
        if ordered:
            self._last_copy[name] = event
            self._pending_copies.append(event)
        # Host tensors a queued copy still reads (its block mapping) must outlive it.
        self._in_flight = [(e, k) for e, k in self._in_flight if not e.query()]
        if keep_alive is not None:
            self._in_flight.append((event, keep_alive))
        return event

    def copy_out(self, fn: Callable, keep_alive=None) -> None:
        """Run `fn(stream)` (a device -> host copy, e.g. a swap-out) on d2h; `keep_alive` is held
        until the copy has run."""
        self._issue_copy("d2h", fn, keep_alive)

    def copy_in(self, fn: Callable, keep_alive=None) -> None:
        """Run `fn(stream)` (a host -> device copy, e.g. a swap-in) on h2d."""
        self._issue_copy("h2d", fn, keep_alive)

    def begin_compute(self) -> None:
        """Make compute wait for every copy issued since the last step; call before each forward."""
        if self.asynchronous:
            for event in self._pending_copies:
                self.compute.wait_event(event)
        self._pending_copies.clear()

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A step input (block tables, positions, ...) on the device, without a host sync.

        Issued on compute itself: an input copy is small and the forward needs it next anyway,
        and the pinned source may be reused only after it has been read, which compute orders.
        """
        if not self.asynchronous:
            return host.to(self.device)
        if not host.is_pinned():
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def tokens_to_host(self, tokens: torch.Tensor) -> PendingTokens:
        """Start copying `tokens` (int64 [num_seqs], on the device) to the host, on d2h."""
        if not self.asynchronous:
            return PendingTokens(tokens.to("cpu"))
        n = tokens.numel()
        # One pinned buffer per size would be reused by the next step before result() read it;
        # a fresh pinned tensor per step costs ~10 us, far below a decode step.
        host = torch.empty(n, dtype=tokens.dtype, pin_memory=True)
        event = self._issue_copy("d2h", lambda stream: host.copy_(tokens, non_blocking=True),
                                 ordered=False)
        tokens.record_stream(self.d2h)
        return PendingTokens(host, event)

    def synchronize(self) -> None:
        """Wait for everything issued on every stream (tests, shutdown, error recovery)."""
        if self.asynchronous:
            torch.cuda.synchronize(self.device)
        self._pending_copies.clear()
        self._in_flight.clear()
