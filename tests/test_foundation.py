"""The package builds, imports without a GPU, reports itself, and ships every file."""
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch

import cb_kernels
from cb_kernels import _C, ops
from cb_kernels.ops import _backend

ROOT = Path(__file__).resolve().parent.parent


def test_import_without_gpu_and_cpu_backend_present():
    backends = ops.available_backends()
    assert "cpu" in backends and "torch" in backends
    assert set(backends) <= {"cuda", "triton", "cpu", "torch"}
    assert _C.cpu_isa() in ("avx2", "portable")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error text")
def test_cuda_path_error_text_without_gpu():
    assert "cuda" not in ops.available_backends()
    with pytest.raises(RuntimeError, match="'cuda' backend cannot run on this machine: .+"):
        _backend.resolve_backend("cuda", torch.device("cpu"), ("cuda", "cpu"), "cuda", "some_op")
    # The compiled module answers why, without aborting the process.
    assert _C.cuda_device_error() != ""
    assert _C.cuda_device_count() == 0


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match="backend must be one of"):
        _backend.resolve_backend("metal", torch.device("cpu"), ("cpu",), "cpu", "some_op")


def test_info_command_lists_versions():
    out = subprocess.run([sys.executable, "-m", "cb_kernels", "info"], capture_output=True, text=True,
                         check=True, cwd="/").stdout
    for key in ("cb_kernels", "backends", "cuda_kernels_compiled", "torch", "triton", "transformers",
                "cpu_fp32_linears", "cpu_bf16_linears", "cpu_fp16"):
        assert key in out
    assert cb_kernels.__version__ in out
    from cb_kernels.runner.packed_linears import bf16_path
    assert bf16_path() in out          # the bf16 path that runs here, in words


@pytest.mark.slow
def test_wheel_installs_into_fresh_venv_and_imports(tmp_path):
    """`pip wheel .` must ship every file the package needs (CPU-only build to keep CI short)."""
    env = dict(os.environ, CBK_CUDA="off")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"),
                    str(ROOT)], check=True, env=env)
    wheels = list((tmp_path / "dist").glob("cb_kernels-*.whl"))
    assert len(wheels) == 1
    venv.create(tmp_path / "venv", with_pip=True)
    py = str(tmp_path / "venv" / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "-q", "torch==2.13.0", "numpy"], check=True)
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", str(wheels[0])], check=True)
    code = ("import cb_kernels, cb_kernels._C, cb_kernels.ops as o; "
            "import cb_kernels.ops.reference, cb_kernels.engine; "
            "assert 'cpu' in o.available_backends(); print(cb_kernels.__file__)")
    out = subprocess.run([py, "-c", code], capture_output=True, text=True, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert str(tmp_path / "venv") in out.stdout


def test_kernel_thread_count_reaches_every_python_thread():
    """The count the wrappers set is process-wide: OpenMP's own setting is per calling thread,
    so a kernel called from another Python thread would otherwise use every core."""
    import threading

    old = _C.get_num_threads()
    seen = []
    try:
        _C.set_num_threads(1)
        t = threading.Thread(target=lambda: seen.append(_C.get_num_threads()))
        t.start()
        t.join()
    finally:
        _C.set_num_threads(old)
    assert seen == [1]


@pytest.mark.parametrize("user_env, want", [
    ({}, "2000"),                                    # ours: a short bounded spin
    ({"OMP_WAIT_POLICY": "PASSIVE"}, None),          # the user's policy is left alone
    ({"GOMP_SPINCOUNT": "7"}, "7"),                  # the user's count wins
], ids=["default", "user-policy", "user-spincount"])
def test_openmp_spin_bound_is_set_unless_the_user_chose(user_env, want):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(user_env)
    code = "import os, cb_kernels; print(os.environ.get('GOMP_SPINCOUNT'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == str(want)


def test_import_ops_loads_no_engine():
    """`import cb_kernels.ops` in a fresh interpreter brings the kernels, not the engine, the
    runner or transformers; the package's public names still resolve (on first use)."""
    code = ("import sys, cb_kernels.ops\n"
            "print([m for m in sys.modules if m.split('.')[0] == 'transformers'\n"
            "       or m.startswith(('cb_kernels.engine', 'cb_kernels.runner'))])\n"
            "import cb_kernels\n"
            "print(cb_kernels.Engine.__module__, cb_kernels.UnsupportedModelError.__name__,\n"
            "      cb_kernels.ops.paged_attention.__name__, 'Engine' in dir(cb_kernels))")
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.strip().splitlines()
    assert lines == ["[]", "cb_kernels.engine.engine UnsupportedModelError paged_attention True"]
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        cb_kernels.nope
