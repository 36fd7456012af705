"""Benchmarks the fused residual add + norm (torch_ln.add_layer_norm / add_rms_norm) against the unfused pair
``h = x + residual; y = norm(h)`` with torch_ln's norm, with torch's norm, under torch.compile, and against the
fused adds of Liger, QuACK and flash-attn when they are installed (CUDA-only).

Usage: python benchmarks/bench_add_norm.py [--op layer_norm|rms_norm] [--device cpu|cuda] [--quick] [--help]

Timing, the output check, the CSV and the plots are the shared harness's (benchmarks/harness.py,
benchmarks/README.md); the summary gives fused / unfused torch_ln pair and fused / compiled pair per case.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import harness
import torch
from torch import Tensor

import torch_ln

PROVIDERS = ("fused", "torch_ln_pair", "torch", "compile", "liger", "quack", "flash_attn")
EXTERNAL = ("liger", "quack", "flash_attn")
# The goal: fused <= 0.8x the unfused torch_ln pair and <= the compiled pair.
GOAL_VS_PAIR, GOAL_VS_COMPILE = 0.8, 1.0

AddNorm = Callable[[Tensor, Tensor, Tensor, Tensor | None], tuple[Tensor, Tensor]]


def add_norm_bytes(op: str, mode: str, M: int, D: int, es: int, ps: int) -> int:
    """Bytes the fused op must move at the least (residual_out in the input's dtype, statistics float32)."""
    nparams = 2 if op == "layer_norm" else 1
    nstats = 2 if op == "layer_norm" else 1
    fwd = (
        2 * M * D * es  # read x and residual
        + 2 * M * D * es  # write y and residual_out
        + nparams * D * ps  # read weight (and bias)
        + nstats * M * 4  # write rstd (and mean)
    )
    bwd = (
        3 * M * D * es  # read dy, d residual_out and residual_out (the norm's input, saved by the forward)
        + nstats * M * 4  # read rstd (and mean)
        + D * ps  # read weight
        + M * D * es  # write d residual_out: the gradient of both x and residual (one tensor when dtypes agree)
        + nparams * D * ps  # write dweight (and dbias)
    )
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def _pair(norm: Callable) -> AddNorm:
    def add_then_norm(x, residual, w, b):
        h = x + residual
        return norm(h, w, b), h

    return add_then_norm


def _fused(op: str) -> AddNorm:
    eps = harness.EPS[op]
    if op == "layer_norm":
        return lambda x, r, w, b: torch_ln.add_layer_norm(x, r, x.shape[-1:], w, b, eps)
    return lambda x, r, w, b: torch_ln.add_rms_norm(x, r, x.shape[-1:], w, eps)


def _liger(op: str) -> AddNorm:
    if op == "layer_norm":
        raise ImportError("Liger has no fused add + LayerNorm")
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction

    eps = harness.EPS[op]
    return lambda x, r, w, b: LigerFusedAddRMSNormFunction.apply(x, r, w, eps, 0.0, "llama", False)


def _quack(op: str) -> AddNorm:
    from quack.rmsnorm import rmsnorm

    eps = harness.EPS[op]
    if op == "layer_norm":
        raise ImportError("QuACK's fused residual is for RMSNorm here")
    return lambda x, r, w, b: rmsnorm(x, w.float(), residual=r, eps=eps, prenorm=True)


def _flash_attn(op: str) -> AddNorm:
    from flash_attn.ops.triton.layer_norm import layer_norm_fn

    eps = harness.EPS[op]
    is_rms = op == "rms_norm"
    return lambda x, r, w, b: layer_norm_fn(x, w, b, residual=r, eps=eps, prenorm=True, is_rms_norm=is_rms)


def build(name: str, op: str) -> AddNorm:
    if name == "fused":
        return _fused(op)
    if name == "torch_ln_pair":
        return _pair(harness._torch_ln_fn(op))
    if name == "torch":
        return _pair(harness._torch_fn(op))
    if name == "compile":
        return torch.compile(_pair(harness._torch_fn(op)), dynamic=False)
    return {"liger": _liger, "quack": _quack, "flash_attn": _flash_attn}[name](op)


@dataclass
class Inputs:
    x: Tensor
    residual: Tensor
    weight: Tensor
    bias: Tensor | None
    dy: Tensor
    dh: Tensor

    def leaves(self) -> list[Tensor]:
        return [t for t in (self.x, self.residual, self.weight, self.bias) if t is not None]


def make_inputs(op: str, device: str, dtype: torch.dtype, M: int, D: int) -> Inputs:
    def randn(*shape: int, scale: float = 1.0, shift: float = 0.0) -> Tensor:
        return (torch.randn(*shape, device=device) * scale + shift).to(dtype).requires_grad_()

    bias = randn(D, scale=0.1) if op == "layer_norm" else None
    return Inputs(
        randn(M, D), randn(M, D), randn(D, scale=0.1, shift=1.0), bias, randn(M, D).detach(), randn(M, D).detach()
    )


def outputs(fn: AddNorm, mode: str, inputs: Inputs) -> list[Tensor]:
    y, h = fn(inputs.x, inputs.residual, inputs.weight, inputs.bias)
    if mode == "fwd":
        return [y.detach(), h.detach()]
    grads = torch.autograd.grad((y, h), inputs.leaves(), (inputs.dy, inputs.dh))
    return [y.detach(), h.detach(), *grads]


def check(fn: AddNorm, op: str, mode: str, inputs: Inputs, row: harness.Result) -> None:
    """As the harness's check: against torch's pair in float32 on upcast copies of the inputs."""
    try:
        got = outputs(fn, mode, inputs)
    except Exception as error:  # noqa: BLE001 - a provider may reject a case: report it, go on
        row.check = f"error: {type(error).__name__}: {str(error).splitlines()[0][:100] if str(error) else ''}"
        return
    up = [None if t is None else t.detach().float().requires_grad_() for t in (inputs.x, inputs.residual)]
    params = [None if t is None else t.detach().float().requires_grad_() for t in (inputs.weight, inputs.bias)]
    want = outputs(_pair(harness._torch_fn(op)), mode, Inputs(*up, *params, inputs.dy.float(), inputs.dh.float()))
    row.max_error = max(((g.float() - w).abs().max() / w.abs().max().clamp_min(1e-6)).item() for g, w in zip(got, want))
    row.check = "ok" if row.max_error <= harness.TOLERANCE[inputs.x.dtype] else f"MISMATCH {row.max_error:.1e}"


def step(fn: AddNorm, mode: str, inputs: Inputs) -> Callable[[], object]:
    args = (inputs.x, inputs.residual, inputs.weight, inputs.bias)
    grads = (inputs.dy, inputs.dh)
    if mode == "fwd":
        return lambda: fn(*args)
    if mode == "fwd+bwd":
        return lambda: torch.autograd.grad(fn(*args), inputs.leaves(), grads)
    outs = fn(*args)
    return lambda: torch.autograd.grad(outs, inputs.leaves(), grads, retain_graph=True)


def run_case(op, device, dtype, mode, M, D, providers, timing, copy_gbps) -> list[harness.Result]:
    torch._dynamo.reset()
    inputs = make_inputs(op, device, dtype, M, D)
    fns = {name: build(name, op) for name in providers}
    results = {name: harness.Result(f"add_{op}", device, str(dtype)[6:], mode, M, D, name) for name in providers}
    with torch._functorch.config.patch(donated_buffer=mode != "bwd"):
        for name, fn in fns.items():
            check(fn, op, mode, inputs, results[name])
        steps = {name: step(fn, mode, inputs) for name, fn in fns.items() if not results[name].check.startswith("err")}
        times = harness.measure(steps, device, timing)
    nbytes = add_norm_bytes(op, mode, M, D, inputs.x.element_size(), inputs.weight.element_size())
    for name in steps:
        row = results[name]
        row.ms = times[name]
        row.gbps = nbytes / (row.ms * 1e-3) / 1e9
        row.pct_copy = 100 * row.gbps / copy_gbps
        row.speedup_vs_torch = times["torch"] / row.ms
    return list(results.values())


def summarize(results: Sequence[harness.Result]) -> bool:
    """Per (dtype, mode): fused time / unfused torch_ln pair and fused / compiled pair, median and worst over D."""
    passed = True
    print("\nfused time as a fraction of the unfused torch_ln pair's and the compiled pair's, across D:")
    for dtype, mode in dict.fromkeys((r.dtype, r.mode) for r in results):
        ms = {(r.provider, r.D): r.ms for r in results if (r.dtype, r.mode) == (dtype, mode)}
        sizes = sorted({d for _, d in ms})
        line = f"  {dtype:<9} {mode:<7}"
        for other, goal in (("torch_ln_pair", GOAL_VS_PAIR), ("compile", GOAL_VS_COMPILE)):
            ratios = {d: ms[("fused", d)] / ms[(other, d)] for d in sizes if (other, d) in ms and ("fused", d) in ms}
            if not ratios:
                continue
            worst = max(ratios, key=ratios.get)
            ok = max(ratios.values()) <= goal
            passed &= ok
            line += (
                f"  vs {other}: median {statistics.median(ratios.values()):.2f} max {ratios[worst]:.2f} (D={worst})"
                f" goal <={goal}: {'MET' if ok else 'MISSED'}"
            )
        print(line)
    return passed


def main(argv: Sequence[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description="Benchmark torch_ln's fused residual add + norm.")
    parser.add_argument("--op", choices=harness.OPS, default="rms_norm")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if cuda else "cpu")
    parser.add_argument("--dtypes", nargs="+", choices=tuple(harness.DTYPES), default=["float32", "bfloat16"])
    parser.add_argument("--modes", nargs="+", choices=harness.MODES, default=list(harness.MODES))
    parser.add_argument("--D", nargs="+", type=int, default=[512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--bytes", type=harness.parse_bytes, help="x's size per case; default 2GiB cuda, 16MiB cpu")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    parser.add_argument("--quick", action="store_true", help="shorter timing")
    args = parser.parse_args(argv)
    case_bytes = args.bytes or (2 * 2**30 if args.device == "cuda" else 16 * 2**20)
    timing = harness.QUICK if args.quick else harness.FULL
    print(f"torch_ln.add_{args.op} on {harness.device_name(args.device)}; torch {torch.__version__}")
    if args.device == "cpu":
        print(harness.keep_freed_memory())
    copy_gbps = harness.copy_bandwidth(args.device, max(case_bytes, 256 * 2**20))
    print(f"copy bandwidth: {copy_gbps:.1f} GB/s")
    providers = []
    for name in dict.fromkeys(["torch", *args.providers]):
        if name in EXTERNAL:
            try:
                if args.device != "cuda":
                    raise RuntimeError("CUDA-only")
                build(name, args.op)
            except Exception as error:  # noqa: BLE001 - an import can fail in many ways
                print(f"note: {name} skipped: {type(error).__name__}: {error}")
                continue
        providers.append(name)
    results = []
    harness.print_header()
    for dtype in args.dtypes:
        for mode in args.modes:
            for D in args.D:
                M = max(1, case_bytes // (D * harness.DTYPES[dtype].itemsize))
                for row in run_case(
                    args.op, args.device, harness.DTYPES[dtype], mode, M, D, providers, timing, copy_gbps
                ):
                    harness.print_row(row)
                    results.append(row)
    harness.flag_inaccurate(results)
    passed = summarize(results) and all(r.check == "ok" for r in results if r.provider == "fused")
    harness.write_outputs(results, args.out / f"add_{args.op}_{args.device}.csv", copy_gbps, args.device)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
