"""Writes the CMake settings that build examples/cpp against this Python environment's torch and torch_ln.

Usage: python python_env.py OUT.cmake (CMakeLists.txt runs it). A CPU build of torch needs only the prefix paths;
a pip-installed CUDA build's CMake config also looks for the CUDA toolkit (even to build CPU code) and for nvrtc,
which the nvidia-* wheels beside torch have when the toolkit does not.
"""

import os
import shutil
import sys
from pathlib import Path

import torch

import torch_ln


def _cuda_toolkit() -> str | None:
    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if candidate and (Path(candidate) / "include" / "cuda_runtime.h").exists():
            return candidate
    nvcc = shutil.which("nvcc")
    return str(Path(nvcc).resolve().parent.parent) if nvcc else None


def _nvrtc_from_wheels() -> str | None:
    try:
        import nvidia
    except ImportError:
        return None
    found = sorted(p for root in nvidia.__path__ for p in Path(root).glob("*/lib/libnvrtc.so*"))
    return str(found[0]) if found else None


def settings() -> list[str]:
    lines = [f'list(APPEND CMAKE_PREFIX_PATH "{torch.utils.cmake_prefix_path}" "{torch_ln.cmake_prefix_path()}")']
    if torch.version.cuda is None:
        return lines
    toolkit = _cuda_toolkit()
    if toolkit:
        lines.append(f'set(CUDA_TOOLKIT_ROOT_DIR "{toolkit}" CACHE PATH "CUDA toolkit")')
    nvrtc = _nvrtc_from_wheels()
    if nvrtc and not (toolkit and list(Path(toolkit).glob("lib*/libnvrtc.so*"))):
        lines.append(f'set(CUDA_nvrtc_LIBRARY "{nvrtc}" CACHE FILEPATH "nvrtc")')
    return lines


if __name__ == "__main__":
    Path(sys.argv[1]).write_text("\n".join(settings()) + "\n")
