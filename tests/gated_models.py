"""Tiny randomly initialised transformers models, one of every family whose layers hold a gated RMSNorm, for
tests/test_gated_norm.py.

GATED_MODELS maps a family name to a builder: a zero-argument function returning (model, inputs), a model of
hidden size 64, two layers (at least one of them a Mamba or linear-attention layer, which holds the gated norm),
vocabulary 97, and the keyword inputs of its forward (input_ids of shape (2, 12)). GATED_CLASSES names the gated
norm class each model holds. The builders need no optional kernel package: the models run their torch paths.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import transformers
from torch import nn

VOCAB = 97
HIDDEN = 64
BATCH, SEQ = 2, 12


def _build(config_cls: type, model_cls: type, **fields) -> tuple[nn.Module, dict]:
    """A seeded model of config_cls(vocabulary VOCAB, hidden size HIDDEN, fields), and input_ids of (BATCH, SEQ)."""
    torch.manual_seed(0)
    model = model_cls(config_cls(vocab_size=VOCAB, hidden_size=HIDDEN, **fields))
    generator = torch.Generator().manual_seed(0)
    return model, {"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)}


def _model(config: str, model: str, *field_sets: dict, **fields) -> Callable[[], tuple[nn.Module, dict]]:
    """The builder of transformers.<model> from transformers.<config> with the union of the field sets."""
    merged = {k: v for fields_ in (*field_sets, fields) for k, v in fields_.items()}
    return functools.partial(_build, getattr(transformers, config), getattr(transformers, model), **merged)


# Two layers, the first a Mamba or linear-attention layer (which holds the gated norm), then full attention.
HYBRID = {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]}
ATTENTION = {"num_attention_heads": 4, "num_key_value_heads": 2}
# The Mamba-2 mixers: intermediate size expand * 64 = 128 = 8 heads of 16, in 2 groups (the gated norm's groups).
MAMBA = {"mamba_n_heads": 8, "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_chunk_size": 8}
# The gated DeltaNet models (Qwen3-Next and its successors): the norm runs per value head (16 wide).
DELTANET = {
    **HYBRID,
    **ATTENTION,
    "head_dim": 16,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}
EXPERTS = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}
# The Kimi delta attention models: the norm runs per head of the linear attention's output, gated by a low-rank
# projection of the layer's input; MLA attention and routed experts beside it.
KIMI = {
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "mlp_layer_types": ["dense", "sparse"],
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "pad_token_id": 0,
}

GATED_MODELS: dict[str, Callable[[], tuple[nn.Module, dict]]] = {
    "mamba2": _model(
        "Mamba2Config",
        "Mamba2ForCausalLM",
        num_hidden_layers=2,
        num_heads=8,
        head_dim=16,
        state_size=16,
        n_groups=2,
        chunk_size=8,
    ),
    "zamba2": _model(
        "Zamba2Config",
        "Zamba2ForCausalLM",
        num_hidden_layers=2,
        layers_block_type=["linear_attention", "hybrid"],  # a Mamba layer, then a Mamba + shared attention layer
        mamba_d_state=16,
        mamba_ngroups=2,
        n_mamba_heads=8,
        chunk_size=8,
        intermediate_size=128,
        num_attention_heads=4,
        adapter_rank=8,
    ),
    "nemotron_h": _model(
        "NemotronHConfig",
        "NemotronHForCausalLM",
        ATTENTION,
        layers_block_type=["linear_attention", "full_attention"],  # "M*": a Mamba layer, then an attention layer
        head_dim=16,
        intermediate_size=128,
        ssm_state_size=16,
        mamba_num_heads=8,
        mamba_head_dim=16,
        n_groups=2,
        chunk_size=8,
    ),
    "bamba": _model(
        "BambaConfig",
        "BambaForCausalLM",
        ATTENTION,
        MAMBA,
        intermediate_size=128,
        num_hidden_layers=2,
        attn_layer_indices=[1],  # layer 0 Mamba, layer 1 attention
    ),
    "granitemoehybrid": _model(
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        HYBRID,
        ATTENTION,
        MAMBA,
        intermediate_size=32,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=64,
        position_embedding_type="rope",
    ),
    "falcon_h1": _model(
        "FalconH1Config",
        "FalconH1ForCausalLM",
        ATTENTION,
        MAMBA,
        intermediate_size=128,
        num_hidden_layers=2,  # every layer runs attention and Mamba side by side
        mamba_d_ssm=None,  # the Mamba intermediate size: mamba_expand * hidden_size
        mamba_rms_norm=True,  # without it the mixer gates with a bare silu, no norm
    ),
    "qwen3_next": _model("Qwen3NextConfig", "Qwen3NextForCausalLM", DELTANET, EXPERTS, intermediate_size=128),
    "qwen3_5": _model("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", DELTANET, intermediate_size=128),
    "qwen3_5_moe": _model("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", DELTANET, EXPERTS),
    "olmo_hybrid": _model(
        "OlmoHybridConfig",
        "OlmoHybridForCausalLM",
        HYBRID,
        ATTENTION,
        intermediate_size=128,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=32,
        pad_token_id=0,
        eos_token_id=1,
    ),
    "qwen4_exp": _model(
        "Qwen4ExpTextConfig",
        "Qwen4ExpForCausalLM",
        DELTANET,
        EXPERTS,
        layer_types=["linear_attention", "indexed_attention"],
        hc_lowrank=8,  # the hyper-connection mixer's rank
        # The indexed attention layer's QSA indexer: a budget of 8 keys, chosen in blocks of 4.
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=8,
        indexer_compress_ratio=4,
    ),
    # GLM5-Next has no ...ForCausalLM: its text model (the multimodal model's language half) stands in.
    "glm5_next": _model(
        "Glm5NextTextConfig",
        "Glm5NextTextModel",
        HYBRID,
        KIMI,
        layer_types=["linear_attention", "indexed_attention"],
        n_routed_experts=4,
        q_lora_rank=32,
        index_topk=16,
        index_head_dim=16,
        index_n_heads=2,
        linear_head_dim=16,
        linear_num_heads=4,
    ),
    "kimi_linear": _model(
        "KimiLinearConfig",
        "KimiLinearForCausalLM",
        HYBRID,
        KIMI,
        num_local_experts=4,
        qk_rope_head_dim=8,
        linear_head_dim=16,
        linear_num_heads=4,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "bailing_hybrid": _model(
        "BailingHybridConfig",
        "BailingHybridForCausalLM",
        HYBRID,
        KIMI,
        first_k_dense_replace=1,
        head_dim=16,  # the linear attention's head size (the MLA attention's comes from the qk_*_head_dim)
        num_local_experts=4,
        n_group=1,
        topk_group=1,
        qk_rope_head_dim=8,
        num_mtp_layers=0,
        eos_token_id=2,
    ),
}

GATED_CLASSES = {
    "mamba2": "MambaRMSNormGated",
    "zamba2": "Zamba2RMSNormGated",
    "nemotron_h": "NemotronHRMSNormGated",
    "bamba": "BambaRMSNormGated",
    "granitemoehybrid": "GraniteMoeHybridRMSNormGated",
    "falcon_h1": "FalconH1RMSNormGated",
    "qwen3_next": "Qwen3NextRMSNormGated",
    "qwen3_5": "Qwen3_5RMSNormGated",
    "qwen3_5_moe": "Qwen3_5MoeRMSNormGated",
    "olmo_hybrid": "OlmoHybridRMSNormGated",
    "qwen4_exp": "Qwen4ExpTextRMSNormGated",
    "glm5_next": "Glm5NextTextRMSNormGated",
    "kimi_linear": "KimiLinearRMSNormGated",
    "bailing_hybrid": "BailingHybridRMSNormGated",
}
