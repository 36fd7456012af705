"""The CPU kernels advise fresh large outputs onto transparent huge pages (csrc/cpu/norm_cpu.cpp,
advise_huge_pages): checked through the VmFlags of the output's mapping in /proc/self/smaps ("hg" is
MADV_HUGEPAGE), which the advice sets whether or not huge pages are then available."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_ln

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")

# 64 MiB of float32: above glibc's largest mmap threshold (32 MiB), so every such output is a fresh mapping.
ROWS, D = 4096, 4096


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _output_flags(backward: bool) -> list[str]:
    x = torch.randn(ROWS, D, requires_grad=backward)
    y = torch_ln.layer_norm(x, (D,))
    out = torch.autograd.grad(y, x, torch.ones_like(y))[0] if backward else y
    return _vm_flags(out.data_ptr() + out.nbytes // 2)


@pytest.mark.parametrize("backward", [False, True], ids=["y", "dx"])
def test_fresh_large_output_advised(backward):
    assert "hg" in _output_flags(backward)


def test_small_output_not_advised():
    y = torch_ln.layer_norm(torch.randn(4, 1024), (1024,))
    assert "hg" not in _vm_flags(y.data_ptr())


def test_opt_out():
    """TORCH_LN_HUGE_PAGES=0 (read once per process, hence a subprocess) leaves the output's mapping alone."""
    code = "import test_huge_pages as t; print('hg' in t._output_flags(False))"
    env = dict(os.environ, TORCH_LN_HUGE_PAGES="0", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, cwd=Path(__file__).parent
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"
