"""Loads the compiled operator library (lib/libtorch_ln.so, shared with C++ programs) and the Python module of
eager calls (_C), with an error that says how to build them; and where the C++ side (header, CMake package) lies."""

from __future__ import annotations

import importlib
import importlib.machinery
import os
from pathlib import Path

import torch

_BUILD_HINT = "build it from the repository root with: pip install --no-build-isolation -e ."
PACKAGE_DIR = Path(__file__).resolve().parent
LIBRARY = PACKAGE_DIR / "lib" / "libtorch_ln.so"
MODULE_SOURCES = "python"  # csrc/python: the module _C's sources


def _module_file() -> Path | None:
    # torch_ln/_C<this Python's extension suffix>.
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        if (PACKAGE_DIR / f"_C{suffix}").exists():
            return PACKAGE_DIR / f"_C{suffix}"
    return None


def _sources_newer_than(library: Path, module: Path) -> list[str]:
    # Only a source checkout (editable install) has csrc/ beside the package; the public header is a source of both.
    # csrc/emulated is the test-only SIMT emulator, part of neither.
    root = PACKAGE_DIR.parent
    if not (root / "csrc").is_dir():
        return []
    emulated, module_sources = root / "csrc" / "emulated", root / "csrc" / MODULE_SOURCES
    sources = [p for p in (root / "csrc").rglob("*") if p.is_file() and emulated not in p.parents]
    headers = [p for p in (PACKAGE_DIR / "include").rglob("*") if p.is_file()]

    def newer(paths: list[Path], built: Path) -> list[Path]:
        built_at = built.stat().st_mtime
        return [p for p in paths if p.stat().st_mtime > built_at]

    stale = newer([p for p in sources if module_sources not in p.parents] + headers, library)
    stale += newer([p for p in sources if module_sources in p.parents] + headers, module)
    return sorted({str(p.relative_to(root)) for p in stale})


def load() -> None:
    """Loads lib/libtorch_ln.so (which registers the torch_ln operators) or raises ImportError."""
    try:
        from torch_ln import _build_info
    except ImportError as error:
        raise ImportError(f"torch_ln's compiled library is missing ({error}); {_BUILD_HINT}") from error
    if _build_info.TORCH_VERSION != torch.__version__:
        raise ImportError(
            f"torch_ln was built against torch {_build_info.TORCH_VERSION} but torch {torch.__version__} is "
            f"installed; rebuild it: {_BUILD_HINT}"
        )
    if not LIBRARY.exists():
        raise ImportError(f"torch_ln's compiled library {LIBRARY} is missing; {_BUILD_HINT}")
    module = _module_file()
    if module is None:
        raise ImportError(
            f"torch_ln's Python module _C is missing from {PACKAGE_DIR} (built for another Python?); {_BUILD_HINT}"
        )
    stale = [] if os.environ.get("TORCH_LN_ALLOW_STALE") else _sources_newer_than(LIBRARY, module)
    if stale:
        raise ImportError(
            f"torch_ln's compiled artifacts are older than their sources ({', '.join(stale[:5])}); {_BUILD_HINT} "
            "(or set TORCH_LN_ALLOW_STALE=1 to load them anyway)"
        )
    try:
        torch.ops.load_library(LIBRARY)
    except OSError as error:
        raise ImportError(f"torch_ln's compiled library cannot be loaded ({error}); {_BUILD_HINT}") from error
    importlib.import_module("torch_ln._C")  # after the library: it links against it


def cuda_compiled() -> bool:
    """Whether this build of torch_ln contains the CUDA kernels."""
    from torch_ln import _build_info

    return _build_info.WITH_CUDA


def cmake_prefix_path() -> str:
    """The directory to put on CMAKE_PREFIX_PATH for find_package(torch_ln) (as torch.utils.cmake_prefix_path)."""
    return str(PACKAGE_DIR / "share" / "cmake")
