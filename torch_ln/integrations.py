"""torch_ln for the norm classes of Hugging Face transformers and timm, rounding as each class does.

:func:`torch_ln.replace_norms` recognizes a transformers norm class by its arithmetic: the source of its
``forward`` (and ``_norm``) must be identical, docstrings and annotations aside, to that of one of the
reference classes below, read from the installed transformers. About 140 classes share LlamaRMSNorm's,
a dozen GemmaRMSNorm's. timm's ``LayerNorm`` and ``LayerNorm2d`` are registered by class. Neither library
is imported here: a class is looked at when a model holding it is swapped, or when
:func:`patch_transformers` is called.

Each family's forward runs torch_ln's kernels with the rounding options that reproduce the class:

- Llama-style RMSNorm (``weight * normed.to(input_dtype)``): ``round_normalized=True``.
- Gemma-style RMSNorm (``(normed * (1 + weight.float())).type_as(x)``): ``weight_offset=1``.
- T5LayerNorm: Llama's rounding when weight and input share a half/bfloat16 (or float32) dtype.
- Cohere-style LayerNorm (float32 statistics, no bias): torch_ln's layer_norm as it is.
- Gemma3n-style RMSNorm (``pow(-0.5)``, the optional weight product in float32): torch_ln's rms_norm as it is.
- The gated RMSNorms (Mamba2's, FalconH1's, Qwen3-Next's, GLM5-Next's forms): torch_ln's gated_rms_norm with the
  gate position, groups and rounding of each (reference.gated_rms_norm documents the forms); CPU input only for now.

timm's LayerNorm, LayerNorm2d, LayerNormFp32, RmsNorm and RmsNorm2d are registered by class; RmsNorm and RmsNorm2d
compute in the input's dtype, so their half-precision input takes the class's own forward.

Where the output dtype is promoted (a float32 weight with half input gives float32 output in Llama and T5,
as under autocast) the kernel normalizes and ``weight * normed`` runs in torch, which is exactly the
class's own product. A 2-D Cohere weight (per-head QK-norm) is applied the same way. Inputs the classes
compute in float32 though they are float64 (all four do) go to the class's own forward.
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import sys
import textwrap
from collections.abc import Iterator

import torch
from torch import Tensor

from torch_ln import ops, reference
from torch_ln.modules import _RESOLVERS, Converter, converter_for, forward_converter, register_norm

__all__ = ["FAMILIES", "arithmetic_signature", "patch_transformers", "swappable", "tiny_llama_config"]

_REDUCED = (torch.float16, torch.bfloat16)


def _original_forward(module, *args) -> Tensor:
    """The swapped module's own class's forward: the cases the kernels do not reproduce."""
    return type(module).__mro__[1].forward(module, *args)


def _kernel_computes(module, x: Tensor) -> bool:
    """The families normalize the last dimension in float32; float64 input they round to float32 first."""
    return x.dtype in (torch.float32, *_REDUCED) and module.weight.dim() == 1 and module.weight.shape[0] == x.shape[-1]


def llama_rms_norm_forward(self, hidden_states: Tensor) -> Tensor:
    """LlamaRMSNorm: float32 normalization rounded to the input dtype, then the weight product in its dtype."""
    weight = self.weight
    if not _kernel_computes(self, hidden_states):
        return _original_forward(self, hidden_states)
    if weight.dtype == hidden_states.dtype:
        return ops.rms_norm(hidden_states, weight.shape, weight, self.variance_epsilon, round_normalized=True)
    # Promoted output: the kernel's rounding to the input dtype is the class's, the product is torch's own.
    return weight * ops.rms_norm(hidden_states, weight.shape, None, self.variance_epsilon)


def gemma_rms_norm_forward(self, x: Tensor) -> Tensor:
    """GemmaRMSNorm: (1 + weight) in float32, the product in float32, one rounding to the input dtype."""
    weight = self.weight
    if not _kernel_computes(self, x):
        return _original_forward(self, x)
    # Any other weight dtype is converted exactly to float32, which the kernel takes with any input.
    kernel_weight = weight if weight.dtype == x.dtype else weight.float()
    return ops.rms_norm(x, weight.shape, kernel_weight, self.eps, weight_offset=1.0)


def t5_layer_norm_forward(self, hidden_states: Tensor) -> Tensor:
    """T5LayerNorm: float32 normalization, rounded to the weight's dtype only if that is half/bfloat16."""
    weight = self.weight
    if not _kernel_computes(self, hidden_states):
        return _original_forward(self, hidden_states)
    if weight.dtype == hidden_states.dtype:
        return ops.rms_norm(hidden_states, weight.shape, weight, self.variance_epsilon, round_normalized=True)
    normed = ops.rms_norm(hidden_states.float(), weight.shape, None, self.variance_epsilon)
    return weight * (normed.to(weight.dtype) if weight.dtype in _REDUCED else normed)


def cohere_layer_norm_forward(self, hidden_states: Tensor) -> Tensor:
    """CohereLayerNorm: LayerNorm without bias, statistics and the weight product in float32, one rounding."""
    weight, eps = self.weight, self.variance_epsilon
    if hidden_states.dtype not in (torch.float32, *_REDUCED) or weight.shape[-1] != hidden_states.shape[-1]:
        return _original_forward(self, hidden_states)
    if weight.dim() == 1:
        kernel_weight = weight if weight.dtype == hidden_states.dtype else weight.float()
        return ops.layer_norm(hidden_states, weight.shape, kernel_weight, None, eps)
    # Per-head weight [heads, head_dim]: the kernel normalizes each head's row, the product is torch's.
    normed = ops.layer_norm(hidden_states.float(), weight.shape[-1:], None, None, eps)
    return (weight.float() * normed).to(hidden_states.dtype)


def gemma3n_rms_norm_forward(self, hidden_states: Tensor) -> Tensor:
    """Gemma3nRMSNorm: float32 normalization (rstd as pow(mean + eps, -0.5)), the optional weight product
    (``with_scale``) in float32, one rounding to the input dtype: torch_ln's rms_norm with a float32 weight."""
    weight = self.weight if self.with_scale else None
    if hidden_states.dtype not in (torch.float32, *_REDUCED) or (
        weight is not None and (weight.dim() != 1 or weight.shape[0] != hidden_states.shape[-1])
    ):
        return _original_forward(self, hidden_states)
    kernel_weight = weight if weight is None or weight.dtype == hidden_states.dtype else weight.float()
    return ops.rms_norm(hidden_states, hidden_states.shape[-1:], kernel_weight, self.eps)


def timm_layer_norm_forward(self, x: Tensor) -> Tensor:
    """timm.layers.LayerNorm: F.layer_norm (timm's optional fast-norm path is superseded)."""
    return ops.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


def timm_layer_norm_2d_forward(self, x: Tensor) -> Tensor:
    """timm.layers.LayerNorm2d: channels of NCHW normalized through a permuted view (a channels-last input
    is read in place; any other is made contiguous by the operator), the output permuted back."""
    normed = ops.layer_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps)
    return normed.permute(0, 3, 1, 2)


def timm_layer_norm_fp32_forward(self, x: Tensor) -> Tensor:
    """timm.layers.LayerNormFp32: F.layer_norm of the input and parameters in float32, rounded once to the input's
    dtype, which the kernels compute from half or bfloat16 input directly (parameters of another dtype than the
    input's converted exactly to float32); float64 input, which the class rounds to float32, takes its forward."""
    if x.dtype not in (torch.float32, *_REDUCED):
        return _original_forward(self, x)
    params = (self.weight, self.bias)
    if any(p is not None and p.dtype != x.dtype for p in params):
        params = tuple(p.float() if p is not None else None for p in params)
    return ops.layer_norm(x, self.normalized_shape, *params, self.eps)


def _timm_rms_norm_computes(module, x: Tensor) -> bool:
    """timm's RmsNorm and RmsNorm2d compute in the input's dtype. The kernels do the same in float32 and float64
    (statistics accumulated in that dtype); half input the class rounds x^2, their mean and rstd to half precision,
    which the kernels' float32 statistics do not reproduce: it takes the class's forward, as does a weight of
    another dtype (the class's product promotes)."""
    weight = module.weight
    return x.dtype in (torch.float32, torch.float64) and (weight is None or weight.dtype == x.dtype)


def timm_rms_norm_forward(self, x: Tensor) -> Tensor:
    """timm.layers.RmsNorm: x * rsqrt(mean(x^2) + eps) * weight, in the input's dtype."""
    if not _timm_rms_norm_computes(self, x):
        return _original_forward(self, x)
    return ops.rms_norm(x, self.normalized_shape, self.weight, self.eps)


def timm_rms_norm_2d_forward(self, x: Tensor) -> Tensor:
    """timm.layers.RmsNorm2d: RmsNorm over the channels of NCHW, through a permuted view as LayerNorm2d."""
    if not _timm_rms_norm_computes(self, x):
        return _original_forward(self, x)
    return ops.rms_norm(x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.eps).permute(0, 3, 1, 2)


def _gated_kernel_computes(module, x: Tensor, gate: Tensor | None) -> bool:
    """The gated classes compute in float32 from float32/half/bfloat16 input, with a gate of the input's shape, which
    the kernels take in the input's dtype: a gate of it, or float32 input with a half/bfloat16 gate (converted
    exactly, as the classes do; Mamba2's scan hands its norm such a pair in bfloat16 models)."""
    return _kernel_computes(module, x) and (
        gate is None or (gate.shape == x.shape and (gate.dtype == x.dtype or x.dtype == torch.float32))
    )


def _kernel_gate(x: Tensor, gate: Tensor | None) -> Tensor | None:
    """The gate in x's dtype (an exact conversion where _gated_kernel_computes allows one)."""
    return gate if gate is None else gate.to(x.dtype)


def mamba_rms_norm_gated_forward(self, hidden_states: Tensor, gate: Tensor | None = None) -> Tensor:
    """MambaRMSNormGated (Mamba2, Zamba2, NemotronH, Bamba, GraniteMoeHybrid): gate before the norm, groups of
    group_size, the normalized value rounded to the input dtype, then the weight product in the promoted dtype and no
    final cast."""
    weight = self.weight
    if not _gated_kernel_computes(self, hidden_states, gate):
        return _original_forward(self, hidden_states, gate)
    options = {"gate_position": "before", "group_size": self.group_size, "round_normalized": True}
    gate, eps = _kernel_gate(hidden_states, gate), self.variance_epsilon
    if weight.dtype == hidden_states.dtype:
        return ops.gated_rms_norm(hidden_states, gate, weight.shape, weight, eps, **options)
    # Promoted output: the kernel's rounding to the input dtype is the class's, the product is torch's own.
    return weight * ops.gated_rms_norm(hidden_states, gate, weight.shape, None, eps, **options)


def _gated_kernel_forward(self, hidden_states: Tensor, gate: Tensor | None, **options) -> Tensor:
    """gated_rms_norm with the class's eps and a weight the kernels take (of the input's dtype, else converted exactly
    to float32: the float32 forms multiply by it in float32), or the class's forward where the kernels do not
    compute it."""
    if options.get("activation", "silu") not in reference.GATE_ACTIVATIONS or not _gated_kernel_computes(
        self, hidden_states, gate
    ):
        return _original_forward(self, hidden_states, gate)
    weight = self.weight if self.weight.dtype == hidden_states.dtype else self.weight.float()
    gate = _kernel_gate(hidden_states, gate)
    return ops.gated_rms_norm(hidden_states, gate, weight.shape, weight, self.variance_epsilon, **options)


def falcon_h1_rms_norm_gated_forward(self, hidden_states: Tensor, gate: Tensor | None = None) -> Tensor:
    """FalconH1RMSNormGated: float32 throughout, n_groups groups, the gate after the norm (norm_before_gate, the
    default) or before it, one rounding to the input dtype. The class takes 2-D and 3-D input."""
    if hidden_states.dim() not in (2, 3):
        return _original_forward(self, hidden_states, gate)
    position = "after" if self.norm_before_gate else "before"
    group_size = hidden_states.shape[-1] // self.n_groups
    return _gated_kernel_forward(self, hidden_states, gate, gate_position=position, group_size=group_size)


def qwen3_next_rms_norm_gated_forward(self, hidden_states: Tensor, gate: Tensor) -> Tensor:
    """Qwen3NextRMSNormGated (Qwen3.5, Qwen3.5-MoE, OLMo-hybrid, Qwen4Exp): the normalized value rounded to the
    input dtype, the weight product in the promoted dtype, then times act(gate) in float32, one final rounding."""
    return _gated_kernel_forward(self, hidden_states, gate, activation=self.activation, round_normalized=True)


def glm5_next_rms_norm_gated_forward(self, hidden_states: Tensor, gate: Tensor | None = None) -> Tensor:
    """Glm5NextTextRMSNormGated (Kimi-Linear, BailingHybrid): float32 throughout, times act(gate) (sigmoid in these
    models) after the norm, one rounding."""
    return _gated_kernel_forward(self, hidden_states, gate, activation=self.activation)


# transformers families: the reference class whose arithmetic defines the family, and the converter.
FAMILIES: dict[str, tuple[str, str, forward_converter]] = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaRMSNorm", forward_converter(llama_rms_norm_forward)),
    "gemma": ("transformers.models.gemma.modeling_gemma", "GemmaRMSNorm", forward_converter(gemma_rms_norm_forward)),
    "t5": ("transformers.models.t5.modeling_t5", "T5LayerNorm", forward_converter(t5_layer_norm_forward)),
    "cohere": (
        "transformers.models.cohere.modeling_cohere",
        "CohereLayerNorm",
        forward_converter(cohere_layer_norm_forward),
    ),
    "gemma3n": (
        "transformers.models.gemma3n.modeling_gemma3n",
        "Gemma3nRMSNorm",
        forward_converter(gemma3n_rms_norm_forward),
    ),
    "mamba2 gated": (
        "transformers.models.mamba2.modeling_mamba2",
        "MambaRMSNormGated",
        forward_converter(mamba_rms_norm_gated_forward),
    ),
    "falcon_h1 gated": (
        "transformers.models.falcon_h1.modeling_falcon_h1",
        "FalconH1RMSNormGated",
        forward_converter(falcon_h1_rms_norm_gated_forward),
    ),
    "qwen3_next gated": (
        "transformers.models.qwen3_next.modeling_qwen3_next",
        "Qwen3NextRMSNormGated",
        forward_converter(qwen3_next_rms_norm_gated_forward),
    ),
    "glm5_next gated": (
        "transformers.models.glm5_next.modeling_glm5_next",
        "Glm5NextTextRMSNormGated",
        forward_converter(glm5_next_rms_norm_gated_forward),
    ),
}

_TIMM_CLASSES = {
    "LayerNorm": forward_converter(timm_layer_norm_forward),
    "LayerNorm2d": forward_converter(timm_layer_norm_2d_forward),
    "LayerNormFp32": forward_converter(timm_layer_norm_fp32_forward),
    "RmsNorm": forward_converter(timm_rms_norm_forward),
    "RmsNorm2d": forward_converter(timm_rms_norm_2d_forward),
}

# What decides a class's arithmetic: these methods, if it defines them.
_ARITHMETIC_METHODS = ("forward", "_norm")


def arithmetic_signature(cls: type) -> str | None:
    """The AST of the class's forward (and _norm), docstrings and annotations removed, from its source file
    (so a forward replaced at run time, e.g. by the kernel hub, does not hide the class's own); None if the
    source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return None
    return class_signature(tree.body[0]) if tree.body and isinstance(tree.body[0], ast.ClassDef) else None


def class_signature(class_def: ast.ClassDef) -> str | None:
    """arithmetic_signature of a parsed class definition."""
    methods = {}
    for node in class_def.body:
        if isinstance(node, ast.FunctionDef) and node.name in _ARITHMETIC_METHODS:
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]
            node.body, node.returns, node.decorator_list = body, None, []
            for arg in node.args.args:
                arg.annotation = None
            methods[node.name] = ast.dump(node)
    return repr(sorted(methods.items())) if "forward" in methods else None


_family_signatures: dict[str, str] = {}


def _families_by_signature() -> dict[str, str]:
    """Reference signature -> family name, the reference classes imported on first use."""
    if not _family_signatures:
        for family, (module_name, class_name, converter) in FAMILIES.items():
            cls = getattr(importlib.import_module(module_name), class_name)
            register_norm(cls, converter)
            signature = arithmetic_signature(cls)
            if signature is not None:
                _family_signatures[signature] = family
    return _family_signatures


def _resolve(cls: type) -> Converter | None:
    """The converter of a transformers or timm class this module knows, or None."""
    module = cls.__module__ or ""
    if module.startswith("timm.") and "timm" in sys.modules:
        layers = importlib.import_module("timm.layers")
        for name, converter in _TIMM_CLASSES.items():
            register_norm(getattr(layers, name), converter)
        return converter_for(cls) if cls in {getattr(layers, name) for name in _TIMM_CLASSES} else None
    if module.startswith("transformers.") and "transformers" in sys.modules:
        family = _families_by_signature().get(arithmetic_signature(cls) or "")
        return FAMILIES[family][2] if family else None
    return None


_RESOLVERS.append(_resolve)


@contextlib.contextmanager
def patch_transformers(*model_types: str) -> Iterator[list[str]]:
    """Makes models built inside the ``with`` block construct torch_ln norms directly.

    ``model_types`` are transformers model directories ("llama", "qwen2", "gemma2", ...). In each one's
    modeling module, every norm class torch_ln recognizes is replaced by its torch_ln subclass (same name,
    ``__init__`` and parameters, torch_ln's forward), so ``from_pretrained`` and ``from_config`` build
    them; leaving the block restores the originals (models already built keep their norms). Yields the
    names of the classes it patched, and raises ValueError for a model type whose modeling module holds
    no norm torch_ln recognizes.

        with torch_ln.integrations.patch_transformers("llama"):
            model = LlamaForCausalLM(config)
    """
    patched: list[tuple[object, str, type]] = []
    try:
        for model_type in model_types:
            module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
            found = 0
            for name, value in list(vars(module).items()):
                if isinstance(value, type) and value.__module__ == module.__name__:
                    converter = converter_for(value)
                    if isinstance(converter, forward_converter):
                        setattr(module, name, converter.subclass(value))
                        patched.append((module, name, value))
                        found += 1
            if not found:
                raise ValueError(
                    f"torch_ln.patch_transformers: expected a norm class torch_ln recognizes in {module.__name__}, "
                    "but found none"
                )
        yield [f"{module.__name__}.{name}" for module, name, _ in patched]
    finally:
        for module, name, original in reversed(patched):
            setattr(module, name, original)


def swappable(cls: type) -> bool:
    """Whether :func:`torch_ln.replace_norms` swaps modules of class ``cls``."""
    return converter_for(cls) is not None


def tiny_llama_config(config_cls, **overrides):
    """A two-layer Llama-family config (``transformers.LlamaConfig`` or a sibling) for random-weight models: no
    download. The self-check (``python -m torch_ln``) and the integration tests build their models from it."""
    sizes = {
        "vocab_size": 97,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    return config_cls(**{**sizes, **overrides})
