"""One request's token state as the scheduler and block manager see it."""
from __future__ import annotations

import enum

from cb_kernels.engine.config import RequestMetrics, SamplingParams

# The last token of a sequence whose sampled token is still on the device (overlapped steps, see
# pipeline.py): it holds the token's slot while the next step is scheduled; never a real id.
PLACEHOLDER = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # not admitted yet, or preempted by recompute (holds no blocks)
    RUNNING = "running"      # holds device blocks
    SWAPPED = "swapped"      # blocks live in the host pool (offload)
    FINISHED = "finished"


class Sequence:
    """Tokens (prompt + generated), how many have KV in the cache, and the block table.

    `num_computed_tokens` counts leading tokens whose KV is written (or being written in the
    current step). A running sequence is decoding when exactly one token lacks KV: the last
    sampled one; before that it is prefilling (possibly in chunks).
    `block_hashes[i]` is the prefix-cache hash of full block i of `token_ids` (computed lazily,
    kept across preemptions because the tokens never change).
    """

    __slots__ = ("seq_id", "request_id", "token_ids", "num_prompt_tokens", "params",
                 "num_computed_tokens", "block_table", "block_hashes", "num_registered_blocks",
                 "status", "metrics", "eos_token_ids", "generator", "finish_reason", "error",
                 "num_streamed_tokens", "streamed_text", "kv_epoch")

    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list,
                 params: SamplingParams, arrival_time: float = 0.0,
                 eos_token_ids: frozenset = frozenset()):
        self.seq_id = seq_id
        self.request_id = request_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.params = params
        self.num_computed_tokens = 0
        self.block_table: list = []
        self.block_hashes: list = []
        self.num_registered_blocks = 0   # leading full blocks whose hash the block manager saw
        self.kv_epoch = 0     # BlockManager.epoch (the weights) its KV was computed under
        self.status = SequenceStatus.WAITING
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.eos_token_ids = eos_token_ids
        self.generator = None
        self.finish_reason = None
        self.error = None
        self.num_streamed_tokens = 0
        self.streamed_text = ""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def has_placeholder(self) -> bool:
        """Whether the last token is not known on the host yet (only inside Engine.step())."""
        return self.token_ids[-1] == PLACEHOLDER

    @property
    def is_decoding(self) -> bool:
        """One token lacks KV: the last sampled one (or the last prompt token of a 1-token
        prompt, whose block is already allocated: it decodes the same way)."""
        return self.num_computed_tokens == len(self.token_ids) - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def max_total_tokens(self) -> int:
        """Tokens this request can ever hold in the cache: prompt + max_new_tokens - 1 (the last
        sampled token is never fed back)."""
        return self.num_prompt_tokens + self.params.max_new_tokens - 1

    def check_stop(self, token_id: int):
        """Finish reason after appending `token_id`, or None to keep going."""
        if not self.params.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if token_id in self.params.stop_token_ids:
            return "stop"
        if self.num_generated_tokens >= self.params.max_new_tokens:
            return "length"
        return None

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id!r}, status={self.status.value},"
                f" tokens={self.num_tokens}, computed={self.num_computed_tokens},"
                f" blocks={self.block_table})")
