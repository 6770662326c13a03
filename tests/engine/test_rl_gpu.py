"""Issue 27's colocated-training check: the engine sleeps, the trainer takes an AdamW step on the
same model, the engine wakes up and its greedy tokens equal `model.generate`'s with the stepped
weights. On CUDA (bench/gpu_check.sh's correctness stage runs it) the allocated memory
(`torch.cuda.memory_allocated`) must drop by at least 90% of the KV pool's bytes; its CPU twin
runs the same sequence in CI and measures the drop as the process's resident memory (the CPU
pool is an anonymous mapping: its pages are written first, so they count, and are unmapped when
nothing holds the pool any more)."""
import psutil
import pytest
import torch

from cb_kernels import Engine, EngineConfig, SamplingParams
from tests.helpers import make_model, random_prompts

pytestmark = pytest.mark.one_thread

PROMPTS = random_prompts([7, 19, 4, 12], seed=27)
NEW = 8
# 2 layers x K and V of [2048, 16, 2, 64] fp32: 16 MiB a tensor, 64 MiB in all, far above the
# noise of either measure.
NUM_BLOCKS = 2048


def pool_bytes(engine) -> int:
    r = engine.runner
    return sum(t.numel() * t.element_size() for t in r.k_caches + r.v_caches)


@torch.inference_mode()
def generate_reference(model, prompts, n):
    """Greedy tokens of transformers' generate, one prompt at a time, on the model's device."""
    device = next(model.parameters()).device
    out = []
    for p in prompts:
        ids = model.generate(torch.tensor([p], device=device), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False)
        out.append(ids[0, len(p):].tolist())
    return out


def sleep_train_wake(device: str, allocated, touch_pool: bool) -> dict:
    """The sequence both tests run; returns what they assert on."""
    model = make_model(seed=27, hidden_size=128, intermediate_size=256, head_dim=64).to(device)
    engine = Engine(model, EngineConfig(block_size=16, num_blocks=NUM_BLOCKS,
                                        max_batch_tokens=128, cpu_offload_gib=0))
    greedy = SamplingParams(max_new_tokens=NEW)
    assert [o.token_ids for o in engine.generate(PROMPTS, greedy)] == \
        generate_reference(model, PROMPTS, NEW)
    pool = pool_bytes(engine)
    if touch_pool:                  # every page written, as a long run leaves the pool
        for t in engine.runner.k_caches + engine.runner.v_caches:
            t.fill_(1.0)
    before = allocated()
    freed = engine.sleep(level=1)
    dropped = before - allocated()

    # The trainer's turn, the engine asleep: one AdamW step on the same model.
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([PROMPTS[0] + PROMPTS[1]], device=device)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    moved = sum(not torch.equal(p, weights[n]) for n, p in model.named_parameters())

    engine.wake_up()
    tokens = [o.token_ids for o in engine.generate(PROMPTS, greedy)]
    engine.check_invariants()
    result = {"pool": pool, "freed": freed, "dropped": dropped, "moved": moved,
              "num_params": len(weights), "tokens": tokens,
              "reference": generate_reference(model, PROMPTS, NEW),
              "pool_after": pool_bytes(engine), "sleeping": engine.is_sleeping}
    # The pool wake_up() allocated is freed by the next sleep() as well.
    if touch_pool:
        for t in engine.runner.k_caches + engine.runner.v_caches:
            t.fill_(1.0)
    before = allocated()
    engine.sleep(level=1)
    result["dropped_again"] = before - allocated()
    return result


def check(r: dict) -> None:
    assert r["pool"] >= 64 << 20 and r["freed"] == r["pool"], r
    for key in ("dropped", "dropped_again"):
        assert r[key] >= 0.9 * r["pool"], \
            f"sleep() freed {r[key]} bytes of a {r['pool']}-byte pool (< 90%, {key})"
    assert r["moved"] == r["num_params"], r["moved"]        # AdamW moved every weight
    assert not r["sleeping"] and r["pool_after"] == r["pool"]
    assert r["tokens"] == r["reference"]                    # the stepped weights, exactly


@pytest.mark.gpu
def test_sleep_frees_the_pool_adamw_step_wake_up_exact_gpu():
    def allocated():
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    check(sleep_train_wake("cuda", allocated, touch_pool=False))


def test_sleep_frees_the_pool_adamw_step_wake_up_exact_cpu_twin():
    check(sleep_train_wake("cpu", lambda: psutil.Process().memory_info().rss, touch_pool=True))
