"""libtorch_ln.so starts in a C++ program whatever the program links before or beside it: its RUNPATH finds LibTorch
and the CUDA runtime (setup.py's _library_runpath), so the loader never depends on a library that happened to load
them first. The programs are linked here with g++ as a CMake build would link them (the executable's own RUNPATH
names torch_ln/lib and torch/lib, not the CUDA runtime's folder) and run with no LD_LIBRARY_PATH.

Regression test for a program linked `torch_ln::torch_ln ${TORCH_LIBRARIES}` (torch_ln first) that failed to start
with "libc10_cuda.so: cannot open shared object file" (issue 40).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

import torch_ln._extension as extension

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "build" / "library_load"
TORCH_LIB = Path(torch.__file__).resolve().parent / "lib"
TORCH_LN_LIB = extension.LIBRARY.parent

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to link the test programs")

# Calls an operator through the C++ API (the dispatcher) on a CPU tensor and checks it against LibTorch.
PROBE = r"""
#include <ATen/ATen.h>
#include <torch_ln/torch_ln.h>
#include <cstdio>
int main() {
  at::Tensor x = at::randn({3, 8});
  at::Tensor w = at::randn({8});
  bool same = torch_ln::rms_norm(x, {8}, w, 1e-6).allclose(at::rms_norm(x, {8}, w, 1e-6), 1e-5, 1e-6);
  std::printf("%s\n", same ? "ok" : "mismatch");
  return same ? 0 : 1;
}
"""
# References nothing: only the loader's work and the operators' registration run.
EMPTY = "int main() { return 0; }\n"


def _run(command: list, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [str(c) for c in command], check=False, capture_output=True, text=True, timeout=600, **kwargs
    )
    assert result.returncode == 0, (
        f"{' '.join(map(str, command))} exited {result.returncode}:\n{result.stdout}{result.stderr}"
    )
    return result


def _object(name: str, source: str, includes: list[str]) -> Path:
    """Compiles `source` once per content (the probe takes about 30 s: ATen's headers). pytest-xdist workers may
    compile it at once: each writes its own file and renames it into place."""
    BUILD.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256((source + " ".join(includes)).encode()).hexdigest()[:16]
    obj = BUILD / f"{name}-{key}.o"
    if not obj.exists():
        src = BUILD / f"{name}-{key}-{os.getpid()}.cpp"
        src.write_text(source)
        abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
        flags = [f"-I{i}" for i in includes]
        partial = obj.with_suffix(f".{os.getpid()}.o")
        _run(["g++", "-std=c++20", "-O1", "-fPIC", abi, *flags, "-c", src, "-o", partial])
        os.replace(partial, obj)
        src.unlink()
    return obj


@pytest.fixture(scope="module")
def probe() -> Path:
    includes = [
        *cpp_extension.include_paths(),
        str(extension.PACKAGE_DIR / "include"),
        sysconfig.get_paths()["include"],
    ]
    return _object("probe", PROBE, includes)


def _link_and_run(exe: Path, obj: Path, libraries: list[str]) -> tuple[str, list[str]]:
    """Links `obj` with `libraries` in that order (--as-needed, as Debian's and Ubuntu's default) into `exe`, runs
    it without LD_LIBRARY_PATH; returns its output and its NEEDED entries."""
    # The executable's RUNPATH: where it finds its own direct dependencies, as CMake would set it.
    runpath = f"-Wl,-rpath,{TORCH_LN_LIB}:{TORCH_LIB}"
    _run(["g++", obj, "-o", exe, "-Wl,--as-needed", f"-L{TORCH_LN_LIB}", f"-L{TORCH_LIB}", runpath, *libraries])
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "LD_PRELOAD")}
    out = _run([exe], env=env).stdout
    needed = [
        line.split("[")[1].rstrip("]")
        for line in _run(["readelf", "-d", exe]).stdout.splitlines()
        if "(NEEDED)" in line
    ]
    return out, needed


# torch_ln keeps its operators only when linked --no-as-needed (as the CMake package links it).
TORCH_LN = ["-Wl,--push-state,--no-as-needed", "-ltorch_ln", "-Wl,--pop-state"]
LIBTORCH = ["-ltorch", "-ltorch_cpu", "-lc10"]


@pytest.mark.parametrize(
    "order",
    [
        pytest.param(TORCH_LN + LIBTORCH, id="torch_ln-first"),  # the order that failed to start
        pytest.param(LIBTORCH + TORCH_LN, id="torch-first"),
        pytest.param(LIBTORCH[::-1] + TORCH_LN, id="c10-first"),
    ],
)
def test_program_starts_in_any_link_order(probe, order, tmp_path):
    out, needed = _link_and_run(tmp_path / "probe", probe, order)
    assert out.strip() == "ok"
    assert "libtorch_ln.so" in needed


def test_program_without_libtorch_cuda_starts(tmp_path):
    """libtorch_ln.so alone in the program: its CUDA dependencies (libc10_cuda, libtorch_cuda, libcudart where it has
    the CUDA kernels) come only through its own RUNPATH."""
    out, needed = _link_and_run(tmp_path / "empty", _object("empty", EMPTY, []), TORCH_LN)
    assert needed[0] == "libtorch_ln.so" and not any("cuda" in n or "torch_cpu" in n for n in needed), needed
    assert out == ""


def test_runpath_is_set():
    dynamic = _run(["readelf", "-d", extension.LIBRARY]).stdout
    runpath = [line for line in dynamic.splitlines() if "(RUNPATH)" in line]
    assert runpath, f"{extension.LIBRARY} has no RUNPATH:\n{dynamic}"
    assert "$ORIGIN/../../torch/lib" in runpath[0]
