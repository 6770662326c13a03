"""Drives CMake to build cb_kernels._C (see CMakeLists.txt).

Environment knobs: CBK_CUDA=auto|on|off, CBK_CUDA_ARCHS (CMake list, default "80;90" + PTX),
CBK_BUILD_TYPE (default Release), CBK_BUILD_JOBS.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _drop_stale_cache(build_dir: Path) -> None:
    """Forget a CMake cache made by another interpreter or build environment.

    pip builds in throw-away environments; a cache left in build/ by an earlier one points at a
    ninja and a Python that no longer exist, and CMake then fails before compiling anything.
    """
    stamp = build_dir / "cbk-build-env.txt"
    here = f"{sys.executable}\n{shutil.which('ninja')}\n"
    if stamp.exists() and stamp.read_text() == here:
        return
    shutil.rmtree(build_dir / "CMakeFiles", ignore_errors=True)
    (build_dir / "CMakeCache.txt").unlink(missing_ok=True)
    stamp.write_text(here)


class CMakeExtension(Extension):
    def __init__(self, name: str):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext: Extension) -> None:
        import pybind11

        out_dir = Path(self.get_ext_fullpath(ext.name)).resolve().parent
        build_dir = Path(self.build_temp).resolve() / ext.name
        build_dir.mkdir(parents=True, exist_ok=True)
        _drop_stale_cache(build_dir)
        cfg = os.environ.get("CBK_BUILD_TYPE", "Release")
        args = [
            f"-S{ROOT}",
            f"-B{build_dir}",
            "-GNinja",
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DCBK_OUTPUT_DIR={out_dir}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCBK_CUDA={os.environ.get('CBK_CUDA', 'auto')}",
        ]
        if os.environ.get("CBK_CUDA_ARCHS"):
            args.append(f"-DCBK_CUDA_ARCHS={os.environ['CBK_CUDA_ARCHS']}")
        subprocess.run(["cmake", *args], check=True)
        build = ["cmake", "--build", str(build_dir)]
        if os.environ.get("CBK_BUILD_JOBS"):
            build += ["-j", os.environ["CBK_BUILD_JOBS"]]
        subprocess.run(build, check=True)


setup(ext_modules=[CMakeExtension("cb_kernels._C")], cmdclass={"build_ext": CMakeBuild})
