"""The CPU output cache (csrc/cpu/output_cache.cpp): freed y, residual_out and dx of 1 MiB or more are kept for the
next call of the same size, up to TORCH_LN_OUTPUT_CACHE_MB (default 256), so that a call's output is not fresh
memory that faults in page by page. The cap is read once per process: the cases that set it run in a fresh
interpreter."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

import torch_ln

ROWS, COLS = 256, 1024  # 1 MiB of float32: the smallest output the cache keeps
BLOCK = ROWS * COLS * 4


@pytest.fixture(autouse=True)
def empty_cache():
    torch_ln.empty_output_cache()
    yield
    torch_ln.empty_output_cache()


def _x(dtype=torch.float32, rows=ROWS, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, COLS, generator=g, dtype=dtype).requires_grad_(requires_grad)


def test_freed_output_is_reused_and_rewritten():
    x = _x()
    y = torch_ln.layer_norm(x, (COLS,))
    address, first = y.data_ptr(), y.clone()
    y.fill_(float("nan"))  # stale contents the next call must overwrite whole
    del y
    assert torch_ln.output_cache_bytes() == BLOCK
    again = torch_ln.layer_norm(x, (COLS,))
    assert again.data_ptr() == address and torch_ln.output_cache_bytes() == 0
    assert torch.equal(again, first)
    torch.testing.assert_close(again, F.layer_norm(x, (COLS,)))


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_every_row_output_is_cached(op):
    # y and dx (and residual_out for the fused ops), each 1 MiB: all kept once freed.
    x = _x(requires_grad=True)
    if op.startswith("add_"):
        outputs = getattr(torch_ln, op)(x, _x(), (COLS,))
        loss = outputs[0].sum() + outputs[1].sum()
    else:
        outputs = (getattr(torch_ln, op)(x, (COLS,)),)
        loss = outputs[0].sum()
    (dx,) = torch.autograd.grad(loss, x)
    assert torch_ln.output_cache_bytes() == 0
    del outputs, loss, dx
    assert torch_ln.output_cache_bytes() == BLOCK * (3 if op.startswith("add_") else 2)


def test_small_outputs_are_not_cached():
    # Below 1 MiB: malloc keeps such memory on its heap.
    y = torch_ln.layer_norm(_x(rows=ROWS - 1), (COLS,))
    del y
    assert torch_ln.output_cache_bytes() == 0


def test_another_size_gets_its_own_block():
    y = torch_ln.layer_norm(_x(), (COLS,))
    address = y.data_ptr()
    del y
    larger = torch_ln.layer_norm(_x(rows=ROWS + 1), (COLS,))
    assert larger.data_ptr() != address and torch_ln.output_cache_bytes() == BLOCK


def test_empty_output_cache_returns_the_bytes_held():
    outputs = [torch_ln.layer_norm(_x(), (COLS,)) for _ in range(3)]
    del outputs
    assert torch_ln.empty_output_cache() == 3 * BLOCK
    assert torch_ln.output_cache_bytes() == 0


def test_freed_on_another_thread():
    # Autograd frees saved tensors on its own threads: the deleter may run on any thread.
    outputs = [torch_ln.layer_norm(_x(), (COLS,)) for _ in range(8)]
    threads = [threading.Thread(target=outputs.pop) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert torch_ln.output_cache_bytes() == 8 * BLOCK


def test_cached_output_resizes():
    y = torch_ln.layer_norm(_x(), (COLS,))
    y.resize_(2 * ROWS, COLS)[ROWS:] = 1.0  # the storage grows through the cache's allocator
    assert y[ROWS:].eq(1.0).all()
    del y
    assert torch_ln.output_cache_bytes() == 3 * BLOCK  # the first block (freed when the storage grew), the grown one


def _in_fresh_interpreter(code: str, cache_mb: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCH_LN_OUTPUT_CACHE_MB": cache_mb}
    return subprocess.run(
        [sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=300
    )


CACHED_AFTER_THREE = f"""
import torch, torch_ln
outputs = [torch_ln.layer_norm(torch.randn({ROWS}, {COLS}), ({COLS},)) for _ in range(3)]
addresses = [y.data_ptr() for y in outputs]
while outputs:
    outputs.pop(0)  # freed in order 0, 1, 2
print(torch_ln.output_cache_bytes())
y = torch_ln.layer_norm(torch.randn({ROWS}, {COLS}), ({COLS},))
print(addresses.index(y.data_ptr()) if y.data_ptr() in addresses else -1)
"""


def test_cap():
    # Two of the three fit: the first freed went back to the system; the last freed is reused first.
    result = _in_fresh_interpreter(CACHED_AFTER_THREE, "2")
    assert result.returncode == 0, result.stderr
    assert [int(v) for v in result.stdout.split()] == [2 * BLOCK, 2]


def test_cap_zero_turns_the_cache_off():
    result = _in_fresh_interpreter(CACHED_AFTER_THREE, "0")
    assert result.returncode == 0, result.stderr
    assert int(result.stdout.split()[0]) == 0  # (malloc itself may hand back a freed address: not checked)


def test_bad_cap_is_a_clear_error():
    result = _in_fresh_interpreter(CACHED_AFTER_THREE, "lots")
    assert result.returncode != 0
    assert "expected TORCH_LN_OUTPUT_CACHE_MB to be a number of MiB >= 0, but got TORCH_LN_OUTPUT_CACHE_MB='lots'" in (
        result.stderr
    )


@pytest.mark.skipif(sys.platform != "linux", reason="page-fault counts from getrusage on Linux")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steady_state_calls_fault_no_pages(dtype):
    # Regression: each forward thread allocated and zero-filled its 512 KiB converted row, and the parameters were
    # converted into fresh tensors, every call: 472 page faults a call for a bfloat16 forward of 4 rows of 131072.
    # Once warm, y, dx and the threads' rows all come back from the caches.
    x = torch.randn(4, 131072, dtype=dtype, requires_grad=True)
    weight = torch.randn(131072, dtype=dtype, requires_grad=True)
    bias = torch.randn(131072, dtype=dtype, requires_grad=True)

    def step():
        torch_ln.layer_norm(x, (131072,), weight, bias).sum().backward()

    for _ in range(5):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 20, f"{faults} page faults in 20 warm calls"
