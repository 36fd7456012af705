"""The operator library lib/libtorch_ln.so: free of Python, loaded by `import torch_ln`, with its C++ side (the
header and the CMake package) where torch_ln.cmake_prefix_path() says."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import torch_ln
from torch_ln import _extension


def _dynamic_section(tool: list[str]) -> str:
    if shutil.which(tool[0]) is None:
        pytest.skip(f"needs {tool[0]} (binutils) to read the library's dynamic section")
    return subprocess.run([*tool, str(_extension.LIBRARY)], capture_output=True, text=True, check=True).stdout


def test_library_needs_no_python():
    needed = [line for line in _dynamic_section(["readelf", "-d"]).splitlines() if "(NEEDED)" in line]
    assert any("libtorch_cpu.so" in line for line in needed), needed
    assert not [line for line in needed if "python" in line], needed
    undefined = _dynamic_section(["nm", "-D", "--undefined-only"]).split()
    assert not [s for s in undefined if s.startswith(("Py", "_Py"))], "the library calls the Python C API"


def test_cmake_package_and_header_where_cmake_prefix_path_says():
    prefix = Path(torch_ln.cmake_prefix_path())
    assert (prefix / "torch_ln" / "torch_lnConfig.cmake").is_file()
    header = (prefix.parent.parent / "include" / "torch_ln" / "torch_ln.h").read_text()
    for declaration in ("at::Tensor layer_norm(", "at::Tensor rms_norm(", "layer_norm_fwd(", "rms_norm_bwd("):
        assert declaration in header


def test_missing_library_error_says_how_to_build(monkeypatch, tmp_path):
    monkeypatch.setattr(_extension, "LIBRARY", tmp_path / "libtorch_ln.so")
    with pytest.raises(ImportError, match="is missing; build it from the repository root with: pip install"):
        _extension.load()


def test_missing_module_error_says_how_to_build(monkeypatch):
    monkeypatch.setattr(_extension, "_module_file", lambda: None)
    with pytest.raises(ImportError, match="_C is missing from .* build it from the repository root with: pip install"):
        _extension.load()


def test_each_artifact_is_checked_against_its_own_sources(monkeypatch, tmp_path):
    # Regression: a rebuild after a change to csrc/python relinks only the module; the library keeps its older time
    # and must not be called stale for that source, nor the module for the library's sources.
    package = tmp_path / "torch_ln"
    files = {
        "library": package / "lib" / "libtorch_ln.so",
        "module": package / "_C.so",
        "kernel": tmp_path / "csrc" / "cpu" / "norm_cpu.cpp",
        "binding": tmp_path / "csrc" / "python" / "module.cpp",
        "header": package / "include" / "torch_ln" / "torch_ln.h",
        "emulator": tmp_path / "csrc" / "emulated" / "simt.cpp",
    }
    for path in files.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    monkeypatch.setattr(_extension, "PACKAGE_DIR", package)

    def stale(**times: int) -> list[str]:
        for name, path in files.items():
            os.utime(path, (times.get(name, 0), times.get(name, 0)))
        return _extension._sources_newer_than(files["library"], files["module"])

    assert stale(library=10, module=20, binding=15, kernel=5, header=5, emulator=30) == []
    assert stale(library=10, module=20, binding=25) == ["csrc/python/module.cpp"]
    assert stale(library=10, module=20, kernel=15) == ["csrc/cpu/norm_cpu.cpp"]
    assert stale(library=10, module=20, header=15) == ["torch_ln/include/torch_ln/torch_ln.h"]
