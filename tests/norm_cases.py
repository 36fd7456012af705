"""What the torch_ln tests share: LayerNorm and RMSNorm as small adapter objects (so one
test function covers both), the dtype and device parametrizations, the tolerance table,
and the accuracy rule.

The accuracy rule, used wherever torch_ln is compared with torch:

    |ours - ref64| <= 2 * |torch - ref64| + floor          (max over the tensor)

where ref64 is torch_ln.reference run in float64 on the same (already rounded) inputs.
torch's own error is the yardstick: torch_ln may be at most twice as far from the exact
answer as torch is. The floor keeps the rule meaningful where torch happens to be exact
(D=1, a lucky rounding): see Tolerance.floor_ulps.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_ln
from torch_ln import reference

# Every device-generic test runs on the CPU, and on CUDA where a device is present.
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]


# --------------------------------------------------------------------------------------
# The two norms, behind one interface.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Norm:
    """One normalization: how to call torch_ln, torch and the reference the same way.

    Every callable takes (input, normalized_shape, weight, bias, eps); the RMSNorm
    adapters require bias=None.
    """

    name: str  # the op name torch_ln uses in its error messages: "layer_norm" / "rms_norm"
    params: tuple[str, ...]  # the affine parameters: ("weight", "bias") or ("weight",)
    default_eps: float | None  # the functional's default eps
    ours: Callable
    torch: Callable
    reference: Callable
    module: type[nn.Module]  # torch_ln's module
    torch_module: type[nn.Module]  # torch's module

    def __repr__(self) -> str:
        return self.name

    @property
    def has_bias(self) -> bool:
        return "bias" in self.params

    @property
    def fwd_op(self):
        return getattr(torch.ops.torch_ln, f"{self.name}_fwd").default

    @property
    def bwd_op(self):
        return getattr(torch.ops.torch_ln, f"{self.name}_bwd").default

    def fwd(self, x, shape, weight=None, bias=None, eps=None):
        """The fwd operator: (y, statistics), statistics = (mean, rstd) or (rstd,)."""
        eps = self.default_eps if eps is None else eps
        if self.has_bias:
            y, *stats = self.fwd_op(x, list(shape), weight, bias, eps)
        else:
            assert bias is None
            y, *stats = self.fwd_op(x, list(shape), weight, eps)
        return y, tuple(stats)

    def bwd(self, grad_out, x, shape, stats, weight=None, bias=None, output_mask=None):
        """The bwd operator: (dx, dweight[, dbias]); output_mask has one entry per result."""
        mask = list(output_mask) if output_mask is not None else [True] * (1 + len(self.params))
        if self.has_bias:
            return self.bwd_op(grad_out, x, list(shape), *stats, weight, bias, mask)
        assert bias is None
        return self.bwd_op(grad_out, x, list(shape), *stats, weight, mask)


def _no_bias(fn):
    def call(x, shape, weight=None, bias=None, eps=None):
        assert bias is None, "RMSNorm has no bias"
        return fn(x, shape, weight, eps)

    return call


def _torch_layer_norm(x, shape, weight=None, bias=None, eps=1e-5):
    """F.layer_norm, except where torch has no kernel for the dtypes:
    - on the CPU its backward fails ("expected scalar type Half but found Float") for half/bfloat16 input with a
      float32 bias and no weight: there the yardstick is torch with an all-ones float32 weight, the same function;
    - on CUDA (torch 2.11, seen on an H200) it refuses half/bfloat16 input with float32 parameters: there the
      yardstick is torch in float32 on the upcast input, rounded once to the input's dtype, which is what its CPU
      kernel for those dtypes computes (float32 arithmetic, one rounding of y). Not under CUDA autocast, which casts
      every argument to float32 itself and returns float32 (rounding that back to the input's dtype made torch look
      as if it kept the input's dtype: regression, 3 autocast tests on the H200, torch 2.11)."""
    params = [t for t in (weight, bias) if t is not None]
    mixed = any(t.dtype != x.dtype for t in params)
    if x.device.type == "cuda" and mixed and not torch.is_autocast_enabled("cuda"):
        return F.layer_norm(x.float(), shape, weight, bias, eps).to(x.dtype)
    if weight is None and bias is not None and bias.dtype != x.dtype and x.device.type == "cpu":
        weight = torch.ones_like(bias)
    return F.layer_norm(x, shape, weight, bias, eps)


LAYER_NORM = Norm(
    name="layer_norm",
    params=("weight", "bias"),
    default_eps=1e-5,
    ours=torch_ln.layer_norm,
    torch=_torch_layer_norm,
    reference=reference.layer_norm,
    module=torch_ln.LayerNorm,
    torch_module=nn.LayerNorm,
)
RMS_NORM = Norm(
    name="rms_norm",
    params=("weight",),
    default_eps=None,
    ours=_no_bias(torch_ln.rms_norm),
    torch=_no_bias(F.rms_norm),
    reference=_no_bias(reference.rms_norm),
    module=torch_ln.RMSNorm,
    torch_module=nn.RMSNorm,
)
NORMS = [pytest.param(LAYER_NORM, id="layer_norm"), pytest.param(RMS_NORM, id="rms_norm")]


def norm_affine_params() -> list:
    """(norm, has_weight, has_bias) for every weight/bias presence each norm allows."""
    cases = []
    for norm in (LAYER_NORM, RMS_NORM):
        for has_weight, has_bias in itertools.product((False, True), repeat=2):
            if has_bias and not norm.has_bias:
                continue
            tag = ("w" if has_weight else "") + ("b" if has_bias else "") or "none"
            cases.append(pytest.param(norm, has_weight, has_bias, id=f"{norm.name}-{tag}"))
    return cases


def output_masks(norm: Norm) -> list[tuple[bool, ...]]:
    return list(itertools.product((False, True), repeat=1 + len(norm.params)))


# --------------------------------------------------------------------------------------
# Dtypes.
# --------------------------------------------------------------------------------------

# (input dtype, weight/bias dtype): the four dtypes, and mixed precision (half or bfloat16
# activations with float32 parameters, as under an fp32 master copy).
DTYPES = [
    pytest.param(torch.float32, torch.float32, id="f32"),
    pytest.param(torch.float64, torch.float64, id="f64"),
    pytest.param(torch.float16, torch.float16, id="f16"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, torch.float32, id="f16-f32params"),
    pytest.param(torch.bfloat16, torch.float32, id="bf16-f32params"),
]


def norm_affine_dtype_params() -> list:
    """(norm, has_weight, has_bias, dtype, param_dtype): norm_affine_params x DTYPES, less the
    mixed-precision cases without parameters (they are the plain half/bfloat16 cases again)."""
    cases = []
    for affine in norm_affine_params():
        norm, has_weight, has_bias = affine.values
        for dt in DTYPES:
            dtype, param_dtype = dt.values
            if param_dtype != dtype and not (has_weight or has_bias):
                continue
            cases.append(pytest.param(norm, has_weight, has_bias, dtype, param_dtype, id=f"{affine.id}-{dt.id}"))
    return cases


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------
# Tolerances.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tolerance:
    """Tolerances for one input dtype.

    fwd, dx: (atol, rtol) for torch_ln against torch, for y and for the input gradient.
    dparam:  (atol, rtol) for the weight and bias gradients; atol is per sqrt(row): those
             gradients are sums over the M rows, whose rounding error grows like sqrt(M).
    floor_ulps: the floor of the accuracy rule, in units of the input dtype's epsilon,
             relative to the tensor's scale max(1, max|ref64|).
    """

    fwd: tuple[float, float]
    dx: tuple[float, float]
    dparam: tuple[float, float]
    floor_ulps: float


TOLERANCES = {
    # float64: two float64 implementations differ only in summation order: a few ulps
    # times sqrt(D) (D up to 65537 -> ~1e-14 relative). 1e-10 leaves a margin of 10^4 and
    # still catches any float32 shortcut (which would be off by ~1e-7). The floor (512 ulps
    # ~ 1e-13) is that summation-order noise: in float64 the reference is no more exact
    # than the code under test.
    torch.float64: Tolerance(fwd=(1e-10, 1e-10), dx=(1e-10, 1e-10), dparam=(1e-10, 1e-10), floor_ulps=512),
    # float32: measured torch error vs float64 is ~1e-7 relative for y and dx, ~1e-6 for
    # dweight at M=2049. 1e-5 is ~100 ulps: room for a different (tree vs sequential)
    # reduction order, far below any real bug (a wrong eps alone moves y by ~1e-5 * y).
    # Floor: 16 ulps of the output scale.
    torch.float32: Tolerance(fwd=(1e-5, 1e-5), dx=(1e-5, 1e-5), dparam=(1e-5, 1e-5), floor_ulps=16),
    # float16 (eps 2^-10 ~ 1e-3): y and dx are float32 results rounded to float16, so two
    # correct implementations may round to neighbouring values: 2 ulps relative, 1e-3
    # absolute near zero. Torch's own float16 dweight is off by up to 5e-3 relative
    # (it rounds intermediate values), so dparam allows that much. Floor: 1 ulp, the
    # rounding of the output itself.
    torch.float16: Tolerance(fwd=(1e-3, 2e-3), dx=(2e-3, 2e-3), dparam=(1e-2, 1e-2), floor_ulps=1),
    # bfloat16 (eps 2^-7 ~ 7.8e-3): as float16 with 8x larger ulps. Torch's bfloat16
    # dweight is off by up to 3e-2 relative at M=2049 (bfloat16 statistics), so dparam's
    # rtol follows torch, and its atol grows with sqrt(M).
    torch.bfloat16: Tolerance(fwd=(1e-2, 1.6e-2), dx=(1.6e-2, 1.6e-2), dparam=(1e-1, 4e-2), floor_ulps=1),
}


def assert_close_to_torch(name: str, ours: torch.Tensor, theirs: torch.Tensor, dtype: torch.dtype, rows: int) -> None:
    """Parity with torch, with the table's tolerance for `name` (y, dx, dweight, dbias)."""
    tol = TOLERANCES[dtype]
    if name == "y":
        atol, rtol = tol.fwd
    elif name == "dx":
        atol, rtol = tol.dx
    else:
        atol, rtol = tol.dparam
        atol *= math.sqrt(max(rows, 1))
    torch.testing.assert_close(ours, theirs, atol=atol, rtol=rtol, msg=lambda m: f"{name} vs torch: {m}")


def max_error(t: torch.Tensor, ref64: torch.Tensor) -> float:
    return (t.double() - ref64).abs().max().item() if t.numel() else 0.0


def assert_accuracy(
    name: str, ours: torch.Tensor, theirs: torch.Tensor, ref64: torch.Tensor, dtype: torch.dtype, rows: int
) -> None:
    """The accuracy rule (module docstring): ours is at most 2x torch's error from ref64, plus the floor."""
    scale = max(1.0, ref64.abs().max().item() if ref64.numel() else 0.0)
    floor = TOLERANCES[dtype].floor_ulps * torch.finfo(dtype).eps * scale
    if name in ("dweight", "dbias"):
        # A sum over M rows, accumulated in the accumulation dtype: its rounding error
        # grows like sqrt(M) ulps of that dtype.
        floor += 4 * torch.finfo(accumulation_dtype(dtype)).eps * scale * math.sqrt(max(rows, 1))
    ours_err, torch_err = max_error(ours, ref64), max_error(theirs, ref64)
    assert ours_err <= 2 * torch_err + floor, (
        f"{name}: torch_ln's error vs float64 {ours_err:.3e} > 2 x torch's {torch_err:.3e} + floor {floor:.3e}"
    )


# --------------------------------------------------------------------------------------
# Running a norm forward and backward.
# --------------------------------------------------------------------------------------


def make_params(norm: Norm, shape, has_weight: bool, has_bias: bool, dtype, device):
    """Weight around 1 (as trained weights are) and a bias around 0, or None."""
    weight = (1 + 0.5 * torch.randn(shape, device=device)).to(dtype) if has_weight else None
    bias = torch.randn(shape, device=device).to(dtype) if has_bias else None
    return weight, bias


def run(fn, base: torch.Tensor, weight, bias, grad_out, shape, eps, view=lambda t: t, dtype=None) -> dict:
    """Runs fn(view(base), shape, weight, bias, eps) forward and backward(grad_out).

    Gradients are taken with respect to `base` (a leaf), so a non-contiguous view's
    gradient is checked through the view. `dtype` casts the leaves first (float64 for the
    reference run). Returns {"y", "dx", "dweight", "dbias"} (absent parameters left out).
    """

    def leaf(t):
        if t is None:
            return None
        t = t.detach().clone() if dtype is None else t.detach().to(dtype)
        return t.requires_grad_()

    x, w, b = leaf(base), leaf(weight), leaf(bias)
    y = fn(view(x), shape, w, b, eps)
    y.backward(grad_out if dtype is None else grad_out.to(dtype))
    out = {"y": y.detach(), "dx": x.grad}
    if w is not None:
        out["dweight"] = w.grad
    if b is not None:
        out["dbias"] = b.grad
    return out


def check_against_torch_and_reference(
    norm: Norm, base, weight, bias, grad_out, shape, eps, input_dtype, rows, view=lambda t: t
) -> dict:
    """torch_ln vs torch (tolerance table) and vs the float64 reference (accuracy rule)."""
    ours = run(norm.ours, base, weight, bias, grad_out, shape, eps, view)
    theirs = run(norm.torch, base, weight, bias, grad_out, shape, eps, view)
    ref64 = run(norm.reference, base, weight, bias, grad_out, shape, eps, view, dtype=torch.float64)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name].shape == theirs[name].shape, name
        assert ours[name].dtype == theirs[name].dtype, name
        assert ours[name].device == theirs[name].device, name
        assert torch.isfinite(ours[name]).all(), f"{name} has non-finite values"
        assert_close_to_torch(name, ours[name], theirs[name], input_dtype, rows)
        assert_accuracy(name, ours[name], theirs[name], ref64[name], input_dtype, rows)
    return ours


def rows_of(shape: Sequence[int], normalized_ndim: int) -> int:
    return math.prod(shape[: len(shape) - normalized_ndim])


# --------------------------------------------------------------------------------------
# The gated RMSNorm (tests/test_gated_norm.py on the CPU and CUDA kernels, tests/emulated/test_emulated_gated.py).
# --------------------------------------------------------------------------------------

# (gate_position, activation, round_normalized): Mamba2's, FalconH1's (both positions), Qwen3-Next's (silu and
# Qwen4Exp's sigmoid), GLM5-Next's.
GATED_FORMS = [
    ("before", "silu", True),
    ("before", "silu", False),
    ("after", "silu", False),
    ("after", "silu", True),
    ("after", "sigmoid", True),
    ("after", "sigmoid", False),
]


def gated_inputs(rows, cols, dtype, weight_dtype, with_gate, seed=0, device="cpu"):
    """(x, z, weight, dy): rows of several magnitudes; gates across silu's and sigmoid's curved range; weights around
    1, as trained (None for weight_dtype None); z None without a gate."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, cols, generator=g) * torch.logspace(-1, 1, cols)).to(dtype)
    z = (torch.randn(rows, cols, generator=g) * 3).to(dtype) if with_gate else None
    w = (1 + 0.5 * torch.randn(cols, generator=g)).to(weight_dtype) if weight_dtype is not None else None
    dy = torch.randn(rows, cols, generator=g).to(dtype)
    return tuple(t if t is None else t.to(device) for t in (x, z, w, dy))
