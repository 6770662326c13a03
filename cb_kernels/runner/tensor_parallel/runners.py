"""The runners of a tensor-parallel engine: each rank's own runner (over its shard of the model
and of the KV pool), wrapped so that rank 0's steps reach every rank.

DriverRunner (rank 0): each execute first sends the step (and the copy-on-write pairs of the
copy_blocks before it) down the StepChannel, then runs it locally; the collectives inside the
forward keep the ranks in step. Tokens are picked once: greedy ones by the sharded head's gather
(the same on every rank), sampled ones by rank 0's sampler from the gathered logits.
FollowerRunner (the other ranks): serve() runs rank 0's steps until it ends the session; a step
of the rank's own would break the lockstep, so copy_blocks/execute refuse.

Both read every ModelRunner fact off the local runner (explicitly, one property each).
"""
from __future__ import annotations

from cb_kernels.runner.base import StepOutput
from cb_kernels.runner.step_inputs import StepInputs
from cb_kernels.runner.tensor_parallel.channel import DONE, StepChannel, TensorParallelError


def _of_local(name: str) -> property:
    return property(lambda self: getattr(self.local, name),
                    doc=f"The local runner's {name} (this rank's shard).")


class _RankRunner:
    """The ModelRunner facts of this rank's local runner."""

    num_layers = _of_local("num_layers")
    num_kv_heads = _of_local("num_kv_heads")
    head_dim = _of_local("head_dim")
    max_positions = _of_local("max_positions")
    vocab_size = _of_local("vocab_size")
    dtype = _of_local("dtype")
    device = _of_local("device")
    eos_token_ids = _of_local("eos_token_ids")
    state_bytes_per_seq = _of_local("state_bytes_per_seq")
    k_caches = _of_local("k_caches")
    v_caches = _of_local("v_caches")
    block_size = _of_local("block_size")
    state_tensors = _of_local("state_tensors")
    layout = _of_local("layout")

    def __init__(self, local, channel: StepChannel):
        self.local, self.channel = local, channel

    def allocate_cache(self, num_blocks: int, block_size: int, dtype, max_num_seqs: int) -> None:
        self.local.allocate_cache(num_blocks, block_size, dtype, max_num_seqs)

    def prepare(self, seqs: list, num_new_tokens: list) -> StepInputs:
        return self.local.prepare(seqs, num_new_tokens)

    def refresh_weights(self) -> None:
        self.local.refresh_weights()


class DriverRunner(_RankRunner):
    """Rank 0's runner: the local one, sending each step to the other ranks first."""

    def __init__(self, local, channel: StepChannel):
        super().__init__(local, channel)
        self._copies: list = []

    def copy_blocks(self, pairs: list) -> None:
        self.local.copy_blocks(pairs)
        self._copies = list(pairs)

    def execute(self, inputs: StepInputs, greedy: bool = False) -> StepOutput:
        copies, self._copies = self._copies, []
        self.channel.send_step(inputs, copies, greedy)
        try:
            return self.local.execute(inputs, greedy)
        except TensorParallelError:
            raise
        except Exception as e:            # noqa: BLE001 (the others wait in a collective now)
            self.channel.fail(e)


class FollowerRunner(_RankRunner):
    """The runner of a rank other than 0: its steps come from rank 0 (serve)."""

    def serve(self):
        """Run rank 0's steps until it ends the session; returns what it sent then."""
        while True:
            kind, message = self.channel.receive(self.local.layout)
            if kind == DONE:
                return message
            inputs, greedy, copies = message
            try:
                if copies:
                    self.local.copy_blocks(copies)
                self.local.execute(inputs, greedy)
            except Exception as e:        # noqa: BLE001
                self.channel.fail(e)

    def copy_blocks(self, pairs: list) -> None:
        self.execute(None)

    def execute(self, inputs, greedy: bool = False):
        raise RuntimeError(f"rank {self.channel.rank} of a tensor-parallel engine runs rank 0's "
                           "steps: call generate() or stream() on every rank (or "
                           "engine.follow() while rank 0 steps), not add_request()/step() here")


def make_runner(local, channel: StepChannel):
    """This rank's runner: DriverRunner on rank 0, else FollowerRunner."""
    return (DriverRunner if channel.rank == 0 else FollowerRunner)(local, channel)
