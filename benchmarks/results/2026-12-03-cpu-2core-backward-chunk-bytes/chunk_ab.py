"""In-process A/B of the CPU backward's row-chunk rule (ab.txt). Needs an experiment build whose backward_chunks
reads TLN_CHUNK_BYTES (0: chunks of 16 rows, as before; 131072: at least 128 KiB of dy per chunk, as now)."""

import os
import statistics
import time

import torch

import torch_ln  # noqa: F401  (registers torch.ops.torch_ln)

RULES = {"16 rows": "0", "128 KiB": "131072"}


def time_us(fn, calls=300):
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main():
    torch.set_num_threads(2)
    for d in (256, 512):
        m = (1 << 18) // d  # 1 MiB of float32
        x, dy = torch.randn(m, d), torch.randn(m, d)
        weight, bias = torch.randn(d), torch.randn(d)
        _, mean, rstd = torch.ops.torch_ln.layer_norm_fwd(x, [d], weight, bias, 1e-5)

        def backward(x=x, dy=dy, d=d, mean=mean, rstd=rstd, weight=weight, bias=bias):
            return torch.ops.torch_ln.layer_norm_bwd(dy, x, [d], mean, rstd, weight, bias, [True, True, True])

        times = {rule: [] for rule in RULES}
        for _ in range(15):
            for rule, setting in RULES.items():
                os.environ["TLN_CHUNK_BYTES"] = setting
                times[rule].append(time_us(backward))
        ratios = [new / old for old, new in zip(times["16 rows"], times["128 KiB"])]
        print(
            f"D={d}: 16-row chunks median {statistics.median(times['16 rows']):.1f} us, "
            f"128 KiB chunks {statistics.median(times['128 KiB']):.1f} us, paired ratio median "
            f"{statistics.median(ratios):.3f} min {min(ratios):.3f} max {max(ratios):.3f}"
        )


if __name__ == "__main__":
    main()
