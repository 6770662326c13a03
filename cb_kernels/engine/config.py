"""User-facing value types of the engine: EngineConfig, SamplingParams, RequestOutput.

Every field is checked when the object is built, so a mistake surfaces at the line that made it,
never inside a step. `None` in EngineConfig means "choose for me": the engine resolves it once
(see sizing.py) and logs the chosen value.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from cb_kernels.engine.structured import StructuredOutput

PREEMPTION_MODES = ("auto", "swap", "recompute")
OVERLAP_MODES = ("auto", "on", "off")
ATTENTION_BACKENDS = ("cuda", "triton", "cpu", "torch")
DTYPES = ("float32", "float16", "bfloat16")
LOGPROBS_MODES = ("raw", "processed")
FINISH_REASONS = ("length", "stop", "cancelled", "error", "abort")


def _check_int(name: str, value, low: int, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int{' or None' if allow_none else ''}, "
                        f"got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")


def _check_choice(name: str, value, choices, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}{' or None' if allow_none else ''}, "
                         f"got {value!r}")


@dataclass
class EngineConfig:
    """How the engine uses memory and compute. `None` = auto (resolved once, logged).

    block_size: tokens per KV block (auto: 16).
    num_blocks: KV blocks in the device pool (auto: from free memory, see sizing.py).
    max_batch_tokens: token budget of one step, shared by decodes and prefill chunks.
    max_num_seqs: most requests running at once (auto: min(256, max_batch_tokens)).
    cpu_offload_gib: size of the host swap pool in GiB (auto: from available memory; 0 = none).
    preemption: "auto", "swap" or "recompute" (what to do with a victim when blocks run out).
    prefix_caching: reuse KV blocks of identical prompt prefixes across requests.
    overlap: "auto", "on" or "off": schedule and launch step N+1 before step N's tokens reach the
        host (step_loop.py). auto = on for CUDA; "on" on a CPU runs the same loop with no gain.
    attention_backend: backend of the paged-attention op (None = the op's default).
    dtype: the dtype the engine computes and caches K/V in: None = the model's; a name
        ("float32", "bfloat16", "float16") must be the model's (Engine() refuses another: convert
        the model first, e.g. cb_kernels.models.load(..., dtype=...)). On CPU, bfloat16 is the
        fastest where the CPU has AVX512-BF16 or AMX (models.fast_dtype), float32 elsewhere.
    cuda_graphs: "auto", True or False (replay decode steps as CUDA graphs; "auto" = on CUDA).
    pack_weights: "auto", True or False (CPU fp32: run the model's linears on weights packed
        once, ops.PackedLinear or oneDNN's format on CPUs without AVX-512, one extra copy of them;
        "auto" = when that copy takes under a quarter of the available host memory; see
        cb_kernels/runner/packed_linears.py).
    greedy_head: "auto", True or False (CPU fp32 or bf16, any model whose logits are its LM head's
        output: an all-greedy step picks its tokens with cb_kernels.ops.GreedyHead, int8 scores with a
        proven error bound and exact rescoring of the few rows that can win, instead of every
        fp32 logit; same tokens. "auto" = where the CPU has AVX-512 VNNI, which makes it ~4x
        faster than the fp32 head; True also uses its slower portable body elsewhere).
    tensor_parallel_size: ranks the model is split over (torch.distributed, one process each:
        torchrun, or `cb-kernels generate --tensor-parallel-size N`; see README, "Tensor
        parallelism" and engine/distributed.py). tensor_parallel_timeout_s: how long a rank waits
        for the others in a collective (a dead or hung rank ends the run with an error then).
    """

    block_size: Optional[int] = None
    num_blocks: Optional[int] = None
    max_batch_tokens: Optional[int] = None
    max_num_seqs: Optional[int] = None
    cpu_offload_gib: Optional[float] = None
    preemption: str = "auto"
    prefix_caching: bool = True
    overlap: str = "auto"
    attention_backend: Optional[str] = None
    dtype: Optional[str] = None
    cuda_graphs: object = "auto"
    pack_weights: object = "auto"
    greedy_head: object = "auto"
    tensor_parallel_size: int = 1
    tensor_parallel_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1)
        if self.block_size is not None and self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        _check_int("num_blocks", self.num_blocks, 1)
        _check_int("max_batch_tokens", self.max_batch_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        if self.max_batch_tokens is not None and self.max_num_seqs is not None \
                and self.max_num_seqs > self.max_batch_tokens:
            raise ValueError(f"max_num_seqs ({self.max_num_seqs}) must be <= max_batch_tokens "
                             f"({self.max_batch_tokens}): every running request decodes one token "
                             "per step inside the token budget")
        if self.cpu_offload_gib is not None:
            if isinstance(self.cpu_offload_gib, bool) or not isinstance(self.cpu_offload_gib,
                                                                         (int, float)):
                raise TypeError("cpu_offload_gib must be a number or None, got "
                                f"{type(self.cpu_offload_gib).__name__}")
            if not math.isfinite(self.cpu_offload_gib) or self.cpu_offload_gib < 0:
                raise ValueError(f"cpu_offload_gib must be >= 0, got {self.cpu_offload_gib}")
        _check_choice("preemption", self.preemption, PREEMPTION_MODES)
        if self.preemption == "swap" and self.cpu_offload_gib == 0:
            raise ValueError("preemption='swap' needs a host pool, but cpu_offload_gib=0 makes "
                             "none; give cpu_offload_gib > 0 (or None: auto) or use "
                             "preemption='recompute'")
        if not isinstance(self.prefix_caching, bool):
            raise TypeError(f"prefix_caching must be a bool, got {type(self.prefix_caching).__name__}")
        _check_choice("overlap", self.overlap, OVERLAP_MODES)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS,
                      allow_none=True)
        _check_choice("dtype", self.dtype, DTYPES, allow_none=True)
        if self.cuda_graphs != "auto" and not isinstance(self.cuda_graphs, bool):
            raise ValueError(f"cuda_graphs must be 'auto', True or False, got {self.cuda_graphs!r}")
        if self.pack_weights != "auto" and not isinstance(self.pack_weights, bool):
            raise ValueError("pack_weights must be 'auto', True or False, got "
                             f"{self.pack_weights!r}")
        if self.greedy_head != "auto" and not isinstance(self.greedy_head, bool):
            raise ValueError("greedy_head must be 'auto', True or False, got "
                             f"{self.greedy_head!r}")
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1, allow_none=False)
        _check_number("tensor_parallel_timeout_s", self.tensor_parallel_timeout_s)
        if self.tensor_parallel_timeout_s <= 0:
            raise ValueError("tensor_parallel_timeout_s must be > 0, got "
                             f"{self.tensor_parallel_timeout_s}")


# Below this a temperature is refused: dividing fp32 logits by it overflows or, for values that
# round to 0 in fp32 (1e-46), divides by zero. vLLM treats temperatures under 1e-5 as greedy.
MIN_TEMPERATURE = 1e-5
SEED_LIMIT = 2 ** 64         # seeds are unsigned 64-bit (torch.Generator.manual_seed's range)


def _check_number(name: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


@dataclass
class SamplingParams:
    """How one request picks its tokens (see README, "Sampling").

    temperature 0 (or top_k 1) is greedy. seed gives the request its own random streams (one per
    sample), so its samples do not depend on what else runs. Generation stops at max_new_tokens,
    at the model's EOS (unless ignore_eos), at any of stop_token_ids or at any of the `stop`
    strings; a stop token is kept in the output ids, as transformers' generate keeps it.

    n: samples of the prompt (they share its KV blocks). logprobs=k / prompt_logprobs=k: the k
    most likely tokens' logprobs (log-softmax of the raw fp32 logits) and the chosen one's, per
    generated / prompt token. logprobs_mode="processed": a generated token's logprobs are those
    of the distribution it was picked from (after bias, min_new_tokens, penalties, and for
    sampled requests temperature, min_p, top_k, top_p: -inf where they removed a token); prompt
    logprobs stay raw (vLLM's raw_logprobs / processed_logprobs). min_new_tokens: EOS and stop ids are masked (and stop strings not
    checked) until that many tokens exist. Logits are changed in this order: logit_bias (added),
    the min_new_tokens mask, repetition_penalty (transformers' rule, over prompt and output
    tokens), frequency_penalty and presence_penalty (OpenAI's, over output tokens); greedy
    requests then take the argmax; sampled ones apply temperature, min_p (relative to the top
    probability), top_k and top_p.

    structured: a StructuredOutput (JSON schema, any JSON object, regex or choice); the tokens
    its grammar does not allow next are masked after the penalties (so greedy requests take the
    argmax among the allowed ones, and processed logprobs see the mask), and the request ends
    with "stop" once the grammar is complete. Needs the Engine's tokenizer and the
    `[structured]` extra (llguidance).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    stop_token_ids: tuple = ()
    ignore_eos: bool = False
    n: int = 1
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    stop: Optional[tuple] = None
    include_stop_str_in_output: bool = False
    min_new_tokens: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Optional[dict] = None
    logprobs_mode: str = "raw"
    structured: Optional[StructuredOutput] = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check (and normalize) every field; Engine.add_request calls it again, so a field
        changed after construction is checked too."""
        _check_int("max_new_tokens", self.max_new_tokens, 1, allow_none=False)
        for name in ("temperature", "top_p", "min_p", "repetition_penalty",
                     "frequency_penalty", "presence_penalty"):
            _check_number(name, getattr(self, name))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got "
                             f"{self.temperature}: so small a temperature underflows the logits")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check_int("top_k", self.top_k, 0, allow_none=False)
        _check_int("seed", self.seed, 0)
        if self.seed is not None and self.seed >= SEED_LIMIT:
            raise ValueError(f"seed must be < 2**64, got {self.seed}")
        if isinstance(self.stop_token_ids, int) or not hasattr(self.stop_token_ids, "__iter__"):
            raise TypeError("stop_token_ids must be a sequence of ints, got "
                            f"{type(self.stop_token_ids).__name__}")
        self.stop_token_ids = tuple(self.stop_token_ids)
        for t in self.stop_token_ids:
            _check_int("stop_token_ids[i]", t, 0, allow_none=False)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {type(getattr(self, name)).__name__}")
        _check_int("n", self.n, 1, allow_none=False)
        _check_int("logprobs", self.logprobs, 0)
        _check_int("prompt_logprobs", self.prompt_logprobs, 0)
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}, got "
                             f"{self.logprobs_mode!r}")
        _check_int("min_new_tokens", self.min_new_tokens, 0, allow_none=False)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens "
                             f"({self.max_new_tokens})")
        self.stop = _check_stop(self.stop)
        self.logit_bias = _check_logit_bias(self.logit_bias)
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise TypeError("structured must be a StructuredOutput, got "
                                f"{type(self.structured).__name__}")
            self.structured.validate()
            if self.min_new_tokens:
                raise ValueError("min_new_tokens cannot be combined with structured: the "
                                 "grammar decides where the output ends")
        # Read per row of every step: computed once here (validate runs again at add_request).
        self._sampling = self.temperature != 0 and self.top_k != 1
        self._changes_logits = bool(self.logit_bias) or self.min_new_tokens > 0 or \
            self.repetition_penalty != 1 or self.frequency_penalty != 0 or \
            self.presence_penalty != 0
        self._greedy = not self._sampling and self.n == 1 and self.logprobs is None and \
            self.prompt_logprobs is None and not self._changes_logits and \
            self.structured is None

    def check_vocab(self, vocab_size: int) -> None:
        """The checks that need the model: every token id a field names is in the vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids),
                          ("logit_bias", self.logit_bias or ())):
            for t in ids:
                if t >= vocab_size:
                    raise ValueError(f"{name} holds {t}, outside the vocabulary "
                                     f"[0, {vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and k > vocab_size:
                raise ValueError(f"{name} ({k}) must be <= the vocabulary size ({vocab_size})")

    @property
    def sampling(self) -> bool:
        """Whether tokens are drawn at random (else they are the argmax of the changed logits)."""
        return self._sampling

    @property
    def changes_logits(self) -> bool:
        """Whether logit_bias, min_new_tokens or a penalty changes the logits."""
        return self._changes_logits

    @property
    def greedy(self) -> bool:
        """The token is the argmax of the model's raw logits and nothing else is wanted from
        them: such steps may take the greedy head (runner/lm_head.py)."""
        return self._greedy


def _check_stop(stop) -> Optional[tuple]:
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)):
        raise TypeError(f"stop must be a str, a list of str or None, got {type(stop).__name__}")
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise TypeError(f"stop[{i}] must be a str, got {type(s).__name__}")
        if not s:
            raise ValueError(f"stop[{i}] is an empty string: it would match everywhere")
    return tuple(stop) or None


def _check_logit_bias(bias) -> Optional[dict]:
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise TypeError(f"logit_bias must be a dict token id -> bias or None, got "
                        f"{type(bias).__name__}")
    out = {}
    for t, b in bias.items():
        _check_int("logit_bias key", t, 0, allow_none=False)
        _check_number(f"logit_bias[{t}]", b)
        out[t] = float(b)
    return out or None



def parse_logit_bias(mapping, max_abs: Optional[float] = None) -> Optional[dict]:
    """SamplingParams.logit_bias from a JSON object (token ids as string keys, as the HTTP
    server and the generate command read them): {int token id: bias}. `max_abs` bounds each
    bias (OpenAI's API allows [-100, 100]); SamplingParams checks the rest. ValueError/TypeError
    with one set of messages for every caller."""
    if mapping is None:
        return None
    if not isinstance(mapping, dict):
        raise TypeError(f"logit_bias must be an object token id -> bias, got "
                        f"{type(mapping).__name__}")
    out = {}
    for key, value in mapping.items():
        # A string key must be a canonical decimal: int() also takes " 5 ", "1_0", "+5" and
        # "٥", so two spellings of one token could pass a filter that checked the other.
        text = key if isinstance(key, str) else None
        if text is not None and text[:1] == "-" and text[1:].isascii() and text[1:].isdigit():
            raise ValueError(f"logit_bias key {key} is not a token id")
        canonical = text is not None and text.isascii() and text.isdigit() and \
            (text == "0" or text[0] != "0")
        if not canonical and not (type(key) is int and key >= 0):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r} (write them as "
                             f"decimal integers: \"42\")")
        token = int(key)
        if max_abs is not None and isinstance(value, (int, float)) and \
                not (math.isfinite(value) and -max_abs <= value <= max_abs):
            raise ValueError(f"logit_bias[{key}] must be in [{-max_abs:g}, {max_abs:g}], "
                             f"got {value}")
        out[token] = value
    return out

@dataclass
class RequestMetrics:
    """Wall-clock times (time.perf_counter seconds) of one request."""

    arrival_time: float = 0.0
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    token_times: list = field(default_factory=list)  # one time per generated token
    num_cached_tokens: int = 0    # prompt tokens served from the prefix cache at the last admission
    num_preemptions: int = 0

    @property
    def ttft(self) -> Optional[float]:
        """Seconds from add_request to the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def inter_token_times(self) -> list:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


@dataclass
class CompletionOutput:
    """One sample of a request. logprobs: per generated token a dict token id -> logprob (the
    top `SamplingParams.logprobs` and the chosen token), or None when not asked;
    cumulative_logprob sums the chosen tokens' (None when not asked). stop_reason: the stop string
    or stop token id that ended it (None for EOS, length and the rest)."""

    index: int
    token_ids: list
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    stop_reason: object = None
    logprobs: Optional[list] = None
    cumulative_logprob: Optional[float] = None


@dataclass
class RequestOutput:
    """What a request produced. token_ids holds generated tokens only (in stream(): only the new
    ones of that step). finish_reason is None while the request still runs. outputs: one
    CompletionOutput per sample (SamplingParams.n); token_ids, text and finish_reason are those
    of outputs[0]. prompt_logprobs: None for the first prompt token, then a dict token id ->
    logprob per prompt token (when SamplingParams.prompt_logprobs asked), else None.
    weight_version: the Engine's weight_version when its last token was computed (weights
    changed since engine construction, counted: Engine.update_weights, weights_updated, or any
    change step() saw)."""

    request_id: str
    prompt_token_ids: list
    token_ids: list
    text: Optional[str] = None
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    outputs: list = field(default_factory=list)
    prompt_logprobs: Optional[list] = None
    weight_version: Optional[int] = None

    def __post_init__(self) -> None:
        if not self.outputs:
            self.outputs = [CompletionOutput(0, self.token_ids, self.text, self.finish_reason)]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
