"""Loads the compiled operator library, with an error that says how to build it."""

from __future__ import annotations

import os
from pathlib import Path

import torch

_BUILD_HINT = "build it from the repository root with: pip install --no-build-isolation -e ."


def _sources_newer_than(library: Path) -> list[str]:
    # Only a source checkout (editable install) has csrc/ beside the package.
    csrc = Path(__file__).resolve().parent.parent / "csrc"
    if not csrc.is_dir():
        return []
    built = library.stat().st_mtime
    return sorted(str(p.relative_to(csrc)) for p in csrc.rglob("*") if p.is_file() and p.stat().st_mtime > built)


def load() -> None:
    """Imports torch_ln._C (which registers the torch_ln operators) or raises ImportError."""
    try:
        from torch_ln import _C, _build_info
    except ImportError as error:
        raise ImportError(
            f"torch_ln's compiled extension is missing or cannot be loaded ({error}); {_BUILD_HINT}"
        ) from error
    if _build_info.TORCH_VERSION != torch.__version__:
        raise ImportError(
            f"torch_ln was built against torch {_build_info.TORCH_VERSION} but torch {torch.__version__} is "
            f"installed; rebuild it: {_BUILD_HINT}"
        )
    stale = [] if os.environ.get("TORCH_LN_ALLOW_STALE") else _sources_newer_than(Path(_C.__file__))
    if stale:
        raise ImportError(
            f"torch_ln's compiled extension is older than its sources ({', '.join(stale[:5])}); {_BUILD_HINT} "
            "(or set TORCH_LN_ALLOW_STALE=1 to load it anyway)"
        )


def cuda_compiled() -> bool:
    """Whether this build of torch_ln contains the CUDA kernels."""
    from torch_ln import _build_info

    return _build_info.WITH_CUDA
