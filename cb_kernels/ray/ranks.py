"""Tensor parallelism inside one Ray replica: the replica's process is rank 0, the other ranks
(followers) are child processes it starts on its machine.

Each follower (`python -m cb_kernels.ray.ranks`, its spec pickled on stdin) loads the model,
says so on stdout, builds the same `Engine(model, EngineConfig(tensor_parallel_size=N))` and
runs rank 0's steps (Engine.follow) until rank 0 ends the session or dies. Rank 0 waits for every
follower's model before it builds its own Engine (the process group's rendezvous), so a model a
follower cannot load fails the replica at start with the follower's reason instead of a
rendezvous timeout. The ranks meet over torch.distributed's environment (MASTER_ADDR/PORT, RANK,
WORLD_SIZE, LOCAL_RANK): gloo on CPU, NCCL on CUDA with one GPU each (cuda:LOCAL_RANK among the
replica's GPUs, which Ray gives the actor and its children through CUDA_VISIBLE_DEVICES).

A follower that dies breaks the ranks' channel: rank 0's next step raises TensorParallelError
(engine/distributed.py) naming the rank and the cause. A follower whose parent (rank 0) dies
exits within a second: it polls its parent's pid, as a blocked collective may not notice.
"""
from __future__ import annotations

import os
import pickle
import select
import subprocess
import sys
import threading
import time


def _environment(rank: int, size: int, port: int) -> dict:
    return dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                WORLD_SIZE=str(size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size))


class Followers:
    """Ranks 1..size-1 of a replica. spec: dict(model, dtype, device, trust_remote_code,
    engine_config, threads), what every rank loads and builds."""

    def __init__(self, size: int, spec: dict):
        from cb_kernels.engine.launcher import free_port

        self.size, self.port = size, free_port()
        self.procs = []
        for rank in range(1, size):
            proc = subprocess.Popen(
                [sys.executable, "-m", "cb_kernels.ray.ranks"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, env={**os.environ, **_environment(rank, size, self.port)})
            proc.stdin.write(pickle.dumps(spec))
            proc.stdin.close()
            self.procs.append(proc)

    def wait_loaded(self, timeout_s: float) -> None:
        """Returns once every follower loaded the model; raises RuntimeError naming the rank and
        its reason when one could not (or said nothing for timeout_s)."""
        end = time.monotonic() + timeout_s
        for rank, proc in enumerate(self.procs, start=1):
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, end - time.monotonic()))
            line = proc.stdout.readline().decode(errors="replace").strip() if ready else ""
            if line != "loaded":
                code = proc.poll()
                self.close()
                reason = line.removeprefix("error: ") or (
                    f"it said nothing in {timeout_s:g} s" if code is None else
                    f"it exited with status {code} (its stderr is in this actor's log)")
                raise RuntimeError(f"tensor parallelism in this replica: rank {rank} of "
                                   f"{self.size} could not load the model: {reason}")

    def join_as_rank0(self) -> None:
        """This process becomes rank 0 (the Engine it builds next makes the process group)."""
        os.environ.update(_environment(0, self.size, self.port))

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _exit_with_parent(parent: int) -> None:
    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="cbk-parent-watch", daemon=True).start()


def _follower_main() -> int:
    parent = os.getppid()
    _exit_with_parent(parent)
    spec = pickle.load(sys.stdin.buffer)
    # stdout is rank 0's line from this rank: keep it for that, send every other print to stderr
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        import torch

        from cb_kernels import Engine
        from cb_kernels.engine.distributed import select_device
        from cb_kernels.models import fast_dtype, load

        torch.set_num_threads(spec["threads"])
        device = select_device(torch.device(spec["device"]))     # before the model moves
        model, _ = load(spec["model"], dtype=spec["dtype"],
                        trust_remote_code=spec["trust_remote_code"])
        if spec["dtype"] is None:
            model = model.to(fast_dtype(model.dtype, device)[0])
    except Exception as e:                   # noqa: BLE001 (rank 0 raises it, named)
        out.write(f"error: {type(e).__name__}: {e}".replace("\n", " ") + "\n")
        out.flush()
        return 1
    out.write("loaded\n")
    out.flush()
    engine = Engine(model.to(device), spec["engine_config"])
    engine.follow()
    return 0


if __name__ == "__main__":
    sys.exit(_follower_main())
