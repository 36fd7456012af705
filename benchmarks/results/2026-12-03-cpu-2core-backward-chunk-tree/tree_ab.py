"""In-process A/B of the CPU backward's chunk-tree sum (ab.txt). Needs an experiment build whose
backward_by_row_chunks calls tree.sum_owned only when TLN_LOCAL_TREE is not "0": "local" sums each subtree in
the thread that ran its chunks (as now), "after" sums the whole tree after the row pass, parallel over columns."""

import os

import torch

import torch_ln  # noqa: F401
from torch_ln import benchmark as harness

SETTINGS = {"after": "0", "local": "1"}


def main():
    torch.set_num_threads(2)
    for dtype in (torch.float32, torch.bfloat16):
        for d in (256, 1024, 4096):
            m = (1 << 20) // d // dtype.itemsize
            x, dy = torch.randn(m, d, dtype=dtype), torch.randn(m, d, dtype=dtype)
            weight, bias = torch.randn(d, dtype=dtype), torch.randn(d, dtype=dtype)
            _, mean, rstd = torch.ops.torch_ln.layer_norm_fwd(x, [d], weight, bias, 1e-5)

            def backward(x=x, dy=dy, d=d, mean=mean, rstd=rstd, weight=weight, bias=bias):
                return torch.ops.torch_ln.layer_norm_bwd(dy, x, [d], mean, rstd, weight, bias, [True, True, True])

            times = harness.environment_ab(backward, "TLN_LOCAL_TREE", SETTINGS, rounds=11)
            outs = {}
            for name, value in SETTINGS.items():
                os.environ["TLN_LOCAL_TREE"] = value
                outs[name] = backward()
            same = all(torch.equal(a, b) for a, b in zip(outs["after"], outs["local"]))
            print(f"{str(dtype)[6:]} {m}x{d}: {harness.paired_ratios(times, 'after', 'local')}, bitwise equal {same}")


if __name__ == "__main__":
    main()
