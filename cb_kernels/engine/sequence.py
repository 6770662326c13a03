"""One request's token state as the scheduler and block manager see it."""
from __future__ import annotations

import enum

from cb_kernels.engine import structured
from cb_kernels.engine.config import RequestMetrics, SamplingParams
from cb_kernels.engine.detokenizer import IncrementalDetokenizer

# The last token of a sequence whose sampled token is still on the device (overlapped steps, see
# step_loop.py): it holds the token's slot while the next step is scheduled; never a real id.
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
                 "num_streamed_tokens", "streamed_text", "group", "sample_index", "sample_seed",
                 "logprobs", "cumulative_logprob", "prompt_logprobs", "detokenizer",
                 "stop_reason", "kv_epoch", "state_slot", "grammar")

    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list,
                 params: SamplingParams, arrival_time: float = 0.0,
                 eos_token_ids: frozenset = frozenset(), group: "SampleGroup" = None):
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
        self.state_slot = -1  # its slot of the stateful layers' pool (engine/state_slots.py)
        self.status = SequenceStatus.WAITING
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.eos_token_ids = eos_token_ids
        self.generator = None
        self.finish_reason = None
        self.error = None
        self.num_streamed_tokens = 0
        self.streamed_text = ""
        self.sample_index = 0           # which of the request's n samples (SamplingParams.n)
        # n > 1: the request's SampleGroup; `group` is given for the samples forked off it
        # (request_id (id, root seq_id, index)), which leave the prompt logprobs to the first.
        self.group = group if group is not None else SampleGroup(self) if params.n > 1 else None
        self.sample_seed = None         # set by the Sampler at the first draw
        self.logprobs = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs = [None] if params.prompt_logprobs is not None and group is None \
            else None
        self.detokenizer = None         # an IncrementalDetokenizer when params.stop is set
        self.stop_reason = None
        # params.structured's matcher (engine/structured.py), set by Engine.add_request; it has
        # taken exactly the output tokens.
        self.grammar = None

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
    def wants_prompt_logprobs(self) -> bool:
        """Whether prompt tokens still lack their logprob (such a request skips the prefix
        cache: every prompt position must run through the model)."""
        pl = self.prompt_logprobs
        return pl is not None and len(pl) < self.num_prompt_tokens

    def record_logprob(self, entry: dict, logprob: float) -> None:
        self.logprobs.append(entry)
        self.cumulative_logprob += logprob

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def check_stop(self, token_id: int, tokenizer=None):
        """Finish reason after appending `token_id`, or None to keep going (stop_reason says
        which stop token id or stop string it was). Stop strings need `tokenizer`."""
        p = self.params
        if self.num_generated_tokens > p.min_new_tokens:     # else masked (sampler.py)
            if not p.ignore_eos and token_id in self.eos_token_ids:
                return "stop"
            if token_id in p.stop_token_ids:
                self.stop_reason = token_id
                return "stop"
        if p.stop is not None and tokenizer is not None:
            if self.detokenizer is None:
                self.detokenizer = IncrementalDetokenizer(tokenizer, p.stop,
                                                          p.include_stop_str_in_output)
            matched = self.detokenizer.append(self.output_token_ids,
                                              self.num_generated_tokens >= p.min_new_tokens)
            if matched is not None:
                self.stop_reason = matched
                return "stop"
        if self.grammar is not None:     # complete: it takes no more tokens (or it failed)
            ended = structured.finish_reason(self.grammar)
            if ended is not None:
                reason, self.error = ended
                return reason
        if self.num_generated_tokens >= p.max_new_tokens:
            return "length"
        return None

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, request={self.request_id!r}, status={self.status.value},"
                f" tokens={self.num_tokens}, computed={self.num_computed_tokens},"
                f" blocks={self.block_table})")


class SampleGroup:
    """The n samples of one request (SamplingParams.n > 1). Sample 0 is the request's own
    Sequence; when it gets its first token the Sampler draws the others' first tokens from the
    same logits row (`pending`), and the engine forks them off its blocks. `outputs` collects
    each sample's CompletionOutput as it ends."""

    def __init__(self, root: "Sequence"):
        self.root = root
        self.samples = [root]
        self.pending: list = []           # samples drawn but not yet forked by the engine
        self.forked = False
        self.base_seed = None
        self.outputs: dict = {}

    def forks_now(self, seq: "Sequence") -> bool:
        return seq is self.root and not self.forked and seq.num_generated_tokens == 0

    def new_sample(self, root: "Sequence", index: int) -> "Sequence":
        child = Sequence(-1, (root.request_id, root.seq_id, index), root.prompt_token_ids,
                         root.params, root.metrics.arrival_time, root.eos_token_ids, group=self)
        child.sample_index = index
        if root.grammar is not None:     # the root's grammar has taken no token yet
            child.grammar = root.grammar.deep_copy()
        self.pending.append(child)
        return child

    def take_pending(self) -> list:
        """The drawn samples, to be forked now (once per request)."""
        pending, self.pending, self.forked = self.pending, [], True
        self.samples += pending
        return pending

    def expected(self) -> int:
        """How many samples end with an output: n once forked, else the root alone."""
        return len(self.samples)
