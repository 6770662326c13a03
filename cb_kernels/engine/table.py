"""RequestTable: every request the Engine knows, in one place.

Three kinds of entry: live sequences (waiting, running or swapped; one per sample of an n > 1
request once it forked), the sample groups of n > 1 requests whose root already ended while other
samples run, and the outputs of ended requests that step() has not returned yet. The table also
hands out ids: automatic request ids ("req_N") and sequence ids, from one counter.
"""
from __future__ import annotations

from typing import Optional

from cb_kernels.engine import requests
from cb_kernels.engine.config import RequestOutput
from cb_kernels.engine.sequence import Sequence


class RequestTable:
    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self._seqs: dict = {}                 # request_id -> Sequence, while not ended
        self._groups: dict = {}               # request_id -> SampleGroup of n > 1, once forked
        self._outputs: list = []              # outputs of ended requests, not yet returned
        self._next_id = 0
        self._user_ids: set = set()           # ids of the automatic form the caller chose

    # -- ids --------------------------------------------------------------------------------------
    def new_request_id(self, request_id: Optional[str]) -> str:
        """`request_id` checked (a non-empty str, not in use), or the next automatic id. An
        automatic id skips every "req_..." id the caller ever chose, so the two never collide."""
        if request_id is None:
            while f"req_{self._next_id}" in self._seqs or f"req_{self._next_id}" in self._user_ids:
                self._next_id += 1
            return f"req_{self._next_id}"
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str or None, got {request_id!r}")
        if request_id.startswith("req_"):
            self._user_ids.add(request_id)
        if request_id in self._seqs or request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already waiting or running")
        return request_id

    def next_seq_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    # -- entries ----------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self._seqs[seq.request_id] = seq

    def add_forked(self, root: Sequence, children: list) -> None:
        """The other samples of `root`'s n > 1 request, now sequences of their own."""
        self._groups[root.request_id] = root.group
        for child in children:
            child.seq_id = self.next_seq_id()
            self._seqs[child.request_id] = child

    def get(self, request_id: str) -> Optional[Sequence]:
        """The live Sequence of a waiting or running request, else None."""
        return self._seqs.get(request_id)

    def samples(self, request_id) -> list:
        """The live samples of a request (all of them for n > 1); [] if none is live."""
        seq = self._seqs.get(request_id) if isinstance(request_id, str) else None
        if seq is None and isinstance(request_id, str) and request_id in self._groups:
            seq = self._groups[request_id].root      # ended, but other samples still run
        if seq is None:
            return []
        return [s for s in (seq.group.samples if seq.group is not None else [seq])
                if self.is_live(s)]

    def is_live(self, seq: Sequence) -> bool:
        return self._seqs.get(seq.request_id) is seq

    def live(self):
        return self._seqs.values()

    @property
    def num_live(self) -> int:
        return len(self._seqs)

    def has_unfinished(self) -> bool:
        return bool(self._seqs or self._outputs)

    # -- outputs ----------------------------------------------------------------------------------
    def remove(self, seq: Sequence) -> None:
        """`seq` ended (finish_reason set): it leaves the table; its request's output is queued
        once the last of its samples ended."""
        del self._seqs[seq.request_id]
        out = requests.output_of(seq, seq.output_token_ids, self.tokenizer)
        if out is not None:     # None: other samples of the request still run
            self._outputs.append(out)
            if seq.group is not None:
                self._groups.pop(out.request_id, None)

    def reject(self, prompt, error: Exception) -> RequestOutput:
        """The "error" output of a prompt add_request refused (with an id of its own)."""
        return requests.error_output(f"req_rejected_{self.next_seq_id()}", prompt, error)

    def defer(self, outputs: list) -> None:
        self._outputs += outputs

    def take_outputs(self) -> list:
        outputs, self._outputs = self._outputs, []
        return outputs
