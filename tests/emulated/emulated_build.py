"""Builds the emulated-CUDA test library (csrc/emulated) and loads it into this process.

Under AddressSanitizer (the ASan runtime preloaded, as scripts/test.sh does) it is
built with ASan and UBSan, so an out-of-bounds access in a kernel fails the test;
without it, it is built plainly, so `pytest tests` runs the emulation anywhere.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [
    "csrc/norm_ops.cpp",
    "csrc/emulated/simt_emulator.cpp",
    "csrc/emulated/emulated_ops.cpp",
    "csrc/emulated/emulated_forward.cpp",
    "csrc/emulated/emulated_backward.cpp",
]
SANITIZERS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]


def asan_loaded() -> bool:
    return "libasan" in Path("/proc/self/maps").read_text()


def load() -> bool:
    """Builds (if needed) and loads the library; returns whether it is sanitized."""
    sanitized = asan_loaded()
    name = "torch_ln_emulated_asan" if sanitized else "torch_ln_emulated"
    build_dir = ROOT / "build" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    # -ffp-contract=off as in setup.py: the emulated kernels round like the CUDA ones (mul_rn).
    flags = ["-ffp-contract=off", *(["-O1", "-g", *SANITIZERS] if sanitized else ["-O2"])]
    cpp_extension.load(
        name=name,
        sources=[str(ROOT / s) for s in SOURCES],
        extra_cflags=flags,
        extra_ldflags=SANITIZERS if sanitized else [],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=os.environ.get("TORCH_LN_VERBOSE_BUILD") == "1",
    )
    return sanitized


if __name__ == "__main__":
    print("sanitized" if load() else "plain", torch.ops.torch_ln_emulated.layer_norm_fwd)
