"""Benchmarks torch_ln.layer_norm against torch eager, torch.compile, Liger, Apex and QuACK.

Usage: python benchmarks/bench_layer_norm.py [--device cpu|cuda] [--quick] [--help for all flags]
"""

import sys

from harness import cli

if __name__ == "__main__":
    sys.exit(cli("layer_norm"))
