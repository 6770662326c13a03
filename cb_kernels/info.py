"""What `cb-kernels info` prints: versions, backends and the hardware this build can use."""
from __future__ import annotations

import importlib.metadata
import platform


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def collect() -> dict:
    import torch

    import cb_kernels
    from cb_kernels import _C
    from cb_kernels.ops._backend import available_backends, cuda_kernels_error
    from cb_kernels.runner.packed_linears import bf16_path, gemm

    gpu = None
    if torch.cuda.is_available():
        gpu = f"{torch.cuda.get_device_name(0)} (sm_{''.join(map(str, torch.cuda.get_device_capability(0)))})"
    return {
        "cb_kernels": cb_kernels.__version__,
        "backends": available_backends(),
        "cuda_kernels_compiled": _C.build_info["cuda_compiled"],
        "cuda_archs": _C.build_info["cuda_archs"] or None,
        "cuda_kernels_usable": cuda_kernels_error() or "yes",
        "cpu_kernel_isa": _C.cpu_isa(),
        "cpu_linear_isa": _C.linear_isa(),
        "cpu_greedy_head": "avx512-vnni" if _C.greedy_head_has_simd() else "portable (off by default)",
        "cpu_fp32_linears": gemm(torch.float32) or "transformers' (no packed GEMM here)",
        "cpu_bf16_linears": bf16_path(),
        "cpu_fp16": "transformers' forward (fp16 is not packed on CPU; load bfloat16 instead)",
        "cpu_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "gpu": gpu,
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
    }


def format_info(info: dict) -> str:
    width = max(map(len, info))
    return "\n".join(f"{k:<{width}}  {', '.join(v) if isinstance(v, list) else v}" for k, v in info.items())
