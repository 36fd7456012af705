"""Benchmarks the norms with a quantized output (torch_ln.rms_norm_quant and the others, issue 37) against the
two-step form in torch ops: torch's norm, then quantization (torch_ln.reference.quantize: scale, saturate, cast),
eager and under torch.compile. vLLM's and FlashInfer's kernels are not among the providers: neither installs here
(CPU) nor on the lent GPU machine (no network; their wheels exceed what a run carries).

Bytes per call (the least any implementation moves, each tensor once):
  x read (elem bytes), [residual read + residual_out written (elem bytes each): add_*],
  weight [+ bias] read (param bytes), q written (1 byte an element), scales written (4 bytes a group; static: 4 read)

    python benchmarks/bench_quant.py --out bench_out                    # CPU, bfloat16 and float32
    python benchmarks/bench_quant.py --device cuda --dtypes bfloat16 --rows 8192
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from harness import speed_columns, write_rows

import torch_ln
from torch_ln import reference
from torch_ln._timing import FULL, QUICK, copy_bandwidth, device_name, measure

OPS = ("rms_norm", "add_rms_norm", "layer_norm")
PROVIDERS = ("torch_ln", "torch", "compile")  # the two-step ("torch") is the baseline: always timed
MODES = {"static": {"scale": True}, "per_token": {}, "per_group_128": {"group_size": 128}}
EPS = 1e-6


def case_bytes(op: str, mode: str, M: int, D: int, es: int, ps: int) -> int:
    """The least bytes one call moves (see the module docstring)."""
    rows = M * D * es * (3 if op.startswith("add_") else 1)
    params = D * ps * (2 if op == "layer_norm" else 1)
    scales = 4 if mode == "static" else 4 * M * (D // MODES[mode].get("group_size", D))
    return rows + params + M * D + scales


def _two_step(op: str, out_dtype: torch.dtype, quant: dict):
    """torch's norm, then reference.quantize in torch ops: what serving code does without a fused kernel."""

    def run(x, residual, weight, bias):
        if op.startswith("add_"):
            x = x + residual
        y = (
            F.layer_norm(x, x.shape[-1:], weight, bias)
            if op == "layer_norm"
            else F.rms_norm(x, x.shape[-1:], weight, EPS)
        )
        return reference.quantize(y, 1, out_dtype, **quant)[0]

    return run


def _torch_ln(op: str, out_dtype: torch.dtype, quant: dict):
    def run(x, residual, weight, bias):
        D = x.shape[-1]
        if op == "rms_norm":
            return torch_ln.rms_norm_quant(x, D, weight, EPS, out_dtype=out_dtype, **quant).q
        if op == "add_rms_norm":
            return torch_ln.add_rms_norm_quant(x, residual, D, weight, EPS, out_dtype=out_dtype, **quant).q
        return torch_ln.layer_norm_quant(x, D, weight, bias, out_dtype=out_dtype, **quant).q

    return run


def _codes_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between the codes of two quantized tensors (ordered: neighbours are 1 apart)."""

    def ordered(q):
        if q.dtype == torch.int8:
            return q.to(torch.int32)
        bits = q.view(torch.uint8).to(torch.int32)
        return torch.where(bits >= 0x80, -(bits & 0x7F), bits & 0x7F)

    return int((ordered(a) - ordered(b)).abs().max())


def run(args) -> list[dict]:
    timing = QUICK if args.quick else FULL
    out_dtype = getattr(torch, args.out_dtype)
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for D in args.cols:
            g = torch.Generator(device=args.device).manual_seed(0)
            x = torch.randn(args.rows, D, device=args.device, dtype=dtype, generator=g)
            residual = torch.randn_like(x)
            weight = torch.rand(D, device=args.device, dtype=dtype, generator=g) + 0.5
            bias = torch.randn(D, device=args.device, dtype=dtype, generator=g)
            copy_gbps = copy_bandwidth(args.device, x.nbytes)
            for op in args.ops:
                for mode in args.modes:
                    quant = dict(MODES[mode])
                    if quant.pop("scale", False):
                        quant["scale"] = torch.tensor([0.01], device=args.device)
                    # Each case compiles afresh: dynamo's cache of _two_step's function would otherwise reach its
                    # recompile limit (8) across the cases and run the rest eagerly.
                    torch._dynamo.reset()
                    providers = {
                        "torch_ln": _torch_ln(op, out_dtype, quant),
                        "torch": _two_step(op, out_dtype, quant),
                        "compile": torch.compile(_two_step(op, out_dtype, quant), dynamic=False),
                    }
                    providers = {
                        name: providers[name] for name in PROVIDERS if name in args.providers or name == "torch"
                    }
                    inputs = (x, residual, weight, bias)
                    calls = {name: (lambda fn=fn, inputs=inputs: fn(*inputs)) for name, fn in providers.items()}
                    with torch.inference_mode():
                        expected = calls["torch"]()
                        apart = {name: _codes_apart(call(), expected) for name, call in calls.items()}
                        ms = measure(calls, args.device, timing)
                    nbytes = case_bytes(op, mode, args.rows, D, x.element_size(), weight.element_size())
                    for name in calls:
                        row = {
                            "op": op,
                            "mode": mode,
                            "dtype": dtype_name,
                            "out_dtype": args.out_dtype,
                            "M": args.rows,
                            "D": D,
                            "provider": name,
                            **speed_columns(nbytes, ms, name, copy_gbps),
                            "codes_apart_vs_torch": apart[name],
                        }
                        rows.append(row)
                        print(
                            f"{op:13} {mode:14} {dtype_name:9} D={D:<6} {name:9} {row['ms']:9.4f} ms "
                            f"{row['gbps']:8.2f} GB/s {row['pct_copy']:6.1f}% copy  x{row['speedup_vs_torch']:<5} "
                            f"codes apart {apart[name]}",
                            flush=True,
                        )
    return rows


def plot(rows: list[dict], path: Path) -> None:
    """One bar group per case: each provider's speedup over the torch two-step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib not installed: no plot", flush=True)
        return
    cases = sorted({(r["op"], r["mode"], r["dtype"], r["D"]) for r in rows}, key=str)
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, len(cases) * 0.6), 4))
    width = 0.8 / len(providers)
    for i, name in enumerate(providers):
        speedups = {
            (r["op"], r["mode"], r["dtype"], r["D"]): r["speedup_vs_torch"] for r in rows if r["provider"] == name
        }
        ax.bar([c + i * width for c in range(len(cases))], [speedups.get(case, 0) for case in cases], width, label=name)
    ax.set_xticks(
        [c + 0.4 - width / 2 for c in range(len(cases))],
        ["/".join(map(str, case)) for case in cases],
        rotation=90,
        fontsize=6,
    )
    ax.set_ylabel("speedup over torch's two-step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtypes", nargs="+", default=["bfloat16", "float32"], choices=("bfloat16", "float16", "float32")
    )
    parser.add_argument("--out-dtype", default="float8_e4m3fn", choices=("float8_e4m3fn", "float8_e5m2", "int8"))
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=PROVIDERS)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None, help="folder for quant.csv and quant.png")
    args = parser.parse_args(argv)
    print(f"# {device_name(args.device)}, torch {torch.__version__}, M={args.rows}, out {args.out_dtype}", flush=True)
    rows = run(args)
    if args.out is not None:
        write_rows(rows, args.out / "quant.csv")
        plot(rows, args.out / "quant.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
