"""In-process A/B of the CPU backward's row-chunk rule (ab.txt). Needs an experiment build whose backward_chunks
reads TLN_CHUNK_BYTES (0: chunks of 16 rows, as before; 131072: at least 128 KiB of dy per chunk, as now)."""

import torch

import torch_ln  # noqa: F401  (registers torch.ops.torch_ln)
from torch_ln import benchmark as harness

RULES = {"16 rows": "0", "128 KiB": "131072"}


def main():
    torch.set_num_threads(2)
    for d in (256, 512):
        m = (1 << 18) // d  # 1 MiB of float32
        x, dy = torch.randn(m, d), torch.randn(m, d)
        weight, bias = torch.randn(d), torch.randn(d)
        _, mean, rstd = torch.ops.torch_ln.layer_norm_fwd(x, [d], weight, bias, 1e-5)

        def backward(x=x, dy=dy, d=d, mean=mean, rstd=rstd, weight=weight, bias=bias):
            return torch.ops.torch_ln.layer_norm_bwd(dy, x, [d], mean, rstd, weight, bias, [True, True, True])

        times = harness.environment_ab(backward, "TLN_CHUNK_BYTES", RULES, rounds=15)
        print(f"D={d}: {harness.paired_ratios(times, '16 rows', '128 KiB')}")


if __name__ == "__main__":
    main()
