"""TORCH_LN_HUGE_PAGES=1 advises fresh large CPU outputs onto transparent huge pages (csrc/cpu/norm_cpu.cpp,
advise_huge_pages). Checked through the VmFlags of the output's mapping in /proc/self/smaps ("hg" is
MADV_HUGEPAGE), which the advice sets whether or not huge pages are then available. The setting is read once per
process, so each case runs in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_ln

pytestmark = pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")


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


def output_advised(rows: int, backward: bool) -> bool:
    """Whether the output of a LayerNorm forward (or its dx) over rows x 4096 float32 was advised. 4096 rows
    (64 MiB) is above glibc's largest mmap threshold (32 MiB): every such output is a fresh mapping."""
    x = torch.randn(rows, 4096, requires_grad=backward)
    y = torch_ln.layer_norm(x, (4096,))
    out = torch.autograd.grad(y, x, torch.ones_like(y))[0] if backward else y
    return "hg" in _vm_flags(out.data_ptr() + out.nbytes // 2)


def _advised_in_fresh_process(setting: str | None, rows: int, backward: bool) -> bool:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("TORCH_LN_HUGE_PAGES", None)
    if setting is not None:
        env["TORCH_LN_HUGE_PAGES"] = setting
    code = f"import test_huge_pages as t; print(t.output_advised({rows}, {backward}))"
    cwd = Path(__file__).parent
    out = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1] == "True"


@pytest.mark.parametrize("backward", [False, True], ids=["y", "dx"])
def test_fresh_large_output_advised_when_enabled(backward):
    assert _advised_in_fresh_process("1", 4096, backward)


@pytest.mark.parametrize("setting", [None, "0"], ids=["unset", "0"])
def test_off_by_default(setting):
    assert not _advised_in_fresh_process(setting, 4096, False)


def test_small_output_not_advised():
    assert not _advised_in_fresh_process("1", 4, False)
