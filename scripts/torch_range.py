"""The torch releases torch_ln supports, e.g. ">=2.11,<2.15": pyproject.toml's build requirement, the one place the
range is written. setup.py, scripts/run.sh and scripts/build_wheels.py read it through this file.

    python scripts/torch_range.py           # prints the requirement, e.g. torch>=2.11,<2.15
    python scripts/torch_range.py --oldest  # the oldest release it admits, e.g. 2.11.0
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def supported_torch() -> str:
    """The range as a version specifier, e.g. ">=2.11,<2.15"."""
    return re.search(r'"torch(?P<spec>[<>=~!][^"]*)"', PYPROJECT.read_text())["spec"]


def oldest_torch() -> str:
    """The range's lower bound (its >= clause) as a full release, e.g. "2.11.0"."""
    (lower,) = re.findall(r">=\s*([0-9.]+)", supported_torch())
    return ".".join((lower.split(".") + ["0", "0"])[:3])


if __name__ == "__main__":
    print(oldest_torch() if sys.argv[1:] == ["--oldest"] else f"torch{supported_torch()}")
