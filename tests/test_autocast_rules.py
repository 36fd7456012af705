"""Under autocast torch_ln gives the output dtype that the installed torch gives, for every op and dtype pair, on CUDA
and on the CPU: checked on fake tensors (FakeTensorMode), so the CUDA rules are pinned without a GPU, on each torch
release CI runs (torch's rules, from its autocast_mode.h: CUDA layer_norm float32 from 2.11 on, CUDA rms_norm float32
from 2.12 on, neither norm on the CPU's list). The values under autocast are checked on real tensors in test_ops.py
and test_add_norm.py.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import torch_ln

HALF = [torch.float16, torch.bfloat16]


class _Autocast:
    """Autocast on `device` with `dtype`, also on fake CUDA tensors: torch.autocast("cuda") turns itself off (with a
    warning) where no CUDA device exists, the dispatcher's switches do not."""

    def __init__(self, device: str, dtype: torch.dtype):
        self.device, self.dtype = device, dtype

    def __enter__(self):
        self.saved = (torch.is_autocast_enabled(self.device), torch.get_autocast_dtype(self.device))
        torch.set_autocast_enabled(self.device, True)
        torch.set_autocast_dtype(self.device, self.dtype)

    def __exit__(self, *exc):
        torch.set_autocast_enabled(self.device, self.saved[0])
        torch.set_autocast_dtype(self.device, self.saved[1])
        torch.clear_autocast_cache()


def _output_dtypes(device, autocast_dtype, input_dtype, param_dtype, D=16):
    """(torch_ln's, torch's) output dtypes of each norm and fused add under autocast, on fake tensors."""
    with FakeTensorMode():
        x = torch.empty(4, D, dtype=input_dtype, device=device)
        residual = torch.empty(4, D, dtype=input_dtype, device=device)
        w = torch.empty(D, dtype=param_dtype, device=device)
        b = torch.empty(D, dtype=param_dtype, device=device)
        with _Autocast(device, autocast_dtype), warnings.catch_warnings():
            # torch's rms_norm warns once on an input/weight dtype mismatch (and computes in the input's dtype).
            warnings.simplefilter("ignore", UserWarning)
            return {
                "layer_norm": (torch_ln.layer_norm(x, (D,), w, b).dtype, F.layer_norm(x, (D,), w, b).dtype),
                "rms_norm": (torch_ln.rms_norm(x, (D,), w, 1e-6).dtype, F.rms_norm(x, (D,), w, 1e-6).dtype),
                "add_layer_norm": (
                    torch_ln.add_layer_norm(x, residual, (D,), w, b)[0].dtype,
                    F.layer_norm(x + residual, (D,), w, b).dtype,
                ),
                "add_rms_norm": (
                    torch_ln.add_rms_norm(x, residual, (D,), w, 1e-6)[0].dtype,
                    F.rms_norm(x + residual, (D,), w, 1e-6).dtype,
                ),
            }


@pytest.mark.parametrize("param_dtype", ["input", torch.float32])  # the same dtype as the input, or float32
@pytest.mark.parametrize("input_dtype", [*HALF, torch.float32])
@pytest.mark.parametrize("autocast_dtype", HALF)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_autocast_output_dtype_is_torchs(device, autocast_dtype, input_dtype, param_dtype):
    param_dtype = input_dtype if param_dtype == "input" else param_dtype
    dtypes = _output_dtypes(device, autocast_dtype, input_dtype, param_dtype)
    wrong = {op: pair for op, pair in dtypes.items() if pair[0] != pair[1]}
    assert not wrong, f"(torch_ln, torch) output dtypes differ under {device} autocast: {wrong}"


def test_the_rules_discriminate():
    """The check above can fail: on CUDA, torch's layer_norm of half input is float32 under autocast and half
    without it, and CPU autocast keeps the input's dtype."""
    assert _output_dtypes("cuda", torch.float16, torch.float16, torch.float16)["layer_norm"][1] == torch.float32
    assert _output_dtypes("cpu", torch.bfloat16, torch.bfloat16, torch.float32)["layer_norm"][1] == torch.bfloat16
    with FakeTensorMode():
        x = torch.empty(4, 16, dtype=torch.float16, device="cuda")
        assert torch_ln.layer_norm(x, (16,)).dtype == torch.float16  # no autocast: the input's dtype
