"""The runners of a tensor-parallel model: each rank's own runner (over its shard of the model
and of the KV pool), wrapped so that rank 0's steps reach every rank. Both satisfy
runner/base.TensorParallelRunner and are passed as `Engine(model, config, runner=...)` on their
rank (engine/distributed.build_runner builds the right one on each).

DriverRunner (rank 0): each execute first sends the step (and the copy-on-write pairs of the
copy_blocks before it) down the StepChannel, then runs it locally; the collectives inside the
forward keep the ranks in step. Tokens are picked once: greedy ones by the sharded head's gather
(the same on every rank), sampled ones by rank 0's sampler from the gathered logits. release()
ends a session: the followers' serve() returns what it sends.
FollowerRunner (the other ranks): serve() runs rank 0's steps until rank 0 ends the session; a
step of the rank's own would break the lockstep, so copy_blocks/execute refuse.

Both read every ModelRunner fact off the local runner (explicitly, one property each);
release_memory / restore_memory / refresh_weights act on this rank's shard alone. The engine's RL
calls reach every rank as CONTROL messages: rank 0's engine sends them (send_control), a
follower's serve() hands each to `on_control(op, args)` (set by the engine: it runs the same
call on this rank) and, before each step, hands rank 0's weight_version to `before_step`.
"""
from __future__ import annotations

from typing import Optional

from cb_kernels.runner.base import StepOutput
from cb_kernels.runner.step_inputs import StepInputs
from cb_kernels.runner.tensor_parallel.channel import (CONTROL, DONE, StepChannel,
                                                        TensorParallelError)

# The CONTROL op by which rank 0 says it refused a call (args: op, error type name, message):
# a follower waiting in that call raises the same error; one serving steps ignores it.
REFUSED = "refused"
_ERRORS = {e.__name__: e for e in (ValueError, TypeError, RuntimeError, NotImplementedError,
                                   KeyError)}


def _of_local(name: str) -> property:
    return property(lambda self: getattr(self.local, name),
                    doc=f"The local runner's {name} (this rank's shard).")


class _RankRunner:
    """The ModelRunner facts of this rank's local runner; the channel to the other ranks."""

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
        if not isinstance(channel, StepChannel):
            raise TypeError(f"channel must be a StepChannel, got {type(channel).__name__}")
        drives = channel.rank == 0
        if drives != isinstance(self, DriverRunner):
            want = "DriverRunner" if drives else "FollowerRunner"
            raise ValueError(f"a {type(self).__name__} on rank {channel.rank} of "
                             f"{channel.size}: rank 0 drives (DriverRunner), the others follow "
                             f"(FollowerRunner); this rank needs a {want} (make_runner picks it)")
        self.local, self.channel = local, channel
        self.on_control = None     # (op, args) -> result: the engine's call, run on this rank
        self.before_step = None    # (weight_version) -> None: the engine's weight check
        self.weight_version = 0    # rank 0's engine's (sent with every step)

    @property
    def rank(self) -> int:
        """This rank in [0, world_size); 0 drives."""
        return self.channel.rank

    @property
    def world_size(self) -> int:
        """The ranks the model is split over (EngineConfig.tensor_parallel_size)."""
        return self.channel.size

    def allocate_cache(self, num_blocks: int, block_size: int, dtype, max_num_seqs: int) -> None:
        self.local.allocate_cache(num_blocks, block_size, dtype, max_num_seqs)

    def prepare(self, seqs: list, num_new_tokens: list) -> StepInputs:
        return self.local.prepare(seqs, num_new_tokens)

    def refresh_weights(self) -> None:
        self.local.refresh_weights()

    def reserve_workspace(self, num_tokens: int, num_seqs: int) -> int:
        return self.local.reserve_workspace(num_tokens, num_seqs)

    def release_memory(self, kv: bool, weights: bool) -> int:
        """This rank's pool and weight copies (the engine sends the call to the others)."""
        return self.local.release_memory(kv, weights)

    def restore_memory(self, kv: bool, weights: bool) -> None:
        self.local.restore_memory(kv, weights)


class DriverRunner(_RankRunner):
    """Rank 0's runner: the local one, sending each step to the other ranks first."""

    def __init__(self, local, channel: StepChannel):
        super().__init__(local, channel)
        self._copies: list = []

    def send_control(self, op: str, args: dict) -> None:
        """Send one of the engine's calls to the other ranks (their serve() runs it)."""
        self.channel.send_control(op, args)

    def copy_blocks(self, pairs: list) -> None:
        self.local.copy_blocks(pairs)
        self._copies = list(pairs)

    def execute(self, inputs: StepInputs, greedy: bool = False) -> StepOutput:
        copies, self._copies = self._copies, []
        self.channel.send_step(inputs, copies, greedy, self.weight_version)
        try:
            return self.local.execute(inputs, greedy)
        except TensorParallelError:
            raise
        except Exception as e:            # noqa: BLE001 (the others wait in a collective now)
            self.channel.fail(e)

    def release(self, outputs=None, error: Optional[str] = None) -> None:
        """End the session: the other ranks' serve() returns `outputs` (or raises
        TensorParallelError(error) when `error` is given). Raises TensorParallelError when the
        ranks fell out of step during the session (then nothing is sent) and no `error` is
        given (one already propagates)."""
        self.channel.release(outputs, error)
        if error is None and self.channel.broken is not None:
            raise TensorParallelError(self.channel.broken)

    def serve(self):
        raise RuntimeError("serve() runs on the ranks other than 0; rank 0 drives (its engine "
                           "steps, then release() ends the session)")


class FollowerRunner(_RankRunner):
    """The runner of a rank other than 0: its steps come from rank 0 (serve)."""

    def serve(self, until: Optional[str] = None):
        """Run rank 0's steps and calls until it ends the session; returns what it sent then
        (rank 0's release(outputs)). `until`: return once rank 0's call of that name ran here,
        with its result (a follower's own sleep(), update_weights(), ...); rank 0 refusing it
        raises its error here. Raises TensorParallelError when rank 0 failed or the ranks fell
        out of step."""
        while True:
            kind, message = self.channel.receive(self.local.layout)
            if kind == DONE:
                if until is not None:
                    raise TensorParallelError(
                        f"rank 0 ended its session while rank {self.rank} waited in {until}(): "
                        "call the same methods in the same order on every rank")
                return message
            if kind == CONTROL:
                op, args = message
                if op == REFUSED:
                    if args["op"] == until:
                        raise _ERRORS.get(args["type"], RuntimeError)(args["message"])
                    continue
                result = self._run_control(op, args)
                if op == until:
                    return result
                continue
            inputs, greedy, copies, version = message
            try:
                if self.before_step is not None:
                    self.before_step(version)
                if copies:
                    self.local.copy_blocks(copies)
                self.local.execute(inputs, greedy)
            except Exception as e:        # noqa: BLE001
                self.channel.fail(e)

    def _run_control(self, op: str, args: dict):
        if self.on_control is None:
            self.channel.fail(RuntimeError(f"rank 0 sent {op}(), and rank {self.rank}'s runner "
                                           "serves no engine (Engine(model, config, "
                                           "runner=runner) on every rank)"))
        try:
            return self.on_control(op, args)
        except TensorParallelError:
            raise
        except Exception as e:            # noqa: BLE001 (rank 0 waits in a collective now)
            self.channel.fail(e)

    def send_control(self, op: str, args: dict) -> None:
        raise RuntimeError(f"rank {self.rank} runs rank 0's {op}(); rank 0 sends it")

    def release(self, outputs=None, error: Optional[str] = None) -> None:
        raise RuntimeError(f"release() ends rank 0's session; rank {self.rank} follows it "
                           "(serve() returns when rank 0 releases)")

    def copy_blocks(self, pairs: list) -> None:
        self.execute(None)

    def execute(self, inputs, greedy: bool = False):
        raise RuntimeError(f"rank {self.rank} of a tensor-parallel engine runs rank 0's "
                           "steps: call generate() or stream() on every rank (or "
                           "engine.follow() while rank 0 steps), not add_request()/step() here")


def make_runner(local, channel: StepChannel):
    """This rank's runner around its local one: DriverRunner on rank 0, else FollowerRunner."""
    return (DriverRunner if channel.rank == 0 else FollowerRunner)(local, channel)
