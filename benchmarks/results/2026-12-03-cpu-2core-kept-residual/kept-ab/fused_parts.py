"""The fused bfloat16 forward against the unfused pair in one process (ab16.txt), and with --pieces its parts too
(parts.txt): torch's add, torch_ln's norm, and two clones (the fused op's bytes). Milliseconds per call.

    PYTHONPATH=<checkout> python fused_parts.py --mib 16 --seconds 2                      # ab16.txt, per process
    PYTHONPATH=<checkout> python fused_parts.py --mib 16 --seconds 3 --pieces --ops rms   # parts.txt (and --ops ln)
"""

import argparse

import torch

import torch_ln
from torch_ln import benchmark as harness


def steps(op: str, M: int, D: int, pieces: bool) -> dict:
    x, residual = torch.randn(M, D).bfloat16(), torch.randn(M, D).bfloat16()
    weight, bias = torch.randn(D).bfloat16(), torch.randn(D).bfloat16()
    h = x + residual
    if op == "rms":

        def norm(t):
            return torch_ln.rms_norm(t, (D,), weight, 1e-6)

        def fused():
            return torch_ln.add_rms_norm(x, residual, (D,), weight, 1e-6)
    else:

        def norm(t):
            return torch_ln.layer_norm(t, (D,), weight, bias)

        def fused():
            return torch_ln.add_layer_norm(x, residual, (D,), weight, bias)

    chosen = {"pair": lambda: norm(x + residual), "fused": fused}
    if pieces:
        chosen |= {"add": lambda: x + residual, "norm": lambda: norm(h), "copy2": lambda: (x.clone(), residual.clone())}
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=16, help="MiB of x per case")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--ops", nargs="+", default=["rms", "ln"], choices=["rms", "ln"])
    parser.add_argument("--pieces", action="store_true")
    args = parser.parse_args()
    harness.keep_freed_memory()
    line = []
    for op in args.ops:
        for D in (1024, 4096, 16384):
            M = (args.mib << 20) // (2 * D)
            t = harness.measure(steps(op, M, D, args.pieces), "cpu", harness.Timing(seconds=args.seconds, rounds=1))
            if args.pieces:
                print(
                    op, D, "  ".join(f"{k} {v:.2f}" for k, v in t.items()), f" fused/pair {t['fused'] / t['pair']:.2f}"
                )
            else:
                line.append(f"{op}{D}:{t['fused']:.3f}/{t['fused'] / t['pair']:.3f}")
    if line:
        print(" ".join(line))


if __name__ == "__main__":
    main()
