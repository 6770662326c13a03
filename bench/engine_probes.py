"""Engine probes of bench/bench_engine.py that need no contenders: the scheduler's time per
step with many running requests, and the time to first token of a fresh process."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import torch


def scheduler_step_ms(num_running: int = 256, steps: int = 200) -> dict:
    """Time of schedule() + postprocess bookkeeping + input packing with `num_running` decoding
    requests of ~300 tokens (blocks of 16), no model."""
    from cb_kernels.engine.block_manager import BlockManager
    from cb_kernels.engine.config import SamplingParams
    from cb_kernels.engine.scheduler import Scheduler
    from cb_kernels.engine.sequence import Sequence
    from cb_kernels.runner.step_inputs import LayerLayout, pack

    bm = BlockManager(num_running * 40, 16)
    sched = Scheduler(bm, max_batch_tokens=512, max_num_seqs=num_running)
    rng = random.Random(0)
    for i in range(num_running):
        sched.add(Sequence(i, f"r{i}", [rng.randrange(32000) for _ in range(rng.randint(200, 400))],
                           SamplingParams(max_new_tokens=10_000)))
    while any(not s.is_decoding for s in sched.running) or sched.waiting:
        batch = sched.schedule()
        for s, n in zip(batch.seqs, batch.num_new_tokens):
            s.num_computed_tokens += n
            if s.num_computed_tokens == s.num_tokens:
                s.token_ids.append(1)
    cpu, num_slots = torch.device("cpu"), bm.num_blocks * 16
    t_sched = t_pack = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = sched.schedule()
        t1 = time.perf_counter()
        pack(batch.seqs, batch.num_new_tokens, 16, num_slots, cpu, LayerLayout([], [], []))
        t2 = time.perf_counter()
        for s in batch.seqs:
            s.num_computed_tokens += 1
            s.token_ids.append(1)
        t_sched += t1 - t0
        t_pack += t2 - t1
    assert len(batch.seqs) == num_running
    return {"schedule_ms": 1e3 * t_sched / steps, "pack_inputs_ms": 1e3 * t_pack / steps}


COLD = """
import json, time
t0 = time.perf_counter()
import torch, transformers
from cb_kernels import Engine, EngineConfig, SamplingParams
import bench_engine as b
t1 = time.perf_counter()
model = b.build_model()
t2 = time.perf_counter()
engine = Engine(model, EngineConfig())
rid = engine.add_request(list(range(1, 129)), SamplingParams(max_new_tokens=2))
t3 = time.perf_counter()
while not engine.sequence(rid).output_token_ids:
    engine.step()
t4 = time.perf_counter()
print(json.dumps({"imports_s": t1 - t0, "model_build_s": t2 - t1, "engine_init_s": t3 - t2,
                  "first_step_s": t4 - t3, "ttft_in_process_s": t4 - t0}))
"""


def cold_start_ttft() -> dict:
    """A fresh interpreter to the first token of a 128-token prompt: imports, random model
    construction (transformers' weight init, not ours), Engine() with auto sizing (allocates the
    KV pool), and the first step (one-time kernel and allocator warm-up included)."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.path.dirname(here),
                                                       os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", COLD], capture_output=True, text=True, env=env,
                         check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["wall_s"] = time.perf_counter() - t0
    return res
