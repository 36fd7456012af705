"""Loads the compiled operator library (lib/libtorch_ln.so, shared with C++ programs), with an error that says how
to build it; and where its C++ side (header, CMake package) lies."""

from __future__ import annotations

import os
from pathlib import Path

import torch

_BUILD_HINT = "build it from the repository root with: pip install --no-build-isolation -e ."
PACKAGE_DIR = Path(__file__).resolve().parent
LIBRARY = PACKAGE_DIR / "lib" / "libtorch_ln.so"


def _sources_newer_than(library: Path) -> list[str]:
    # Only a source checkout (editable install) has csrc/ beside the package; the public header is a source too.
    # csrc/emulated is the test-only SIMT emulator, not part of the library.
    root = PACKAGE_DIR.parent
    if not (root / "csrc").is_dir():
        return []
    built = library.stat().st_mtime
    emulated = root / "csrc" / "emulated"
    sources = [
        *(p for p in (root / "csrc").rglob("*") if emulated not in p.parents),
        *(PACKAGE_DIR / "include").rglob("*"),
    ]
    return sorted(str(p.relative_to(root)) for p in sources if p.is_file() and p.stat().st_mtime > built)


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
    stale = [] if os.environ.get("TORCH_LN_ALLOW_STALE") else _sources_newer_than(LIBRARY)
    if stale:
        raise ImportError(
            f"torch_ln's compiled library is older than its sources ({', '.join(stale[:5])}); {_BUILD_HINT} "
            "(or set TORCH_LN_ALLOW_STALE=1 to load it anyway)"
        )
    try:
        torch.ops.load_library(LIBRARY)
    except OSError as error:
        raise ImportError(f"torch_ln's compiled library cannot be loaded ({error}); {_BUILD_HINT}") from error


def cuda_compiled() -> bool:
    """Whether this build of torch_ln contains the CUDA kernels."""
    from torch_ln import _build_info

    return _build_info.WITH_CUDA


def cmake_prefix_path() -> str:
    """The directory to put on CMAKE_PREFIX_PATH for find_package(torch_ln) (as torch.utils.cmake_prefix_path)."""
    return str(PACKAGE_DIR / "share" / "cmake")
