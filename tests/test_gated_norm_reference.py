"""torch_ln.reference.gated_rms_norm against every gated RMSNorm class of the pinned transformers, bit for bit: the
forms that the gated kernels and replace_norms' swap of these classes follow (tests/test_gated_norm.py).
Five forms (the classes of one form compute bit-identical outputs):
- Mamba2's: gate before the norm, grouped, rounded to x's dtype before the weight product, no final cast;
- FalconH1's: float32 throughout, either gate position, grouped;
- Qwen3-Next's: gate after, rounded before the weight product, the gate's product in float32, a final cast;
- GLM5-Next's: float32 throughout, sigmoid gate after the norm;
- AXK2GatedRMSNorm: no gate argument; its gate is an MLP of the norm's own output (a Llama RMSNorm, then a matmul
  chain), so it is no gated-norm form: not tested here.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers

from torch_ln import reference

D, GROUP = 64, 16  # four groups of 16 in a row, for the grouped forms

# model_dir.ClassName -> (constructor arguments, reference.gated_rms_norm's keyword arguments).
MAMBA2 = (
    {"hidden_size": D, "group_size": GROUP},
    {"gate_position": "before", "group_size": GROUP, "round_normalized": True},
)
QWEN3_NEXT = ({"hidden_size": D}, {"gate_position": "after", "round_normalized": True})
GLM5_NEXT = ({"hidden_size": D}, {"gate_position": "after", "activation": "sigmoid"})
CLASSES = {
    "mamba2.MambaRMSNormGated": MAMBA2,
    "zamba2.Zamba2RMSNormGated": MAMBA2,
    "nemotron_h.NemotronHRMSNormGated": MAMBA2,
    "bamba.BambaRMSNormGated": MAMBA2,
    "granitemoehybrid.GraniteMoeHybridRMSNormGated": MAMBA2,
    "falcon_h1.FalconH1RMSNormGated": ({"hidden_size": D, "n_groups": D // GROUP}, {"group_size": GROUP}),
    "falcon_h1.FalconH1RMSNormGated/gate before": (
        {"hidden_size": D, "n_groups": D // GROUP, "norm_before_gate": False},
        {"gate_position": "before", "group_size": GROUP},
    ),
    "qwen3_next.Qwen3NextRMSNormGated": QWEN3_NEXT,
    "qwen3_5.Qwen3_5RMSNormGated": QWEN3_NEXT,
    "qwen3_5_moe.Qwen3_5MoeRMSNormGated": QWEN3_NEXT,
    "olmo_hybrid.OlmoHybridRMSNormGated": QWEN3_NEXT,
    "qwen4_exp.Qwen4ExpTextRMSNormGated": QWEN3_NEXT,
    "qwen4_exp.Qwen4ExpTextRMSNormGated/sigmoid": (
        {"hidden_size": D, "activation": "sigmoid"},
        {"gate_position": "after", "activation": "sigmoid", "round_normalized": True},
    ),
    "glm5_next.Glm5NextTextRMSNormGated": GLM5_NEXT,
    "kimi_linear.KimiLinearRMSNormGated": GLM5_NEXT,
    "bailing_hybrid.BailingHybridRMSNormGated": GLM5_NEXT,
}
# The forms whose gate may be None (a plain, possibly grouped, RMSNorm then).
OPTIONAL_GATE = {
    "MambaRMSNormGated",
    "Zamba2RMSNormGated",
    "NemotronHRMSNormGated",
    "BambaRMSNormGated",
    "GraniteMoeHybridRMSNormGated",
    "FalconH1RMSNormGated",
}


def _class(name: str) -> type:
    model, cls = name.split("/")[0].split(".")
    return getattr(importlib.import_module(f"transformers.models.{model}.modeling_{model}"), cls)


pytestmark = pytest.mark.skipif(transformers.__version__ != "5.23.0", reason="the pinned transformers' classes")


@pytest.mark.parametrize("name", CLASSES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("weight_dtype", ["input", torch.float32])  # a model cast to dtype, or float32 weights
def test_reference_is_the_class_bit_for_bit(name, dtype, weight_dtype):
    constructor, form = CLASSES[name]
    norm = _class(name)(**constructor, eps=1e-6)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D, generator=g))
    norm = norm.to(dtype if weight_dtype == "input" else weight_dtype)
    # [batch, seq, D], the classes' shape (FalconH1 takes 2 or 3 dims); values of several magnitudes.
    x = (torch.randn(2, 5, D, generator=g) * torch.logspace(-2, 2, D)).to(dtype)
    z = (torch.randn(2, 5, D, generator=g) * 3).to(dtype)
    gates = [z, None] if _class(name).__name__ in OPTIONAL_GATE else [z]
    for gate in gates:
        expected = norm(x, gate)
        got = reference.gated_rms_norm(x, gate, norm.weight, 1e-6, **form)
        assert got.dtype == expected.dtype
        assert torch.equal(got, expected), (gate is None, (got.float() - expected.float()).abs().max())


def test_every_swapped_gated_class_has_a_form():
    """Every gated class of the pinned transformers has its form here but AXK2's, which test_transformers_norm_classes
    lists as not swapped."""
    from test_transformers_norm_classes import NOT_SWAPPED, _norm_classes

    gated = {name for name in _norm_classes() if "Gated" in name}
    assert gated - {name.split("/")[0] for name in CLASSES} == {"axk2.AXK2GatedRMSNorm"}
    assert NOT_SWAPPED["axk2.AXK2GatedRMSNorm"] == "gated"
