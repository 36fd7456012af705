"""Activation memory and time of a small pre-norm transformer's training step, with and without the norms'
memory_efficient option (issue 39 item 2), and the time of a norm's backward alone.

The model: --layers pre-norm blocks (norm, attention through F.scaled_dot_product_attention, norm, SiLU MLP of 4x the
width) built from torch ops and torch_ln's modules: RMSNorm, or LayerNorm without bias (memory_efficient with a bias
is refused below float64, see tests/test_memory_efficient.py). Per option:
  saved_MiB    the distinct storages autograd holds for the backward once the forward has run (saved-tensor hooks:
               a tensor saved twice, or saved and also an output, counts once); what memory_efficient reduces
  peak_MiB     CUDA only: torch.cuda.max_memory_allocated over the step, above what was allocated before it
  step_ms      forward + backward of the model
  norm_bwd_ms  the backward of one norm alone, [batch x seq, hidden] (torch_ln's kernel from x, or from y)

    python benchmarks/bench_memory_efficient.py --out bench_out                       # CPU, float32
    python benchmarks/bench_memory_efficient.py --device cuda --dtype bfloat16 --batch 8 --seq 1024 --hidden 2048
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from harness import add_model_step_arguments, peak_memory_mib, write_rows
from torch import nn

import torch_ln
from torch_ln._timing import FULL, QUICK, device_name, measure

OPTIONS = {"saves x": False, "memory_efficient": True}


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, norm: str, memory_efficient: bool) -> None:
        super().__init__()

        def make_norm():
            if norm == "rms":
                return torch_ln.RMSNorm(hidden, memory_efficient=memory_efficient)
            return torch_ln.LayerNorm(hidden, bias=False, memory_efficient=memory_efficient)

        self.heads = heads
        self.norm1, self.norm2 = make_norm(), make_norm()
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.up = nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(self.norm1(x)).unflatten(-1, (3, self.heads, -1)).transpose(1, 3).unbind(2)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).flatten(2))
        return x + self.down(F.silu(self.up(self.norm2(x))))


def _model(args, memory_efficient: bool) -> nn.Module:
    torch.manual_seed(0)
    blocks = [Block(args.hidden, args.hidden // 64, args.norm, memory_efficient) for _ in range(args.layers)]
    return nn.Sequential(*blocks).to(args.device, getattr(torch, args.dtype))


def _saved_bytes(step_forward) -> int:
    """Bytes of the distinct storages autograd saves during step_forward(), kept alive until it returns."""
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = step_forward()
    del out
    return sum(storages.values())


def run(args) -> list[dict]:
    timing = QUICK if args.quick else FULL
    dtype = getattr(torch, args.dtype)
    x = torch.randn(args.batch, args.seq, args.hidden, device=args.device, dtype=dtype)
    rows, steps, norm_bwds, saved, peak = [], {}, {}, {}, {}
    for option, memory_efficient in OPTIONS.items():
        model = _model(args, memory_efficient)
        leaf = x.clone().requires_grad_()
        saved[option] = _saved_bytes(lambda model=model, leaf=leaf: model(leaf))

        def step(model=model, leaf=leaf):
            model(leaf).float().pow(2).mean().backward()

        peak[option] = peak_memory_mib(step, args.device)
        steps[option] = step
        # One norm's backward alone, through autograd: the same forward, so the same y and statistics.
        norm = model[0].norm1
        norm_in = torch.randn(args.batch * args.seq, args.hidden, device=args.device, dtype=dtype, requires_grad=True)
        norm_out = norm(norm_in)
        grad = torch.randn_like(norm_out)
        norm_bwds[option] = lambda norm_out=norm_out, norm_in=norm_in, grad=grad: torch.autograd.grad(
            norm_out, norm_in, grad, retain_graph=True
        )
    step_ms, norm_ms = measure(steps, args.device, timing), measure(norm_bwds, args.device, timing)
    for option in OPTIONS:
        row = {
            "norm": args.norm,
            "dtype": args.dtype,
            "option": option,
            "saved_MiB": round(saved[option] / 2**20, 2),
            "saved_vs_plain": round(saved[option] / saved["saves x"], 3),
            "peak_MiB": round(peak[option], 2) if peak[option] is not None else "",
            "step_ms": round(step_ms[option], 3),
            "norm_bwd_ms": round(norm_ms[option], 4),
        }
        rows.append(row)
        print(
            f"{args.norm:5} {args.dtype:9} {option:16} saved {row['saved_MiB']:9.2f} MiB (x{row['saved_vs_plain']})"
            f"  peak {row['peak_MiB'] or '-':>9} MiB  step {row['step_ms']:9.3f} ms  norm bwd {row['norm_bwd_ms']} ms",
            flush=True,
        )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_step_arguments(parser, hidden=512)
    parser.add_argument("--norms", nargs="+", default=["rms", "layer"], choices=("rms", "layer"))
    parser.add_argument("--out", type=Path, default=None, help="folder for memory_efficient.csv")
    args = parser.parse_args(argv)
    print(
        f"# {device_name(args.device)}, torch {torch.__version__}, {args.layers} blocks, hidden {args.hidden}, "
        f"batch {args.batch} x seq {args.seq}",
        flush=True,
    )
    rows = []
    for norm in args.norms:
        args.norm = norm
        rows += run(args)
    if args.out is not None:
        write_rows(rows, args.out / "memory_efficient.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
