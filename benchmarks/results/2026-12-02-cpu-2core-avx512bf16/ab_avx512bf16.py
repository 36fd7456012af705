"""The in-process A/B of README.md: `python ab_avx512bf16.py BUILD` where BUILD is a checkout built with a temporary
`extern "C" void tln_set_bf16(int on)` in csrc/cpu/norm_cpu.cpp that sets kHasAvx512Bf16 (an experiment build, not
the committed code). Each case: 9 alternations of the new rounding on and off, the median time of each."""

import ctypes
import glob
import statistics
import sys
import time

sys.path.insert(0, sys.argv[1])
import torch

import torch_ln

lib = ctypes.CDLL(glob.glob(f"{sys.argv[1]}/torch_ln/lib/libtorch_ln*.so")[0])
torch.manual_seed(0)


def bench(f, n):
    f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n


cases = []
for mib, D in ((1, 1024), (1, 4096), (8, 16384), (16, 1024), (16, 4096)):
    M = mib * 2**20 // (2 * D)
    x, w, b = torch.randn(M, D).bfloat16(), torch.randn(D).bfloat16(), torch.randn(D).bfloat16()
    cases.append((f"ln fwd {mib}MiB D={D}", lambda x=x, w=w, b=b, D=D: torch_ln.layer_norm(x, (D,), w, b), 100 // mib))
for D in (1024, 4096):
    M = 16 * 2**20 // (2 * D)
    x, r, w = torch.randn(M, D).bfloat16(), torch.randn(M, D).bfloat16(), torch.randn(D).bfloat16()
    cases.append((f"add_rms fwd 16MiB D={D}", lambda x=x, r=r, w=w, D=D: torch_ln.add_rms_norm(x, r, (D,), w), 8))
    xg, wg = torch.randn(M, D).bfloat16().requires_grad_(), torch.randn(D).bfloat16().requires_grad_()
    y = torch_ln.layer_norm(xg, (D,), wg, None)
    g = torch.randn_like(y)
    grad = lambda y=y, g=g, xg=xg, wg=wg: torch.autograd.grad(y, (xg, wg), g, retain_graph=True)
    cases.append((f"ln bwd 16MiB D={D}", grad, 8))
for name, f, n in cases:
    times = {0: [], 1: []}
    for _ in range(9):
        for on in (1, 0):
            lib.tln_set_bf16(on)
            times[on].append(bench(f, n))
    new, old = statistics.median(times[1]), statistics.median(times[0])
    print(f"{name:26s} avx512bf16 {new * 1e3:.3f} ms  avx2 {old * 1e3:.3f} ms  new/old {new / old:.2f}", flush=True)
