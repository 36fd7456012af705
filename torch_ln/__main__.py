"""``python -m torch_ln``: checks torch_ln against torch in small models (one a tiny Hugging Face Llama), then
times a few typical shapes against torch eager (the full benchmarks, with every provider, are benchmarks/bench_*.py).

Runs on CUDA when available, else on the CPU; exits non-zero if any result disagrees with torch.
"""

from __future__ import annotations

import copy
import sys

import torch
import torch.nn.functional as F
from torch import nn

import torch_ln
from torch_ln import _timing
from torch_ln.integrations import tiny_llama_config

SHAPES = ((4096, 768), (2048, 4096), (512, 8192))
TOLERANCE = 1e-4  # float32 models: only the norms' rounding differs
# A timed case's output against torch's, relative to its largest magnitude: a few units of the dtype's last place.
CASE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
OPS = {
    "layer_norm": (torch_ln.layer_norm, F.layer_norm),
    "rms_norm": (torch_ln.rms_norm, F.rms_norm),
}


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


def _case(op: str, device: str, dtype: torch.dtype, mode: str, M: int, D: int) -> tuple[str, dict]:
    """One shape: whether torch_ln's output agrees with torch's, and a step per provider to time."""
    x = torch.randn(M, D, device=device, dtype=dtype, requires_grad=mode != "fwd")
    weight = torch.randn(D, device=device, dtype=dtype)
    dy = torch.randn(M, D, device=device, dtype=dtype)
    extra = (torch.randn(D, device=device, dtype=dtype),) if op == "layer_norm" else ()
    eps = 1e-5 if op == "layer_norm" else 1e-6

    def step(norm):
        def run():
            y = norm(x, (D,), weight, *extra, eps=eps)
            if mode != "fwd":
                torch.autograd.grad(y, x, dy)
            return y

        return run

    ours, theirs = (step(norm) for norm in OPS[op])
    reference = theirs()
    error = ((ours() - reference).abs().max() / reference.abs().max()).item()
    check = "ok" if error <= CASE_TOLERANCE[dtype] else f"MISMATCH {error:.1e}"
    return check, {"torch_ln": ours, "torch": theirs}


def time_shapes(device: str) -> tuple[bool, int, int]:
    """Prints torch_ln against torch eager on SHAPES; returns whether every output agreed with torch's, the number
    of cases where torch_ln was slower, and the number of cases."""
    print(f"\ncopy bandwidth: {_timing.copy_bandwidth(device, 256 * 2**20):.1f} GB/s; torch_ln against torch eager:")
    columns = "{:<9} {:<8} {:>6} {:>6} {:>12} {:>9} {:>8}  {}"
    agree, slower, cases = True, 0, 0
    for op in OPS:
        print(f"{op}:")
        print(columns.format("dtype", "mode", "D", "M", "torch_ln ms", "torch ms", "speedup", "check"))
        for dtype in (torch.float32, torch.bfloat16):
            for mode in ("fwd", "fwd+bwd"):
                for M, D in SHAPES:
                    check, steps = _case(op, device, dtype, mode, M, D)
                    ms = _timing.measure(steps, device, _timing.QUICK)
                    speedup = ms["torch"] / ms["torch_ln"]
                    mark = "  SLOWER than torch" if speedup < 1.0 else ""
                    row = (str(dtype).removeprefix("torch."), mode, D, M, f"{ms['torch_ln']:.4f}", f"{ms['torch']:.4f}")
                    print(columns.format(*row, f"{speedup:.2f}x", check + mark), flush=True)
                    agree &= check == "ok"
                    slower += speedup < 1.0
                    cases += 1
    return agree, slower, cases


def main() -> int:
    """Runs the self-check; returns the exit status."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(
        f"torch_ln self-check on {_timing.device_name(device)}; torch {torch.__version__}; "
        f"extension has CUDA kernels: {torch_ln._extension.cuda_compiled()}"
    )
    ok = check_models(device)
    ok &= check_hf_llama(device)
    agree, slower, cases = time_shapes(device)
    ok &= agree
    # The exit status is about correctness; speed is reported, not judged (timings on a shared machine vary).
    print(
        f"\n{'PASS' if ok else 'FAIL'}: torch_ln's results {'agree' if ok else 'DISAGREE'} with torch; "
        f"torch_ln was SLOWER than torch eager in {slower} of {cases} timed cases"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
