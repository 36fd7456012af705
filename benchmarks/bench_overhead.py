"""Per-call overhead of a small LayerNorm on the CPU: torch_ln's eager path (public function, module, the operator
called directly through torch.ops and through its binding in torch_ln._C) against torch's, forward alone and forward +
backward, inputs that require grad.

Thread CPU time (time.thread_time_ns) over batches of calls, one intra-op thread so that the calling thread does all
the work: on a shared machine wall time counts other processes' time too. Providers are interleaved batch by batch;
min and 25th percentile of the per-call time over the batches are printed, in microseconds.

    python benchmarks/bench_overhead.py                 # 4x1024 float32, 1000 calls a batch, 40 batches
    python benchmarks/bench_overhead.py --modes fwd --providers torch_ln op --batches 80
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import torch_ln


def providers(d: int, dtype: torch.dtype) -> dict:
    weight = torch.randn(d, dtype=dtype, requires_grad=True)
    bias = torch.randn(d, dtype=dtype, requires_grad=True)
    torch_module, our_module = torch.nn.LayerNorm(d, dtype=dtype), torch_ln.LayerNorm(d, dtype=dtype)
    op = torch.ops.torch_ln.layer_norm.default
    return {
        "torch": lambda x: torch.nn.functional.layer_norm(x, (d,), weight, bias),
        "op": lambda x: op(x, [d], weight, bias, 1e-5),
        "_C": lambda x: torch_ln._C.layer_norm(x, [d], weight, bias, 1e-5),
        "torch_ln": lambda x: torch_ln.layer_norm(x, (d,), weight, bias),
        "torch_ln.LayerNorm": our_module,
        "nn.LayerNorm": torch_module,
    }


def batch_us(fn, x: torch.Tensor, grad: torch.Tensor, backward: bool, calls: int) -> float:
    start = time.thread_time_ns()
    if backward:
        for _ in range(calls):
            fn(x).backward(grad)
    else:
        for _ in range(calls):
            fn(x)
    return (time.thread_time_ns() - start) / calls / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--M", type=int, default=4)
    parser.add_argument("--D", type=int, default=1024)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    parser.add_argument("--modes", nargs="+", default=["fwd", "fwd+bwd"], choices=["fwd", "fwd+bwd"])
    parser.add_argument("--providers", nargs="+", default=None, help="a subset of the providers (default: all)")
    parser.add_argument("--calls", type=int, default=1000, help="calls per timed batch")
    parser.add_argument("--batches", type=int, default=40, help="timed batches per provider and mode")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    fns = providers(args.D, dtype)
    chosen = args.providers or list(fns)
    x = torch.randn(args.M, args.D, dtype=dtype, requires_grad=True)
    grad = torch.randn(args.M, args.D, dtype=dtype)
    print(f"{args.M}x{args.D} {args.dtype}, {args.calls} calls x {args.batches} batches, us per call (thread time)")
    print(f"{'mode':8} {'provider':20} {'min':>7} {'p25':>7}")
    for mode in args.modes:
        backward = mode == "fwd+bwd"
        for name in chosen:  # warm-up
            batch_us(fns[name], x, grad, backward, args.calls // 10 + 1)
        times = {name: [] for name in chosen}
        for _ in range(args.batches):
            for name in chosen:
                times[name].append(batch_us(fns[name], x, grad, backward, args.calls))
        for name in chosen:
            p25 = statistics.quantiles(times[name], n=4)[0]
            print(f"{mode:8} {name:20} {min(times[name]):7.2f} {p25:7.2f}")


if __name__ == "__main__":
    main()
