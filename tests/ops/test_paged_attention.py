"""paged_attention: every backend against ops/reference.py on an explicit case list, the
reference against SDPA, batch/thread independence, the registered op, and every bad input."""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F

from cb_kernels import ops
from cb_kernels.ops.paged_attention import _run_cpu, check_args
from cb_kernels.ops.reference import ref_paged_attention
from paged_attention_cases import CASES, Case, build, kwargs, tolerance

# "cpu" is the CPU kernel's best body here (avx512_bf16 for bf16 with AVX512-BF16, else avx2);
# "cpu-avx2" and "cpu-portable" force the lower bodies this CPU runs.
BACKENDS = ["cpu", "cpu-avx2", "cpu-portable", "triton", "cuda"]
CUDA_HEAD_DIMS = (64, 80, 96, 128, 256)  # the compiled CUDA kernel's head dims
BY_ID = {c.id: c for c in CASES}


@functools.lru_cache(maxsize=None)
def reference(case: Case) -> torch.Tensor:
    return ref_paged_attention(*build(case), **kwargs(case))


def run(backend: str, case: Case, device: str = "cpu") -> torch.Tensor:
    args = build(case, device=device)
    if not backend.startswith("cpu-"):
        return ops.paged_attention(*args, **kwargs(case), backend=backend)
    out = torch.empty_like(args[0])
    scale, window, cap = check_args(*args, case.scale, case.sliding_window, case.softcap, None)
    _run_cpu(*args, out, scale, window, cap, isa=backend[4:])
    return out


def require(backend: str) -> str:
    """Device for the backend, or skip with the reason it cannot run here."""
    from cb_kernels import _C

    if backend.startswith("cpu-") and backend[4:] not in _C.cpu_isas():
        pytest.fail(f"{backend}: this CPU runs only {_C.cpu_isas()}; the CI machines run avx2")
    name = "cpu" if backend.startswith("cpu-") else backend
    if name not in ops.available_backends():
        pytest.skip(f"backend {name!r} is not available here ({ops.available_backends()})")
    return "cuda" if name == "cuda" or (name == "triton" and torch.cuda.is_available()) else "cpu"


# Under the Triton interpreter (no GPU) only the cases marked interpreter=True run: the first 17
# cases took 20 s of CPU (49 s wall on the shared 2-core box), the subset ~8 s. On a GPU each
# case is a cold compile of its own (~1 s each), so the GPU runs the same subset plus head_dims
# 32 and 128 with block sizes 32 and 128: every variant of the kernels (fp32/fp16/bf16; decode,
# prefill and all-decode launches; the split decode and its merge; window, softcap, both; odd
# head_dim; both KV layouts; qlen 0), and test_paged_attention_triton.GPU_CASES adds d80/d96/
# d256 decodes. The CUDA backend runs every case.
# GPU runs carry the gpu mark, so bench/gpu_check.sh (`pytest -m gpu`) selects them.
GPU = torch.cuda.is_available()
TRITON_GPU_EXTRA = {"d32-fp16-window-softcap", "bf16-gqa8-d128-bs32", "fp16-d128-bs128"}


def gpu_marks(backend: str) -> list:
    return [pytest.mark.gpu] if backend == "cuda" or (backend == "triton" and GPU) else []


MATRIX = [pytest.param(b, c, id=f"{b}-{c.id}", marks=gpu_marks(b)) for b in BACKENDS
          for c in CASES if b != "triton" or c.interpreter or (GPU and c.id in TRITON_GPU_EXTRA)]


@pytest.mark.parametrize("backend,case", MATRIX)
def test_matches_reference(backend, case):
    device = require(backend)
    if backend == "cuda" and case.head_dim not in CUDA_HEAD_DIMS:
        with pytest.raises(ValueError, match="head_dim"):
            run(backend, case, device)
        return
    out = run(backend, case, device).cpu()
    expected = reference(case)
    assert out.dtype == case.dtype and out.shape == expected.shape
    assert not out.isnan().any(), "NaN in the output: an unused cache slot was read"
    torch.testing.assert_close(out, expected, **case.tolerance)


def sdpa_oracle(case: Case) -> torch.Tensor:
    """Independent of the reference's code: gather, then SDPA with an explicit boolean mask."""
    q, k_cache, v_cache, block_tables, seq_lens, cu = build(case)
    group = case.num_heads // case.num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32)
    for i, (seq_len, q_len) in enumerate(zip(case.seq_lens, case.q_lens)):
        if q_len == 0:
            continue
        ids = block_tables[i, :math.ceil(seq_len / case.block_size)].long()
        k, v = (c[ids].flatten(0, 1)[:seq_len].float().repeat_interleave(group, 1).transpose(0, 1)
                for c in (k_cache, v_cache))
        pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        key = torch.arange(seq_len)[None, :]
        mask = (key <= pos) & (key > pos - (case.sliding_window or seq_len + 1))
        qi = q[cu[i]:cu[i + 1]].float().transpose(0, 1)
        out[cu[i]:cu[i + 1]] = F.scaled_dot_product_attention(
            qi, k, v, attn_mask=mask, scale=case.scale).transpose(0, 1)
    return out


@pytest.mark.parametrize("case", [c for c in CASES if c.softcap is None], ids=lambda c: c.id)
def test_reference_matches_sdpa(case):
    expected = sdpa_oracle(case)
    out = ops.paged_attention(*build(case), **kwargs(case), backend="torch")
    torch.testing.assert_close(out.float(), expected, **case.tolerance)


def test_reference_softcap_by_hand():
    q = torch.tensor([[[3.0, 0.0]]])
    k = torch.tensor([[1.0, 0.0], [-1.0, 0.0]]).view(1, 2, 1, 2)
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 2, 1, 2)
    one = torch.tensor([[0]], dtype=torch.int32)
    out = ref_paged_attention(q, k, v, one, torch.tensor([2], dtype=torch.int32),
                              torch.tensor([0, 1], dtype=torch.int32), scale=1.0, softcap=2.0)
    s = 2.0 * math.tanh(3.0 / 2.0)  # scores +s and -s
    p = 1.0 / (1.0 + math.exp(-2 * s))
    torch.testing.assert_close(out, torch.tensor([[[p, 1 - p]]]))


# The second case makes the CPU kernel group kv heads into work items differently alone, in the
# batch, and on 1 or 2 threads (64 q heads over 8 kv heads, ~40k row-key pairs).
@pytest.mark.parametrize("case", [BY_ID["mixed-gqa4-d64-bs16"],
                                  Case("decode-64q-8kv", seq_lens=(600, 37, 300), q_lens=(1, 1, 5),
                                       num_heads=64, num_kv_heads=8),
                                  Case("d32-32q-8kv", seq_lens=(1100, 37, 600, 300),
                                       q_lens=(1, 1, 5, 300), num_heads=32, num_kv_heads=8,
                                       head_dim=32),
                                  Case("bf16-decode-64q-8kv", seq_lens=(600, 37, 300),
                                       q_lens=(1, 1, 5), num_heads=64, num_kv_heads=8,
                                       dtype=torch.bfloat16),
                                  Case("bf16-d32-32q-8kv", seq_lens=(1100, 37, 600, 300),
                                       q_lens=(1, 1, 5, 300), num_heads=32, num_kv_heads=8,
                                       head_dim=32, dtype=torch.bfloat16),
                                  # the 16-lane decode tiles (group 4 and 3) and the rows-in-lanes
                                  # prefill blocks (16 rows, a last partial one)
                                  Case("bf16-gqa4-decode-tiles", seq_lens=(150, 37, 300, 129),
                                       q_lens=(1, 1, 40, 1), num_heads=32, num_kv_heads=8,
                                       dtype=torch.bfloat16),
                                  Case("bf16-gqa3-prefill-blocks", seq_lens=(128, 200, 33, 700),
                                       q_lens=(128, 1, 20, 1), num_heads=9, num_kv_heads=3,
                                       dtype=torch.bfloat16)],
                         ids=lambda c: c.id)
def test_cpu_batch_and_threads_do_not_change_results(case):
    """A sequence's output is bit-identical alone, inside a batch, and on 1 or 2 threads."""
    q, k_cache, v_cache, block_tables, seq_lens, cu = build(case)
    full = ops.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu, backend="cpu")
    for i in range(len(case.seq_lens)):
        lo, hi = int(cu[i]), int(cu[i + 1])
        cu_one = torch.tensor([0, hi - lo], dtype=torch.int32)
        alone = ops.paged_attention(q[lo:hi], k_cache, v_cache, block_tables[i:i + 1],
                                    seq_lens[i:i + 1], cu_one)
        assert torch.equal(alone, full[lo:hi]), f"sequence {i} changed with its batch"
    for n in (1, 2):      # conftest restores the thread count
        torch.set_num_threads(n)
        again = ops.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu)
        assert torch.equal(again, full), f"{n} threads changed the result"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group, head_dim", [(4, 64), (3, 64), (2, 64), (1, 64), (4, 32),
                                             (4, 128), (8, 64)])
def test_a_row_gets_the_same_bits_in_a_decode_and_in_a_chunk(dtype, group, head_dim):
    """A query token's output does not depend on how many tokens of its sequence share its q
    chunk: decode rows (one token x the group: up to 4 rows a kv head take the bf16 kernel's
    keys-in-lanes scores) give the bits the same token gets inside a 5-token chunk."""
    case = Case(f"chunk-{group}-{head_dim}", seq_lens=(300,), q_lens=(5,), num_heads=2 * group,
                num_kv_heads=2, head_dim=head_dim, dtype=dtype)
    q, k_cache, v_cache, block_tables, seq_lens, cu = build(case)
    chunk = ops.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu, backend="cpu")
    for i in (0, 4):       # the chunk's first and last token, each decoded alone
        one = ops.paged_attention(q[i:i + 1].clone(), k_cache, v_cache, block_tables,
                                  i32(296 + i), i32(0, 1), backend="cpu")
        assert torch.equal(one[0], chunk[i]), f"token {i} changed with its chunk"


@pytest.mark.parametrize("backend", ["cpu", "cpu-avx2", "cpu-portable"])
@pytest.mark.parametrize("q_len", [1, 4], ids=["decode", "prefill"])
def test_bf16_output_rounds_fp32_denormals_and_nans_like_float_to_bf16(backend, q_len):
    """A bf16 output row that is an fp32 denormal keeps its value (vcvtneps2bf16, which the
    avx512_bf16 body rounds with, would flush it to zero: such vectors take float_to_bf16), and a
    NaN V row gives NaN outputs, on every body, in decode and prefill items alike. q = 0 makes
    every probability 1, so the last token's output is the mean of V over 4 positions whose
    partial sums all stay normal: (2^-124 - 2^-125 + 2^-126 - 2^-126) / 4 = 2^-127."""
    require(backend)
    case = Case(f"denormal-{q_len}", seq_lens=(4,), q_lens=(q_len,), num_heads=6,
                num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    q, k_cache, v_cache, block_tables, seq_lens, cu = build(case)
    q.zero_()
    block = int(block_tables[0, 0])
    for pos, value in enumerate((2.0 ** -124, -2.0 ** -125, 2.0 ** -126, -2.0 ** -126)):
        v_cache[block, pos] = value

    def attend():
        if backend == "cpu":
            return ops.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu,
                                       backend="cpu")
        out = torch.empty_like(q)
        scale, window, cap = check_args(q, k_cache, v_cache, block_tables, seq_lens, cu,
                                        None, None, None, None)
        _run_cpu(q, k_cache, v_cache, block_tables, seq_lens, cu, out, scale, window, cap,
                 isa=backend[4:])
        return out

    out = attend()
    assert torch.equal(out[-1], torch.full_like(out[-1], 2.0 ** -127)), "denormal output lost"
    v_cache[block, 2, 1] = float("nan")        # position 2, kv head 1: its 3 query heads
    out = attend()
    assert out[-1, 3:].isnan().all() and not out[-1, :3].isnan().any()


def test_bf16_body_choice_follows_the_cpu_and_head_dim():
    """bf16 K/V with head_dim % 32 == 0 run the vdpbf16ps body exactly where the CPU has
    AVX512-BF16; other head dims, and forced lower bodies, run the fp32-math bodies."""
    from cb_kernels import _C

    has = "avx512_bf16" in _C.cpu_isas()
    assert _C.paged_attention_bf16_isa(64) == ("avx512_bf16" if has else _C.cpu_isa())
    assert _C.paged_attention_bf16_isa(128) == _C.paged_attention_bf16_isa(64)
    assert _C.paged_attention_bf16_isa(80) == _C.cpu_isa()
    if has:      # the two bodies really differ: P.V rounds P to bf16 in one of them
        case = BY_ID["bf16-partition-edges"]
        assert not torch.equal(run("cpu", case), run("cpu-avx2", case))


@pytest.mark.parametrize("backend", [pytest.param(b, marks=gpu_marks(b))
                                     for b in ("cpu", "triton", "cuda")])
def test_pool_beyond_int32_offsets(backend):
    """Blocks past 2**31 elements into the cache (140k blocks of 16k elements, fp16): every
    address must be computed in 64 bits. The pool is 4.6 GB of untouched virtual memory."""
    device = require(backend)
    bs, hkv, dim, num_blocks = 16, 8, 128, 140_000
    k_cache = torch.empty(num_blocks, bs, hkv, dim, dtype=torch.float16, device=device)
    v_cache = torch.empty_like(k_cache)
    ids = torch.tensor([num_blocks - 1, 2**31 // (bs * hkv * dim) + 7, 3], dtype=torch.int32)
    g = torch.Generator().manual_seed(0)
    for t in (k_cache, v_cache):
        t[ids.long().to(device)] = torch.randn(3, bs, hkv, dim, generator=g).half().to(device)
    q = torch.randn(2, 16, dim, generator=g).half().to(device)
    args = (ids.view(1, 3).repeat(2, 1).to(device), torch.tensor([40, 33], dtype=torch.int32),
            torch.tensor([0, 1, 2], dtype=torch.int32))
    args = tuple(t.to(device) for t in args)
    out = ops.paged_attention(q, k_cache, v_cache, *args, backend=backend).cpu()
    small_k = k_cache[ids.long().to(device)].cpu()
    small_v = v_cache[ids.long().to(device)].cpu()
    small = torch.tensor([[0, 1, 2], [0, 1, 2]], dtype=torch.int32)
    expected = ref_paged_attention(q.cpu(), small_k, small_v, small, *(t.cpu() for t in args[1:]))
    torch.testing.assert_close(out, expected, **tolerance(torch.float16))


def test_out_is_written_and_returned():
    case = BY_ID["mixed-gqa4-d64-bs16"]
    args = build(case)
    out = torch.full_like(args[0], float("nan"))
    assert ops.paged_attention(*args, out=out) is out
    torch.testing.assert_close(out, reference(case), **case.tolerance)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_registered_op_opcheck(backend):
    case = BY_ID["d60-odd-dim"]
    q, k_cache, v_cache, block_tables, seq_lens, cu = build(case)
    out = torch.empty_like(q)
    torch.library.opcheck(torch.ops.cb_kernels.paged_attention.default,
                          (q, k_cache, v_cache, block_tables, seq_lens, cu, out, 0.125, 0, 0.0,
                           backend))
    torch.ops.cb_kernels.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, cu, out,
                                         case.head_dim ** -0.5, 0, 0.0, backend)
    torch.testing.assert_close(out, reference(case), **case.tolerance)


def _valid():
    """A small valid call: 2 sequences (len 9 with 1 q token, len 2 with 2), 4 blocks of 8."""
    return dict(q=torch.zeros(3, 4, 16), k_cache=torch.zeros(4, 8, 2, 16),
                v_cache=torch.zeros(4, 8, 2, 16),
                block_tables=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                seq_lens=torch.tensor([9, 2], dtype=torch.int32),
                cu_seqlens_q=torch.tensor([0, 1, 3], dtype=torch.int32))


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


BAD_INPUTS = [  # (id, changes to the valid call, exception, words the message must contain)
    ("q-not-tensor", dict(q=[[0.0]]), TypeError, "q must be a torch.Tensor"),
    ("q-int-dtype", dict(q=torch.zeros(3, 4, 16, dtype=torch.int32)), TypeError, "q must be"),
    ("q-2d", dict(q=torch.zeros(3, 64)), ValueError, "q must have 3 dimensions"),
    ("q-last-stride", dict(q=torch.zeros(3, 16, 4).transpose(1, 2)), ValueError,
     "q must have unit"),
    ("k-dtype", dict(k_cache=torch.zeros(4, 8, 2, 16, dtype=torch.float16)), TypeError, "k_cache"),
    ("v-dtype", dict(v_cache=torch.zeros(4, 8, 2, 16, dtype=torch.bfloat16)), TypeError, "v_cache"),
    ("v-shape", dict(v_cache=torch.zeros(5, 8, 2, 16)), ValueError, "v_cache shape"),
    ("k-3d", dict(k_cache=torch.zeros(4, 8, 32)), ValueError, "k_cache must have 4"),
    ("head-dim", dict(k_cache=torch.zeros(4, 8, 2, 8), v_cache=torch.zeros(4, 8, 2, 8)),
     ValueError, "head_dim"),
    ("gqa-ratio", dict(q=torch.zeros(3, 3, 16)), ValueError, "multiple of k_cache num_kv_heads"),
    ("k-device", dict(k_cache=torch.zeros(4, 8, 2, 16, device="meta")), ValueError,
     "k_cache is on"),
    ("block-tables-int64", dict(block_tables=torch.zeros(2, 2, dtype=torch.int64)), TypeError,
     "block_tables must have dtype torch.int32"),
    ("seq-lens-int64", dict(seq_lens=torch.tensor([9, 2])), TypeError, "seq_lens must have dtype"),
    ("cu-int64", dict(cu_seqlens_q=torch.tensor([0, 1, 3])), TypeError, "cu_seqlens_q must have"),
    ("seq-lens-count", dict(seq_lens=i32(9, 2, 2)), ValueError, "seq_lens has 3 entries"),
    ("cu-count", dict(cu_seqlens_q=i32(0, 3)), ValueError, "cu_seqlens_q must have num_seqs + 1"),
    ("cu-end", dict(cu_seqlens_q=i32(0, 1, 2)), ValueError, "cu_seqlens_q must start at 0 and end"),
    ("cu-decreasing", dict(q=torch.zeros(1, 4, 16), cu_seqlens_q=i32(0, 2, 1)), ValueError,
     "cu_seqlens_q must be non-decreasing"),
    ("block-id-high", dict(block_tables=i32(0, 1, 4, 3).view(2, 2)), ValueError,
     "block_tables[1, 0]=4 is outside the pool of 4 blocks"),
    ("block-id-negative", dict(block_tables=i32(0, -1, 2, 3).view(2, 2)), ValueError,
     "block_tables[0, 1]=-1"),
    ("seq-len-past-table", dict(seq_lens=i32(17, 2)), ValueError,
     "seq_lens[0]=17 needs 3 blocks of 8 but block_tables has only 2 columns"),
    ("seq-len-negative", dict(q=torch.zeros(1, 4, 16), seq_lens=i32(9, -1),
                              cu_seqlens_q=i32(0, 1, 1)), ValueError, "seq_lens[1]=-1"),
    ("q-tokens-past-seq-len", dict(seq_lens=i32(9, 1)), ValueError,
     "sequence 1 has 2 q tokens (cu_seqlens_q) but seq_lens[1]=1"),
    ("out-shape", dict(out=torch.zeros(3, 4, 8)), ValueError, "out shape"),
    ("out-dtype", dict(out=torch.zeros(3, 4, 16, dtype=torch.float16)), TypeError, "out must have"),
    ("scale-nan", dict(scale=float("nan")), TypeError, "scale must be a finite number"),
    ("scale-bool", dict(scale=True), TypeError, "scale"),
    ("window-zero", dict(sliding_window=0), ValueError, "sliding_window must be in"),
    ("window-float", dict(sliding_window=4.0), TypeError, "sliding_window must be an int"),
    ("softcap-negative", dict(softcap=-1.0), ValueError, "softcap must be a positive"),
    ("softcap-str", dict(softcap="30"), TypeError, "softcap"),
    ("backend-unknown", dict(backend="gpu"), ValueError, "backend must be one of"),
]


@pytest.mark.parametrize("change,error,words", [b[1:] for b in BAD_INPUTS],
                         ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_raises_naming_it(change, error, words):
    args = {**_valid(), **change}
    with pytest.raises(error) as info:
        ops.paged_attention(**args)
    assert words in str(info.value)


def test_valid_call_of_bad_input_table_runs():
    out = ops.paged_attention(**_valid())
    assert out.shape == (3, 4, 16) and not out.isnan().any()


def test_traces_under_torch_compile():
    """fullgraph: the wrapper's checks run on fake tensors and the registered op is traced."""
    case = BY_ID["d60-odd-dim"]
    args = build(case)
    compiled = torch.compile(lambda *a: ops.paged_attention(*a, backend="cpu"),
                             backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*args), reference(case), **case.tolerance)


def test_unchecked_hot_path_matches_checked():
    from cb_kernels.ops.paged_attention import paged_attention_unchecked

    case = BY_ID["window-50"]
    args = build(case)
    out = torch.empty_like(args[0])
    got = paged_attention_unchecked(*args, out, scale=case.head_dim ** -0.5,
                                    sliding_window=case.sliding_window, backend="cpu")
    assert got is out
    assert torch.equal(out, ops.paged_attention(*args, **kwargs(case)))


def _real_shape_inputs(num_seqs, context, num_heads, num_kv_heads, head_dim, block_size, dtype,
                       seed=0):
    """Decode inputs at model scale, built on the GPU in a few large ops (the case builder fills
    blocks one at a time): contiguous caches, block tables a random permutation of the blocks."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = math.ceil(context / block_size)
    num_blocks = num_seqs * per_seq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g, device="cuda").to(dtype)
    v_cache = torch.randn(shape, generator=g, device="cuda").to(dtype)
    order = torch.randperm(num_blocks, generator=g, device="cuda").to(torch.int32)
    block_tables = order.view(num_seqs, per_seq)
    lengths = torch.randint(context // 2, context + 1, (num_seqs,), generator=g, device="cuda")
    lengths[0] = context
    q = torch.randn(num_seqs, num_heads, head_dim, generator=g, device="cuda").to(dtype)
    cu = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, block_tables, lengths.to(torch.int32), cu


REAL_SHAPES = [
    pytest.param(dict(num_seqs=128, context=16384, num_heads=64, num_kv_heads=8, head_dim=128,
                      block_size=16, dtype=torch.bfloat16), {}, id="bf16-d128-gqa8-b128-ctx16k"),
    pytest.param(dict(num_seqs=16, context=4096, num_heads=16, num_kv_heads=4, head_dim=80,
                      block_size=16, dtype=torch.float16), {"sliding_window": 1000},
                 id="fp16-d80-gqa4-window1000"),
    pytest.param(dict(num_seqs=16, context=4096, num_heads=24, num_kv_heads=8, head_dim=96,
                      block_size=32, dtype=torch.float16), {"sliding_window": 333},
                 id="fp16-d96-gqa3-window333"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("shape, options", REAL_SHAPES)
def test_decode_at_model_scale_gpu(backend, shape, options):
    """Decode at the sizes users run (a 16k-token context over 128 sequences is 4 GiB of bf16
    K/V), against the fp32 reference."""
    require(backend)
    args = _real_shape_inputs(**shape)
    got = ops.paged_attention(*args, backend=backend, **options)
    want = ref_paged_attention(*args, **options)
    torch.testing.assert_close(got.float(), want.float(), **tolerance(shape["dtype"]))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_a_decode_alone_inside_a_batch_and_in_a_graph_has_the_same_bits_gpu(backend):
    """A sequence's reduction order depends on its own length only (DESIGN.md, engine rules):
    its output alone, inside a batch of 64 mixed lengths, and replayed from a CUDA graph are the
    same bits."""
    require(backend)
    q, k_cache, v_cache, tables, lens, cu = _real_shape_inputs(
        num_seqs=64, context=3000, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
        dtype=torch.bfloat16, seed=3)
    batch = ops.paged_attention(q, k_cache, v_cache, tables, lens, cu, backend=backend)
    for i in (0, 17, 63):
        alone = ops.paged_attention(q[i:i + 1], k_cache, v_cache, tables[i:i + 1],
                                    lens[i:i + 1], cu[:2], backend=backend)
        assert torch.equal(alone[0], batch[i]), i
    out = torch.empty_like(q)

    def launch():     # what a captured engine step runs: no argument checks, no host reads
        ops.paged_attention_unchecked(q, k_cache, v_cache, tables, lens, cu, out,
                                      scale=q.shape[-1] ** -0.5, backend=backend)
    launch()          # warm-up: Triton compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, batch)
