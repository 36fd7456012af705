"""The norms with a quantized output (torch_ln.rms_norm_quant and the others), on the CPU.

Accuracy rule: quantization is exact arithmetic given y, so against torch_ln.reference.quantize of the op's own y
the codes and the scales must match bit for bit (no tolerance). y itself is the plain norm's output, bit for bit
(the same kernels). Against the reference norm's y (float32 arithmetic in torch ops), y differs by rounding: a code
may then move to a neighbouring one (never further), and a dynamic scale by y's own relative error.
The CUDA kernels run the same checks under the SIMT emulation (tests/emulated/test_emulated.py).
"""

from __future__ import annotations

import pytest
import torch
from norm_cases import DEVICES

import torch_ln
from torch_ln import reference

FORMATS = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
# The relative error of y against the float32 reference: an ulp of the output dtype (the rounding of y) plus
# float32 statistics (float64's reference runs in float64).
Y_RTOL = {torch.float32: 2e-6, torch.float64: 1e-12, torch.float16: 2**-10, torch.bfloat16: 2**-7}

FORMS = ["rms", "layer", "add_rms", "add_layer"]


def _call(form, x, residual, weight, bias, **options):
    """One form with the given quantization options; weight_offset etc. pass through."""
    D = x.shape[-1]
    if form == "rms":
        return torch_ln.rms_norm_quant(x, D, weight, 1e-6, **options)
    if form == "layer":
        return torch_ln.layer_norm_quant(x, D, weight, bias, 1e-5, **options)
    if form == "add_rms":
        return torch_ln.add_rms_norm_quant(x, residual, D, weight, 1e-6, **options)
    return torch_ln.add_layer_norm_quant(x, residual, D, weight, bias, 1e-5, **options)


def _plain(form, x, residual, weight, bias, weight_offset=0.0, round_normalized=False):
    """The unquantized op: (y, residual_out)."""
    D = x.shape[-1]
    if form == "rms":
        return torch_ln.rms_norm(
            x, D, weight, 1e-6, weight_offset=weight_offset, round_normalized=round_normalized
        ), None
    if form == "layer":
        return torch_ln.layer_norm(x, D, weight, bias, 1e-5, weight_offset=weight_offset), None
    if form == "add_rms":
        rounding = {"weight_offset": weight_offset, "round_normalized": round_normalized}
        return torch_ln.add_rms_norm(x, residual, D, weight, 1e-6, **rounding)
    return torch_ln.add_layer_norm(x, residual, D, weight, bias, 1e-5, weight_offset=weight_offset)


def _reference_y(form, x, residual, weight, bias):
    D = [x.shape[-1]]
    if form.startswith("add_"):
        x = (x + residual).to(x.dtype)
    if form.endswith("rms"):
        return reference.rms_norm(x, D, weight, 1e-6)
    return reference.layer_norm(x, D, weight, bias, 1e-5)


def _inputs(M, D, dtype, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, D, generator=g, dtype=torch.float64).to(device, dtype)
    residual = torch.randn(M, D, generator=g, dtype=torch.float64).to(device, dtype)
    weight = (1 + 0.5 * torch.randn(D, generator=g, dtype=torch.float64)).to(device, dtype)
    bias = (0.1 * torch.randn(D, generator=g, dtype=torch.float64)).to(device, dtype)
    return x, residual, weight, bias


def _codes(q: torch.Tensor) -> torch.Tensor:
    """The codes as ordered integers: neighbouring values differ by 1 (float8: sign-magnitude bits; +-0 alike)."""
    bits = q.view(torch.uint8).to(torch.int32) if q.dtype != torch.int8 else q.to(torch.int32)
    if q.dtype == torch.int8:
        return bits
    magnitude = bits & 0x7F
    return torch.where(bits >= 0x80, -magnitude, magnitude)


def assert_codes_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bitwise, NaN codes included."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8)), (
        f"{int((actual.view(torch.uint8) != expected.view(torch.uint8)).sum())} codes differ"
    )


def assert_scales_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    assert torch.equal(actual.view(torch.int32), expected.contiguous().view(torch.int32))


# Scale modes: (options, reference keywords). Group sizes divide every D they meet (the cases below pick them).
def _modes(D, device="cpu"):
    static = torch.tensor([0.0123], dtype=torch.float32, device=device)
    modes = {
        "static": ({"scale": static}, {"scale": static}),
        "per_token": ({}, {}),
        "per_token_ub": ({"scale_ub": 0.5}, {"scale_ub": 0.5}),
    }
    group = next(g for g in (128, 64, 16, 8, 1) if D % g == 0)
    modes["per_group"] = ({"group_size": group}, {"group_size": group})
    modes["per_group_ue8m0_column_major"] = (
        {"group_size": group, "scale_ue8m0": True, "scales_column_major": True},
        {"group_size": group, "scale_ue8m0": True},
    )
    return modes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("out_dtype", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "M, D",
    [
        (1, 1),  # one element: per-token scale of a single value
        (1, 4096),  # decode: one token
        (5, 7),  # odd D: per group means groups of one element (a scale per element)
        (3, 384),  # groups of 128 at 3 per row
        (4, 1000),  # groups of 8 only
        (2, 4099),  # prime D, unaligned rows: groups of one again, and the vector tails
    ],
)
def test_bitwise_against_reference_quantize(device, form, out_dtype, dtype, M, D):
    x, residual, weight, bias = _inputs(M, D, dtype, device=device)
    y_plain, residual_plain = _plain(form, x, residual, weight, bias)
    for name, (options, ref_options) in _modes(D, device).items():
        with torch.no_grad():
            full = _call(form, x, residual, weight, bias, out_dtype=out_dtype, return_unquantized=True, **options)
            quantized_only = _call(form, x, residual, weight, bias, out_dtype=out_dtype, **options)
        # y: the plain op's, bit for bit; q and the scales: quantize(y), bit for bit.
        assert torch.equal(full.y, y_plain), name
        q, scales = reference.quantize(y_plain, 1, out_dtype, **ref_options)
        assert_codes_equal(full.q, q)
        assert_codes_equal(quantized_only.q, q)  # without y asked for, the CPU keeps each row in a per-thread buffer
        assert_scales_equal(full.scale, scales)
        assert_scales_equal(quantized_only.scale, scales)
        assert quantized_only.y is None
        if "static" in name:
            assert full.scale is options["scale"]
        if form.startswith("add_"):
            assert torch.equal(full.residual_out, residual_plain) and torch.equal(
                quantized_only.residual_out, residual_plain
            )
        if options.get("scales_column_major"):
            assert full.scale.stride() == (1, M) or M == 1


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("out_dtype", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_against_reference_norm(device, form, out_dtype, dtype):
    """Against the reference norm's y: codes at most one step apart, scales within y's relative error."""
    x, residual, weight, bias = _inputs(16, 512, dtype, seed=1, device=device)
    y_ref = _reference_y(form, x, residual, weight, bias)
    for group_size in (None, 128):
        with torch.no_grad():
            out = _call(form, x, residual, weight, bias, out_dtype=out_dtype, group_size=group_size)
        q_ref, scales_ref = reference.quantize(y_ref, 1, out_dtype, group_size=group_size)
        assert (_codes(out.q) - _codes(q_ref)).abs().max() <= 1
        torch.testing.assert_close(out.scale, scales_ref, rtol=Y_RTOL[dtype], atol=0)


@pytest.mark.parametrize("out_dtype", FORMATS)
def test_rounding_options_and_mixed_precision(out_dtype):
    """weight_offset, round_normalized, float32 parameters under bfloat16 input, a float32 residual stream."""
    x, residual, weight, bias = _inputs(6, 256, torch.bfloat16, seed=2)
    weight32, bias32 = weight.float() - 1, bias.float()
    with torch.no_grad():
        out = torch_ln.rms_norm_quant(
            x,
            256,
            weight32,
            None,
            out_dtype=out_dtype,
            weight_offset=1.0,
            round_normalized=True,
            return_unquantized=True,
        )
        y = torch_ln.rms_norm(x, 256, weight32, None, weight_offset=1.0, round_normalized=True)
        assert torch.equal(out.y, y)
        assert_codes_equal(out.q, reference.quantize(y, 1, out_dtype)[0])
        out = torch_ln.add_layer_norm_quant(
            x, residual.float(), 256, weight32, bias32, 1e-5, torch.float32, out_dtype=out_dtype, group_size=64,
            weight_offset=1.0,
        )  # fmt: skip
        y, residual_out = torch_ln.add_layer_norm(
            x, residual.float(), 256, weight32, bias32, 1e-5, torch.float32, weight_offset=1.0
        )
        assert torch.equal(out.residual_out, residual_out) and residual_out.dtype == torch.float32
        q, scales = reference.quantize(y, 1, out_dtype, group_size=64)
        assert_codes_equal(out.q, q)
        assert_scales_equal(out.scale, scales)


def test_leading_dims_and_normalized_shape():
    """Scales keep the input's leading shape; several normalized dims are one row."""
    x = torch.randn(2, 3, 4, 32)
    with torch.no_grad():
        out = torch_ln.rms_norm_quant(x, (4, 32), group_size=32, return_unquantized=True)
    assert out.q.shape == x.shape and out.scale.shape == (2, 3, 4)
    q, scales = reference.quantize(out.y, 2, torch.float8_e4m3fn, group_size=32)
    assert_codes_equal(out.q, q)
    assert_scales_equal(out.scale, scales)


# Edge rows. Each through rms_norm_quant without weight (y = x * rstd) unless said otherwise.


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", FORMATS)
def test_all_zero_row(device, out_dtype):
    """An all-zero row (a padding token): amax 0, so the scale is the floor 1 / (qmax * 512), not a division by 0,
    and every code is 0."""
    x = torch.zeros(2, 64, device=device)
    with torch.no_grad():
        out = torch_ln.rms_norm_quant(x, 64, out_dtype=out_dtype)
    assert torch.equal(out.scale.cpu(), torch.full((2, 1), reference.min_dynamic_scale(out_dtype)))
    assert not out.q.view(torch.uint8).any()


@pytest.mark.parametrize("out_dtype", FORMATS)
def test_outlier_row(out_dtype):
    """One huge value: it alone sets the per-token scale (quantized to +-qmax), the rest round toward zero; per
    group, only its own group is affected."""
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(3))
    x[0, 5] = 1e4
    with torch.no_grad():
        per_token = torch_ln.rms_norm_quant(x, 256, out_dtype=out_dtype, return_unquantized=True)
        per_group = torch_ln.rms_norm_quant(x, 256, out_dtype=out_dtype, group_size=128)
    qmax = reference.QUANT_MAX[out_dtype]
    assert per_token.q[0, 5].float() == qmax
    assert_codes_equal(per_token.q, reference.quantize(per_token.y, 1, out_dtype)[0])
    assert per_group.scale[0, 0] > 100 * per_group.scale[0, 1]
    assert_codes_equal(per_group.q, reference.quantize(per_token.y, 1, out_dtype, group_size=128)[0])


@pytest.mark.parametrize("out_dtype", FORMATS)
def test_static_scale_saturates(out_dtype):
    """A static scale too small for the row: values beyond +-qmax saturate to it (float8_e4m3fn has no inf; a cast
    without the clamp would give NaN)."""
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4))
    scale = torch.tensor([1e-6])  # |y| up to ~3: up to 3e6, beyond even float8_e5m2's 57344
    with torch.no_grad():
        out = torch_ln.rms_norm_quant(x, 128, out_dtype=out_dtype, scale=scale, return_unquantized=True)
    qmax = reference.QUANT_MAX[out_dtype]
    values = out.q.float()
    assert values.abs().max() == qmax and not values.isnan().any()
    assert (values.abs() == qmax).sum() > 100
    assert_codes_equal(out.q, reference.quantize(out.y, 1, out_dtype, scale=scale)[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", FORMATS)
@pytest.mark.parametrize("bad", ["nan", "inf"])
def test_nan_and_inf_propagate(device, out_dtype, bad):
    """A NaN or inf in x: the row's y has NaN (x - mean: inf - inf), so its amax and dynamic scale are NaN and its
    codes NaN in float8, 0 in int8, as reference.quantize says. Other rows are untouched."""
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(5))
    x[1, 7] = float(bad)
    x = x.to(device)
    static_scale = torch.tensor([0.01], device=device)
    with torch.no_grad():
        dynamic = torch_ln.layer_norm_quant(x, 64, out_dtype=out_dtype, return_unquantized=True)
        static = torch_ln.layer_norm_quant(x, 64, out_dtype=out_dtype, scale=static_scale)
    assert dynamic.y[1].isnan().all() and not dynamic.y[[0, 2]].isnan().any()
    assert dynamic.scale[1].isnan().all() and not dynamic.scale[[0, 2]].isnan().any()
    assert_codes_equal(dynamic.q, reference.quantize(dynamic.y, 1, out_dtype)[0])
    assert_codes_equal(static.q, reference.quantize(dynamic.y, 1, out_dtype, scale=static_scale)[0])
    if out_dtype == torch.int8:
        assert not dynamic.q[1].any()
    else:
        assert dynamic.q[1].float().isnan().all()


def _ties(out_dtype: torch.dtype) -> torch.Tensor:
    """Every representable value of the format, the midpoints between neighbours (ties: round to even) and the
    floats one ulp either side of each midpoint, both signs: the whole rounding table of the conversion."""
    if out_dtype == torch.int8:
        codes = torch.arange(-127, 128, dtype=torch.float32)
    else:
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(out_dtype).float()
        codes = codes[codes.isfinite() & (codes >= 0)].sort().values
    mids = (codes[1:] + codes[:-1]) / 2  # exact in float32
    near = torch.cat([torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    values = torch.cat([codes, mids, near])
    return torch.cat([values, -values])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", FORMATS)
def test_conversion_rounds_every_tie_as_torch(device, out_dtype):
    """y set exactly through the weight (x = ones, eps = 0: rstd = 1, y = weight) and a static scale of 1: every
    code, midpoint and near-midpoint of the format converts as torch's cast, NaN included (regression guard for the
    branchless conversion, csrc/quantize.h float8_code)."""
    values = torch.cat([_ties(out_dtype), torch.tensor([float("nan"), 0.0, -0.0, 1e-30, -1e-30])])
    x = torch.ones(1, values.numel(), device=device)
    with torch.no_grad():
        out = torch_ln.rms_norm_quant(
            x, values.numel(), values.to(device), 0.0, out_dtype=out_dtype, scale=torch.ones(1, device=device),
            return_unquantized=True,
        )  # fmt: skip
    assert torch.equal(out.y.cpu().view(torch.int32), values.view(1, -1).view(torch.int32))
    assert_codes_equal(out.q.cpu(), reference.quantize(values.view(1, -1), 1, out_dtype, scale=torch.ones(1))[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", FORMATS)
def test_nan_in_one_column_reaches_the_group_through_its_scale(device, out_dtype):
    """A NaN weight: y is NaN in that column only, the group's amax and scale are NaN, and every other element of
    the group becomes finite * NaN: its code carries the scale's NaN (sign included) as torch's arithmetic gives it.
    Regression guard for the vectorized amax (a vector maximum's NaN has the sign bit set; fold_abs_max's has not)."""
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(8), device=device)
    weight = torch.ones(256, device=device)
    weight[3] = float("nan")
    with torch.no_grad():
        for group_size in (None, 128):
            out = torch_ln.rms_norm_quant(
                x, 256, weight, out_dtype=out_dtype, group_size=group_size, return_unquantized=True
            )
            q, scales = reference.quantize(out.y, 1, out_dtype, group_size=group_size)
            assert_codes_equal(out.q, q)
            assert_scales_equal(out.scale, scales)


def test_ue8m0_scales_are_powers_of_two():
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        plain = torch_ln.rms_norm_quant(x, 256, group_size=128)
        rounded = torch_ln.rms_norm_quant(x, 256, group_size=128, scale_ue8m0=True)
    mantissa, _ = torch.frexp(rounded.scale)
    assert (mantissa == 0.5).all()
    assert (rounded.scale >= plain.scale).all() and (rounded.scale < 2 * plain.scale).all()


def test_power_of_two_ceil_is_exact():
    """Regression for the reference: log2 + ceil rounds 4 * (1 + 2^-23) down to 4."""
    s = torch.tensor([4.0, 4.0 * (1 + 2**-23), 3.0, float("inf")])
    assert torch.equal(reference.power_of_two_ceil(s), torch.tensor([4.0, 8.0, 4.0, float("inf")]))


def test_deterministic_and_batch_invariant():
    """A row's codes and scales do not depend on the call or on the rows around it."""
    x = torch.randn(64, 1024, generator=torch.Generator().manual_seed(7), dtype=torch.bfloat16)
    with torch.no_grad():
        whole = torch_ln.rms_norm_quant(x, 1024, group_size=128)
        again = torch_ln.rms_norm_quant(x, 1024, group_size=128)
        one = torch_ln.rms_norm_quant(x[37:38], 1024, group_size=128)
    assert_codes_equal(whole.q, again.q)
    assert_codes_equal(whole.q[37:38], one.q)
    assert_scales_equal(whole.scale[37:38], one.scale)


def test_strided_input_reads_in_place_and_matches():
    x = torch.randn(8, 2 * 256)[:, :256]
    with torch.no_grad():
        strided = torch_ln.rms_norm_quant(x, 256, group_size=128)
        copied = torch_ln.rms_norm_quant(x.contiguous(), 256, group_size=128)
    assert_codes_equal(strided.q, copied.q)
    assert_scales_equal(strided.scale, copied.scale)


def test_no_rows():
    with torch.no_grad():
        out = torch_ln.rms_norm_quant(torch.empty(0, 64), 64, group_size=32, scales_column_major=True)
    assert out.q.shape == (0, 64) and out.scale.shape == (0, 2)


# Errors: each names the argument, what was expected and what came.


@pytest.mark.parametrize(
    "options, error, match",
    [
        ({"out_dtype": torch.float16}, TypeError, r"expected out_dtype torch.float8_e4m3fn.*got out_dtype=Half"),
        ({"scale": torch.ones(2)}, ValueError, r"expected scale to have one element.*scale.shape=\[2\]"),
        ({"scale": torch.ones(1, dtype=torch.float16)}, TypeError, r"expected scale of dtype float32.*Half"),
        (
            {"group_size": 0},
            ValueError,
            r"group_size to be a positive divisor of the normalized size 128.*got group_size=0",
        ),
        ({"group_size": 100}, ValueError, r"normalized size 128, but got group_size=100"),
        ({"scale": torch.ones(1), "group_size": 64}, ValueError, r"either scale .* or group_size .* got both"),
        ({"scale": torch.ones(1), "scale_ub": 1.0}, ValueError, r"scale_ub, scale_ue8m0 and scales_column_major"),
        ({"scale_ub": 0.0}, ValueError, r"expected scale_ub > 0, but got scale_ub=0"),
    ],
)
def test_errors_name_the_argument(options, error, match):
    with torch.no_grad(), pytest.raises(error, match=match):
        torch_ln.rms_norm_quant(torch.randn(2, 128), 128, **options)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a scale on another device needs a GPU")
def test_scale_on_another_device():
    with torch.no_grad(), pytest.raises(ValueError, match=r"expected scale on the input's device"):
        torch_ln.rms_norm_quant(torch.randn(2, 128, device="cuda"), 128, scale=torch.ones(1))


@pytest.mark.parametrize("form", FORMS)
def test_requires_grad_is_an_error(form):
    x, residual, weight, bias = _inputs(2, 64, torch.float32)
    weight.requires_grad_()
    with pytest.raises(RuntimeError, match=r"inference-only .* an input requires grad"):
        _call(form, x, residual, weight, bias)
    with torch.no_grad():
        _call(form, x, residual, weight, bias)  # fine without grad mode
    with torch.inference_mode():
        _call(form, x, residual, weight, bias)


# torch.library, torch.compile, export.


def _op_cases():
    x, residual, weight, bias = _inputs(4, 256, torch.bfloat16)
    static = torch.tensor([0.02])
    quant = {"out_dtype": torch.float8_e4m3fn}
    yield torch.ops.torch_ln.rms_norm_quant.default, (x, [256], weight, None), quant
    yield torch.ops.torch_ln.rms_norm_quant.default, (x, [256], weight, None), {**quant, "scale": static}
    yield (
        torch.ops.torch_ln.layer_norm_quant.default,
        (x, [256], weight, bias, 1e-5),
        {"out_dtype": torch.int8, "group_size": 64, "scales_column_major": True, "return_unquantized": True},
    )
    yield (
        torch.ops.torch_ln.add_rms_norm_quant.default,
        (x, residual.float(), [256], weight, None, torch.float32),
        {"out_dtype": torch.float8_e5m2, "group_size": 128, "scale_ue8m0": True},
    )
    yield torch.ops.torch_ln.add_layer_norm_quant.default, (x, residual, [256], weight, bias, 1e-5, None), quant


@pytest.mark.parametrize("case", range(5))
def test_opcheck(case):
    op, args, kwargs = list(_op_cases())[case]
    torch.library.opcheck(op, args, kwargs)


@pytest.mark.parametrize("group_size", [None, 64])
def test_compile_fullgraph_dynamic(group_size):
    def block(x, residual, weight):
        out = torch_ln.add_rms_norm_quant(x, residual, 256, weight, group_size=group_size, return_unquantized=True)
        return out.q, out.scale, out.y, out.residual_out

    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    with torch.no_grad():
        for M in (3, 17):
            x, residual, weight, _ = _inputs(M, 256, torch.bfloat16)
            for actual, expected in zip(compiled(x, residual, weight), block(x, residual, weight)):
                assert torch.equal(actual.view(torch.uint8), expected.view(torch.uint8))


def test_export():
    module = torch_ln.RMSNormQuant(256, eps=1e-6, scale_mode="static").eval()
    module.scale.fill_(0.05)
    x = torch.randn(4, 256)
    with torch.no_grad():
        exported = torch.export.export(module, (x,))
        actual, expected = exported.module()(x), module(x)
    assert_codes_equal(actual.q, expected.q)
    assert "torch_ln.rms_norm_quant" in str(exported.graph)


# Modules.


def test_module_static_scale_loads_from_state_dict():
    source = torch_ln.RMSNormQuant(128, scale_mode="static", out_dtype=torch.int8)
    source.scale.fill_(0.03)
    with torch.no_grad():
        source.weight.uniform_(0.5, 1.5)
    state = source.state_dict()
    assert set(state) == {"weight", "scale"}
    target = torch_ln.RMSNormQuant(128, scale_mode="static", out_dtype=torch.int8)
    target.load_state_dict(state)
    x = torch.randn(5, 128)
    with torch.no_grad():
        out = target(x)
        expected = torch_ln.rms_norm_quant(x, 128, source.weight, out_dtype=torch.int8, scale=torch.tensor([0.03]))
    assert_codes_equal(out.q, expected.q)
    assert torch.equal(out.scale, torch.tensor([0.03]))


def test_module_dynamic_has_no_scale_buffer_and_takes_a_residual():
    module = torch_ln.LayerNormQuant(256, scale_mode="per_group", group_size=64, residual_dtype=torch.float32)
    assert set(module.state_dict()) == {"weight", "bias"}
    x, residual, _, _ = _inputs(3, 256, torch.float32)
    with torch.no_grad():
        out = module(x, residual)
        expected = torch_ln.add_layer_norm_quant(x, residual, 256, module.weight, module.bias, group_size=64)
    assert_codes_equal(out.q, expected.q)
    assert torch.equal(out.residual_out, expected.residual_out)
    assert "scale_mode='per_group', group_size=64" in repr(module)


def test_module_bad_scale_mode():
    with pytest.raises(ValueError, match=r"expected scale_mode to be one of .* got scale_mode='per_row'"):
        torch_ln.RMSNormQuant(64, scale_mode="per_row")


def test_scaled_mm_consumes_the_output():
    """The README's example: an fp8 linear fed by add_rms_norm_quant through torch._scaled_mm, on the CPU where this
    torch supports it."""
    x, residual, weight, _ = _inputs(16, 128, torch.bfloat16)
    w = torch.randn(64, 128, dtype=torch.bfloat16)
    w_scale = w.abs().amax().float() / 448
    w_fp8 = (w.float() / w_scale).to(torch.float8_e4m3fn)
    with torch.no_grad():
        out = torch_ln.add_rms_norm_quant(x, residual, 128, weight, scale=torch.tensor([0.02]))
        try:
            result = torch._scaled_mm(
                out.q, w_fp8.t(), scale_a=out.scale, scale_b=w_scale.reshape(1), out_dtype=torch.bfloat16
            )
        except (RuntimeError, NotImplementedError) as e:  # a torch without CPU fp8 GEMMs: say so, do not pass
            pytest.xfail(f"torch._scaled_mm is not available on this CPU build: {e}")
    expected = (out.q.float() * 0.02) @ (w_fp8.float() * w_scale).t()
    torch.testing.assert_close(result.float(), expected, rtol=2**-7, atol=1e-2)
