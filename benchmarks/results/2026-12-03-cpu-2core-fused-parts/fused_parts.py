"""The fused forward against its parts in one process: the unfused pair, torch's add, torch_ln's norm of h, and two
clones, of x and of residual (the fused op's bytes: two tensors read, two written). Milliseconds per call, 2 threads.

    PYTHONPATH=<checkout> python fused_parts.py --mib 16 --ops ln --dtypes float32 bfloat16   # and --mib 64, --ops rms
"""

import argparse

import torch

import torch_ln
from torch_ln import benchmark as harness


def steps(op, dtype, M, D):
    x, residual = torch.randn(M, D).to(dtype), torch.randn(M, D).to(dtype)
    weight, bias = torch.randn(D).to(dtype), torch.randn(D).to(dtype)
    h = x + residual
    if op == "rms":
        norm = lambda t: torch_ln.rms_norm(t, (D,), weight, 1e-6)
        fused = lambda: torch_ln.add_rms_norm(x, residual, (D,), weight, 1e-6)
    else:
        norm = lambda t: torch_ln.layer_norm(t, (D,), weight, bias)
        fused = lambda: torch_ln.add_layer_norm(x, residual, (D,), weight, bias)
    return {
        "pair": lambda: norm(x + residual),
        "fused": fused,
        "add": lambda: x + residual,
        "norm": lambda: norm(h),
        "copy2": lambda: (x.clone(), residual.clone()),
    }


p = argparse.ArgumentParser()
p.add_argument("--mib", type=int, default=16)
p.add_argument("--seconds", type=float, default=2.0)
p.add_argument("--ops", nargs="+", default=["ln"])
p.add_argument("--dtypes", nargs="+", default=["float32"])
p.add_argument("--D", nargs="+", type=int, default=[1024, 4096, 16384])
a = p.parse_args()
harness.keep_freed_memory()
for op in a.ops:
    for dt in a.dtypes:
        dtype = getattr(torch, dt)
        for D in a.D:
            M = (a.mib << 20) // (dtype.itemsize * D)
            t = harness.measure(steps(op, dtype, M, D), "cpu", harness.Timing(seconds=a.seconds, rounds=1))
            print(
                op,
                dt,
                D,
                "  ".join(f"{k} {v:.2f}" for k, v in t.items()),
                f" fused/pair {t['fused'] / t['pair']:.2f}",
                flush=True,
            )
