"""Makes the AOTInductor package that examples/cpp/run_aoti runs: a small pre-norm transformer whose norms are
torch_ln's, exported and compiled in Python.

Usage: python examples/cpp/make_model.py OUT_DIR [--device cpu|cuda]
Writes OUT_DIR/model.pt2, OUT_DIR/inputs.pt ([x], for run_aoti) and OUT_DIR/python_outputs.pt ([the eager model's
output, the package's output when Python runs it]).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import torch_ln

WIDTH, HEADS, LAYERS = 64, 4, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = torch_ln.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.mlp_norm = torch_ln.RMSNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).view(batch, tokens, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, tokens, WIDTH))
        return x + self.mlp(self.mlp_norm(x))


def model(device: str) -> nn.Module:
    torch.manual_seed(0)
    blocks = nn.Sequential(*(Block() for _ in range(LAYERS)), torch_ln.LayerNorm(WIDTH))
    return blocks.to(device).eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)

    net = model(args.device)
    x = torch.randn(2, 16, WIDTH, device=args.device)
    batch = torch.export.Dim("batch", min=1, max=64)
    exported = torch.export.export(net, (x,), dynamic_shapes=({0: batch},))
    # The point of the example: the package must call the torch_ln operators, not a decomposition.
    used = {str(node.target) for node in exported.graph.nodes if node.op == "call_function"}
    missing = {"torch_ln.layer_norm_fwd.default", "torch_ln.rms_norm_fwd.default"} - used
    assert not missing, f"the exported graph does not call {missing}"

    package = torch._inductor.aoti_compile_and_package(exported, package_path=str(args.out_dir / "model.pt2"))
    with torch.no_grad():
        eager = net(x)
    packaged = torch._inductor.aoti_load_package(package)(x)
    torch.save([x], args.out_dir / "inputs.pt")
    torch.save([eager, packaged], args.out_dir / "python_outputs.pt")
    print(f"wrote {package}")


if __name__ == "__main__":
    main()
