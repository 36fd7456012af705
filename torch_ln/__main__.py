"""``python -m torch_ln``: checks torch_ln against torch in small models (one a tiny Hugging Face Llama), then
times a few typical shapes.

Runs on CUDA when available, else on the CPU; exits non-zero if any result disagrees with torch.
"""

from __future__ import annotations

import copy
import sys

import torch
from torch import nn

import torch_ln
from torch_ln import benchmark
from torch_ln.integrations import tiny_llama_config

SHAPES = ((4096, 768), (2048, 4096), (512, 8192))
TOLERANCE = 1e-4  # float32 models: only the norms' rounding differs


def _model(device: str) -> nn.Module:
    """A pre-norm transformer encoder with a final LayerNorm, followed by an MLP with RMSNorms."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, nhead=4, dim_feedforward=128, dropout=0.0, batch_first=True, norm_first=True)
    encoder = nn.TransformerEncoder(layer, num_layers=2, norm=nn.LayerNorm(64), enable_nested_tensor=False)
    mlp = nn.Sequential(nn.Linear(64, 128), nn.RMSNorm(128), nn.GELU(), nn.Linear(128, 64), nn.RMSNorm(64))
    return nn.Sequential(encoder, mlp).to(device)


def _forward_backward(model: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    """The output, the input's gradient and every parameter's gradient, in a fixed order."""
    x = x.clone().requires_grad_()
    y = model(x)
    y.backward(dy)
    return [y.detach(), x.grad, *(p.grad for p in model.parameters())]


def check_models(device: str) -> bool:
    """Compares a model with its torch_ln-swapped copy; prints the largest differences and PASS/FAIL."""
    model = _model(device)
    swapped = torch_ln.replace_norms(copy.deepcopy(model))
    norms = sum(isinstance(m, (nn.LayerNorm, nn.RMSNorm)) for m in model.modules())
    replaced = sum(isinstance(m, (torch_ln.LayerNorm, torch_ln.RMSNorm)) for m in swapped.modules())
    x = torch.randn(4, 32, 64, device=device)
    dy = torch.randn(4, 32, 64, device=device)
    want, got = _forward_backward(model, x, dy), _forward_backward(swapped, x, dy)
    diffs = [(g - w).abs().max().item() for g, w in zip(got, want)]
    ok = replaced == norms and max(diffs) <= TOLERANCE
    print(
        f"model check: {replaced}/{norms} norms replaced; max abs diff: output {diffs[0]:.2e}, "
        f"input grad {diffs[1]:.2e}, parameter grads {max(diffs[2:]):.2e} -> {'PASS' if ok else 'FAIL'}"
    )
    return ok


def check_hf_llama(device: str) -> bool:
    """A tiny Hugging Face Llama (random init from a config) against its torch_ln-swapped copy: logits and
    every parameter's gradient. Skipped, and said so, where transformers is not installed."""
    try:
        import transformers
    except ImportError:
        print("HF Llama check: skipped (transformers is not installed; pip install 'torch_ln[test]')")
        return True
    torch.manual_seed(0)
    config = tiny_llama_config(transformers.LlamaConfig)
    model = transformers.LlamaForCausalLM(config).to(device)
    with torch.no_grad():  # norm weights away from their initial ones, so the weight path is exercised
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(1, 0.3)
    swapped = torch_ln.replace_norms(copy.deepcopy(model))
    norms = sum(type(m).__name__ == "LlamaRMSNorm" for m in model.modules())
    replaced = sum(torch_ln.modules._is_torch_ln(m) for m in swapped.modules())
    tokens = torch.randint(0, config.vocab_size, (2, 32), device=device)
    dy = torch.randn(2, 32, config.vocab_size, device=device)

    def step(m: nn.Module) -> list[torch.Tensor]:
        logits = m(input_ids=tokens).logits
        logits.backward(dy)
        return [logits.detach(), *(p.grad for p in m.parameters())]

    diffs = [(g - w).abs().max().item() for g, w in zip(step(swapped), step(model))]
    ok = replaced == norms > 0 and max(diffs) <= TOLERANCE
    print(
        f"HF Llama check (transformers {transformers.__version__}): {replaced}/{norms} LlamaRMSNorm replaced; "
        f"max abs diff: logits {diffs[0]:.2e}, parameter grads {max(diffs[1:]):.2e} -> {'PASS' if ok else 'FAIL'}"
    )
    return ok


def time_shapes(device: str) -> list[benchmark.Result]:
    """Prints torch_ln against torch eager on SHAPES; returns torch_ln's rows."""

    copy_gbps = benchmark.copy_bandwidth(device, 256 * 2**20)
    print(f"\ncopy bandwidth: {copy_gbps:.1f} GB/s; timing torch_ln against torch eager:")
    rows = []
    for op in benchmark.OPS:
        print(f"{op}:")
        benchmark.print_header()
        for dtype in (torch.float32, torch.bfloat16):
            for mode in ("fwd", "fwd+bwd"):
                for M, D in SHAPES:
                    for row in benchmark.run_case(
                        op, device, dtype, mode, M, D, ["torch_ln", "torch"], benchmark.QUICK, copy_gbps
                    ):
                        benchmark.print_row(row)
                        rows.append(row)
    benchmark.print_legend()
    return [row for row in rows if row.provider == "torch_ln"]


def main() -> int:
    """Runs the self-check; returns the exit status."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(
        f"torch_ln self-check on {benchmark.device_name(device)}; torch {torch.__version__}; "
        f"extension has CUDA kernels: {torch_ln._extension.cuda_compiled()}"
    )
    ok = check_models(device)
    ok &= check_hf_llama(device)
    ours = time_shapes(device)
    ok &= all(row.check == "ok" for row in ours)
    slower = sum(benchmark.is_slower(row) for row in ours)
    # The exit status is about correctness; speed is reported, not judged (timings on a shared machine vary).
    print(
        f"\n{'PASS' if ok else 'FAIL'}: torch_ln's results {'agree' if ok else 'DISAGREE'} with torch and float64; "
        f"torch_ln was SLOWER than torch eager in {slower} of {len(ours)} timed cases"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
