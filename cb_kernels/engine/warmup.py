"""The engine's warm-up: one-time costs paid in `Engine()`, not in the user's first step.

Why: a step's one-time costs (the packed weights' and FusedDecoder's layer tables, the rotary
table, the kernels' per-thread scratch growing to the largest row count, the allocator's arenas,
oneDNN's primitives where it runs) otherwise land in the first `generate()`: on a 2-core Xeon
the first call of a 64-prompt Llama-3.2-1B-shape run took 1.36-1.48x the same call repeated.
So the constructor runs, through the runner's own `prepare` and `execute`, a prefill-shaped step
of `max_batch_tokens` tokens (at most PREFILL_TOKENS) and a decode-shaped step of `max_num_seqs`
one-token rows (greedy, then with logits). Their K/V slots are -1: nothing is written to the
pool, no block is taken and no scheduler, block-manager or stats state changes. Only the default
CPU runner is warmed (a user's runner, tensor parallelism, stateful layers and GPUs keep their own
warm-up: CUDA graphs are captured in `allocate_cache`).
"""
from __future__ import annotations

import logging
import time

from cb_kernels.engine.config import SamplingParams
from cb_kernels.engine.sequence import Sequence

logger = logging.getLogger("cb_kernels.engine")

# The warm-up prefill's length: the budget's, at most this. What a longer prefill would add is
# the growth of per-step buffers to its rows (a page-fault pass over tens of MB, milliseconds),
# while its compute grows with its length (bench/RESULTS.md, "Cold start": a 2048-token warm-up
# took 14.5 s against 5.6 s at the Llama-3.2-1B shape, 2.4 s against 0.75 s at SmolLM2-135M, bf16
# on 2 Zen 4 cores, and the first generate() was within 3% of the repeated one either way).
PREFILL_TOKENS = 512


def _dummy(i: int, num_tokens: int, first_block: int, block_size: int) -> Sequence:
    """A sequence of `num_tokens` token-0 prompt tokens on blocks first_block, first_block+1, ..."""
    seq = Sequence(-1 - i, f"warmup-{i}", [0] * num_tokens, SamplingParams(max_new_tokens=1))
    seq.block_table = list(range(first_block, first_block + -(-num_tokens // block_size)))
    return seq


def _run(runner, seqs: list, counts: list, greedy_only: bool) -> None:
    inputs = runner.prepare(seqs, counts)
    inputs.attn.slot_mapping.fill_(-1)      # write no K/V (attention reads the pool's zeros)
    runner.execute(inputs, greedy=True)
    if not greedy_only:
        runner.execute(inputs, greedy=False)


def warm_up(runner, num_blocks: int, block_size: int, max_batch_tokens: int,
            max_num_seqs: int) -> float:
    """Run the two warm-up steps on `runner` (a CPU TransformersRunner after allocate_cache);
    returns the seconds taken. A failure is logged and left to the first real step."""
    t0 = time.perf_counter()
    num_slots = num_blocks * block_size
    prefill = min(max_batch_tokens, PREFILL_TOKENS, num_slots, runner.max_positions)
    rows = min(max_num_seqs, num_blocks)
    try:
        if prefill > 1:
            _run(runner, [_dummy(0, prefill, 0, block_size)], [prefill], greedy_only=True)
        _run(runner, [_dummy(1 + i, 1, i, block_size) for i in range(rows)], [1] * rows,
             greedy_only=False)
    except Exception as e:      # noqa: BLE001  (the engine works without it, only slower once)
        logger.warning("warm-up step failed (%s: %s); the first steps pay the one-time costs",
                       type(e).__name__, e)
    seconds = time.perf_counter() - t0
    logger.info("warm-up: a %d-token prefill and a %d-row decode step in %.2f s (one-time "
                "costs paid here, not in the first generate())", prefill, rows, seconds)
    return seconds
