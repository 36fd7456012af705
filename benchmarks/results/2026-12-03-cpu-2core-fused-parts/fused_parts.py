"""The fused forward against its parts in one process: the unfused pair, torch's add, torch_ln's norm of h, and two
clones, of x and of residual (the fused op's bytes: two tensors read, two written). Milliseconds per call; `fused/(add+norm)` compares the fused op with the sum of its
parts' times, the share of their work it saves (in cache, where memory is not the bound, the whole of the difference).

    PYTHONPATH=<checkout> python fused_parts.py --mib 16 --ops ln --dtypes float32 bfloat16   # and --mib 64, --ops rms
    PYTHONPATH=<checkout> python fused_parts.py --mib 0.25 --threads 1 --ops ln rms --dtypes float32 bfloat16  # in L2
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
p.add_argument("--mib", type=float, default=16)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--seconds", type=float, default=2.0)
p.add_argument("--ops", nargs="+", default=["ln"])
p.add_argument("--dtypes", nargs="+", default=["float32"])
p.add_argument("--D", nargs="+", type=int, default=[1024, 4096, 16384])
a = p.parse_args()
torch.set_num_threads(a.threads)
harness.keep_freed_memory()
for op in a.ops:
    for dt in a.dtypes:
        dtype = getattr(torch, dt)
        for D in a.D:
            M = round(a.mib * 2**20) // (dtype.itemsize * D)
            t = harness.measure(steps(op, dtype, M, D), "cpu", harness.Timing(seconds=a.seconds, rounds=1))
            print(
                op,
                dt,
                D,
                "  ".join(f"{k} {v:.3f}" for k, v in t.items()),
                f" fused/pair {t['fused'] / t['pair']:.2f}",
                f" fused/(add+norm) {t['fused'] / (t['add'] + t['norm']):.2f}",
                flush=True,
            )
