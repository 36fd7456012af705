"""Benchmarks the gated RMSNorm (torch_ln.gated_rms_norm, issue 38) against the classes' own arithmetic in torch ops
(torch_ln.reference.gated_rms_norm: what transformers' *RMSNormGated forwards compute), eager and under
torch.compile, in two forms: Mamba2's (gate before the norm, groups, rounded before the weight) and Qwen3-Next's
(gate after, rounded before the weight). On the CPU or a CUDA device (`--device cuda`).

Bytes per call (the least any implementation moves, each tensor once; weight and its gradient counted too):
  fwd:      x and gate read, y written                              3 * M * D * elem + D * param
  fwd+bwd:  the forward, then dy, x and gate read, dx and dgate written   8 * M * D * elem + 2 * D * param

    python benchmarks/bench_gated.py --out bench_out
    python benchmarks/bench_gated.py --device cuda --quick --out bench_out
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from harness import speed_columns, write_rows

import torch_ln
from torch_ln import reference
from torch_ln._timing import FULL, QUICK, copy_bandwidth, device_name, measure

FORMS = {
    "mamba2": {"gate_position": "before", "group_size": 1024, "round_normalized": True},
    "qwen3_next": {"gate_position": "after", "round_normalized": True},
}
MODES = ("fwd", "fwd+bwd")
PROVIDERS = ("torch_ln", "torch", "compile")
EPS = 1e-6


def case_bytes(mode: str, M: int, D: int, es: int, ps: int) -> int:
    """The least bytes one call moves (see the module docstring)."""
    return (3 if mode == "fwd" else 8) * M * D * es + (1 if mode == "fwd" else 2) * D * ps


def _providers(form: dict) -> dict:
    # Each case compiles afresh: dynamo's cache of `theirs` would otherwise reach its recompile limit (8) across the
    # cases and run the rest eagerly.
    torch._dynamo.reset()

    def ours(x, z, w):
        return torch_ln.gated_rms_norm(x, z, x.shape[-1], w, EPS, **form)

    def theirs(x, z, w):
        return reference.gated_rms_norm(x, z, w, EPS, **form)

    return {"torch_ln": ours, "torch": theirs, "compile": torch.compile(theirs, dynamic=False)}


def _call(fn, mode: str, x, z, w, dy):
    if mode == "fwd":  # inputs that need no gradient: no graph
        return lambda: fn(x, z, w)
    leaves = [t.detach().requires_grad_() for t in (x, z, w)]
    return lambda: torch.autograd.grad(fn(*leaves), leaves, dy)


def _largest_difference(got, expected) -> float:
    """The largest |got - expected| over the outputs (y, or the three gradients), relative to each one's largest
    magnitude."""
    pairs = zip(*(t if isinstance(t, tuple) else (t,) for t in (got, expected)))
    return max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)) for a, b in pairs)


def run(args) -> list[dict]:
    timing = QUICK if args.quick else FULL
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for D in args.cols:
            g = torch.Generator(device=args.device).manual_seed(0)
            x, z, dy = (torch.randn(args.rows, D, device=args.device, dtype=dtype, generator=g) for _ in range(3))
            w = torch.rand(D, device=args.device, dtype=dtype, generator=g) + 0.5
            copy_gbps = copy_bandwidth(args.device, x.nbytes)
            for form_name in args.forms:
                form = dict(FORMS[form_name])
                if "group_size" in form:
                    form["group_size"] = min(form["group_size"], D)
                providers = {k: v for k, v in _providers(form).items() if k in args.providers or k == "torch"}
                for mode in args.modes:
                    calls = {name: _call(fn, mode, x, z, w, dy) for name, fn in providers.items()}
                    expected = calls["torch"]()
                    differences = {name: _largest_difference(call(), expected) for name, call in calls.items()}
                    ms = measure(calls, args.device, timing)
                    nbytes = case_bytes(mode, args.rows, D, x.element_size(), w.element_size())
                    for name in calls:
                        row = {
                            "form": form_name,
                            "mode": mode,
                            "dtype": dtype_name,
                            "M": args.rows,
                            "D": D,
                            "provider": name,
                            **speed_columns(nbytes, ms, name, copy_gbps),
                            "difference_vs_torch": f"{differences[name]:.2e}",
                        }
                        rows.append(row)
                        print(
                            f"{form_name:10} {mode:8} {dtype_name:9} D={D:<6} {name:9} {row['ms']:9.4f} ms "
                            f"{row['gbps']:8.2f} GB/s {row['pct_copy']:6.1f}% copy  x{row['speedup_vs_torch']}",
                            flush=True,
                        )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--dtypes", nargs="+", default=["bfloat16", "float32"], choices=("bfloat16", "float16", "float32")
    )
    parser.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="folder for gated.csv")
    args = parser.parse_args(argv)
    print(f"# {device_name(args.device)}, torch {torch.__version__}, M={args.rows}", flush=True)
    rows = run(args)
    if args.out is not None:
        write_rows(rows, args.out / "gated.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
