"""Benchmarks torch_ln.rms_norm against torch eager, torch.compile, Liger, Apex and QuACK.

Usage: python benchmarks/bench_rms_norm.py [--device cpu|cuda] [--quick] [--help for all flags]
"""

import sys

from harness import cli

if __name__ == "__main__":
    sys.exit(cli("rms_norm"))
