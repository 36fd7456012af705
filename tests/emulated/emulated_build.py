"""Builds the emulated-CUDA test library (csrc/emulated) and loads it into this process.

Under AddressSanitizer (the ASan runtime preloaded, as scripts/run.sh does) it is
built with ASan and UBSan, so an out-of-bounds access in a kernel fails the test;
with TORCH_LN_COVERAGE=1 (and no ASan) it is built for gcov (tests/gates reads what ran);
otherwise it is built plainly, so `pytest tests` runs the emulation anywhere.
"""

from __future__ import annotations

import functools
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
# -O0 keeps every branch where the source has it (inlined into its callers, a helper's branch would count once per
# call site). The emulated threads of a launch are fibers on one OS thread: plain counter updates suffice.
COVERAGE = ["--coverage", "-O0", "-DTORCH_LN_EMULATED_COVERAGE"]
COVERAGE_DIR = ROOT / "build" / "torch_ln_emulated_coverage"


def coverage_requested() -> bool:
    return os.environ.get("TORCH_LN_COVERAGE", "0") not in ("", "0")


def asan_loaded() -> bool:
    return "libasan" in Path("/proc/self/maps").read_text()


def coverage_build() -> bool:
    """Whether this process builds the coverage library: asked for, and not under ASan (whose checks would count as
    branches of the kernels)."""
    return coverage_requested() and not asan_loaded()


@functools.cache  # once per process: a second load would register the operator library again, which aborts
def load() -> bool:
    """Builds (if needed) and loads the library; returns whether it is sanitized."""
    sanitized = asan_loaded()
    coverage = coverage_build()
    name = "torch_ln_emulated_asan" if sanitized else "torch_ln_emulated"
    build_dir = COVERAGE_DIR if coverage else ROOT / "build" / name
    build_dir.mkdir(parents=True, exist_ok=True)
    # -ffp-contract=off as in setup.py: the emulated kernels round like the CUDA ones (mul_rn).
    flags = ["-ffp-contract=off", *(["-O1", "-g", *SANITIZERS] if sanitized else COVERAGE if coverage else ["-O2"])]
    if coverage:  # counts from this run only
        for stale in build_dir.glob("*.gcda"):
            stale.unlink()
    cpp_extension.load(
        name=name,
        sources=[str(ROOT / s) for s in SOURCES],
        extra_cflags=flags,
        extra_ldflags=SANITIZERS if sanitized else ["--coverage"] if coverage else [],
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=os.environ.get("TORCH_LN_VERBOSE_BUILD") == "1",
    )
    return sanitized


def dump_coverage() -> None:
    """Writes the coverage build's counts now, if this process loaded it (see dump_coverage in emulated_ops.cpp)."""
    if load.cache_info().currsize and coverage_build():
        assert torch.ops.torch_ln_emulated.dump_coverage(), "the coverage build was loaded but has no gcov counts"


if __name__ == "__main__":
    print("sanitized" if load() else "plain", torch.ops.torch_ln_emulated.layer_norm_fwd)
