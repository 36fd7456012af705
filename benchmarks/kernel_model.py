"""A model of the CUDA kernels on an H200, computed without a GPU.

For each benchmark case it runs the real launch planning and the emulated kernels (csrc/emulated, the exact
kernel source) on a few rows, scales the emulator's traffic counters to the case's M, reads registers and the
loads each thread keeps in flight from ptxas/SASS for sm_90 (benchmarks/kernel_resources.py), and predicts the
time from DRAM bytes, occupancy, waves, memory-level parallelism and launch overheads. benchmarks/README.md states
its assumptions and blind spots.

    python benchmarks/kernel_model.py [--json PATH] [--D 1024 4096] [--dtypes float32] [--ops rms_norm]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "emulated"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import emulated_build
import kernel_resources


@dataclass(frozen=True)
class Gpu:
    """The H200 the model predicts for."""

    sms: int = 132
    threads_per_sm: int = 2048
    l2_bytes: float = 50e6  # 60 MB of L2; about 50 MB usable by one kernel's stream
    copy_bandwidth: float = 4.3e12  # measured dst.copy_(src) bandwidth, bytes/s
    dram_latency_s: float = 1e-6  # loaded DRAM latency: Little's law's round trip
    launch_s: float = 4e-6  # per kernel launch (3-5 us)
    # A programmatic dependent launch (the backward's reduce): its launch overlaps the end of the kernel before it,
    # leaving the wait for that kernel's memory and its own blocks' start (assumed, not measured).
    dependent_launch_s: float = 1e-6
    max_cluster_blocks: int = 16  # sm_90's non-portable cluster size (the launchers opt in beyond 8)


H200 = Gpu()
CASE_BYTES = 256 * 2**20
DEFAULT_D = [256, 512, 768, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
COUNTERS = [
    "load_bytes",
    "store_bytes",
    "load_requests",
    "store_requests",
    "coalesced_bytes",
    "coalesced_sector_bytes",
    "scalar_requests",
    "unique_bytes",
    "dram_read_bytes",
    "dram_write_bytes",
    "shared_requests",
    "bank_conflicts",
    "barriers",
]

_ops = None


def ops():
    global _ops
    if _ops is None:
        emulated_build.load()
        _ops = torch.ops.torch_ln_emulated
    return _ops


def parameter_count(op: str) -> int:
    return 2 if op == "layer_norm" else 1


def moved_bytes_per_row(mode: str, D: int, elem: int) -> int:
    return D * elem * (2 if mode == "fwd" else 3)


def case_rows(mode: str, D: int, elem: int) -> int:
    """M such that the case moves about 256 MiB (x and y, or x, dy and dx), at least one row."""
    return max(1, CASE_BYTES // moved_bytes_per_row(mode, D, elem))


def ideal_bytes(op: str, mode: str, D: int, M: int, elem: int) -> int:
    """fwd: read x, write y, read weight/bias once; bwd: read x and dy, write dx and dweight/dbias once."""
    return M * moved_bytes_per_row(mode, D, elem) + parameter_count(op) * D * elem


def _inputs(op: str, mode: str, D: int, rows: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, D, generator=g).to(dtype)
    weight = torch.randn(D, generator=g).to(dtype)
    bias = torch.randn(D, generator=g).to(dtype) if op == "layer_norm" else None
    dy = torch.randn(rows, D, generator=g).to(dtype)
    return x, weight, bias, dy


def emulate(op: str, mode: str, D: int, rows: int, dtype: torch.dtype, device: tuple) -> list[dict]:
    """The launches of one forward or backward call on an emulated device of `device` = (SMs, threads per SM[,
    shared memory per block, cluster blocks at most]): the emulator's counters, with the traffic of the inputs x, dy,
    weight, bias, mean, rstd apart ("regions")."""
    o = ops()
    x, weight, bias, dy = _inputs(op, mode, D, rows, dtype)
    o.set_device(*device)
    o.set_counting(True)
    named = {"x": x, "weight": weight, **({"bias": bias} if bias is not None else {})}
    o.set_regions(list(named), list(named.values()))
    try:
        if op == "layer_norm":
            _, mean, rstd = o.layer_norm_fwd(x, [D], weight, bias, 1e-5)
            named["mean"] = mean
        else:
            _, rstd = o.rms_norm_fwd(x, [D], weight, 1e-6)
        log = json.loads(o.take_launch_log())
        if mode == "bwd":
            named.update(dy=dy, rstd=rstd)
            o.set_regions(list(named), list(named.values()))
            if op == "layer_norm":
                o.layer_norm_bwd(dy, x, [D], named["mean"], rstd, weight, bias, [True, True, True])
            else:
                o.rms_norm_bwd(dy, x, [D], rstd, weight, [True, True])
            log = json.loads(o.take_launch_log())
    finally:
        o.set_counting(False)
        o.set_regions([], [])
        o.set_device(2, 2048)
    return log


def _fit(samples: list[tuple[list[float], dict]]) -> dict:
    """Least squares of every counter on the given regressors (exact for the 2 or 3 runs below)."""
    import numpy as np

    a = np.array([s[0] for s in samples], dtype=float)
    out = {}
    for key in samples[0][1]:
        b = np.array([s[1][key] for s in samples], dtype=float)
        out[key] = np.linalg.lstsq(a, b, rcond=None)[0]
    return out


def _per_kernel(log: list[dict]) -> dict[str, dict]:
    return {launch["kernel"]: {c: launch[c] for c in COUNTERS} for launch in log}


def one_wave(mode: str, plan: dict) -> bool:
    """Whether the row kernel's grid is capped at one wave (limit_to_one_wave, limit_to_resident_clusters): the
    register and shared-memory kernels; the forward's multi-pass kernel has a block a row."""
    return mode == "bwd" or plan["path"] in ("registers", "shared", "reread")


def scaled_traffic(op: str, mode: str, D: int, M: int, dtype: torch.dtype, plan: dict, concurrent_blocks: int):
    """Each kernel's counters at M rows (and the full plan's grid), from small emulated runs.

    Every counter is linear in the rows and in the blocks (each block of the register kernels copies the forward's
    weight and bias, or writes the backward's partial rows, once): count = fixed + per_row * rows + per_block *
    blocks. A one-wave grid is capped by the device (set_device), so three runs separate rows from blocks; the
    forward's multi-pass grid is one block a row, so two runs fit it. The emulator's L2 model is told how many
    blocks the full-size launch keeps in flight."""
    o = ops()
    rpb, threads = plan["rows_per_block"], plan["block_threads"]
    o.set_l2_model(H200.l2_bytes, concurrent_blocks)
    cluster = max(1, plan["cluster"]) * plan["partial_cluster"]  # a launch's cluster: groups of a row's blocks
    rpb *= plan["partial_cluster"]  # the backward groups its blocks (rows' clusters) only where the rows fill them
    if not one_wave(mode, plan):
        runs = [(rpb, 1 << 20), (2 * rpb, 1 << 20)]  # (rows, SMs): uncapped grid, blocks = rows / rpb
        regress = [lambda r, b: [1.0, r]] * 2
        full = [1.0, M]
    else:  # one SM of one block (a cluster of them on as many SMs), then two
        runs = [(2 * rpb, cluster), (4 * rpb, cluster), (4 * rpb, 2 * cluster)]
        regress = [lambda r, b: [1.0, r, b]] * 3
        full = [1.0, M, plan["blocks"]]
    kernels: dict[str, list] = {}
    for (rows, sms), reg in zip(runs, regress):
        log = emulate(op, mode, D, rows, dtype, (sms, threads, None, H200.max_cluster_blocks))
        blocks = log[0]["grid"]
        for name, counters in _per_kernel(log).items():
            kernels.setdefault(name, []).append((reg(rows, blocks), counters))
    o.set_l2_model(H200.l2_bytes, 0)
    out = {}
    for name, samples in kernels.items():
        coeffs = _fit(samples)
        out[name] = {k: max(0.0, float(sum(c * f for c, f in zip(v, full)))) for k, v in coeffs.items()}
    return out


def row_kernel_smem(op: str, mode: str, plan: dict, D: int, elem: int, staged: bool = True) -> int:
    """Dynamic shared memory of the row kernel (launchers in csrc/cuda): two float32 per warp for the row sums
    of rows over 32 threads; the backward with several rows a block (or a cluster of blocks) adds their partial rows on
    chip; the forward's
    register kernel keeps its copy of the weight and bias (`staged`) ahead of them; the shared-memory kernel's, as
    the plan says (its slice of the row, and of the weight and bias where they fit)."""
    if plan["path"] in ("shared", "reread"):
        return plan["shared_smem"]
    smem = 2 * 4 * (plan["block_threads"] // 32) if plan["threads_per_row"] > 32 else 0
    if mode == "bwd" and (plan["rows_per_block"] > 1 or plan["partial_cluster"] > 1):
        smem = max(smem, plan["rows_per_block"] * D * 4)
    if staged and mode == "fwd" and plan["path"] == "registers":
        smem += -(-parameter_count(op) * D * elem // 16) * 16
    return smem


def kernel_time(dram_bytes: float, resident_threads: int, bytes_in_flight: int, waves: float) -> float:
    """Seconds for one kernel: DRAM bytes at the lesser of copy bandwidth and what Little's law allows
    (resident threads x bytes each keeps in flight / DRAM latency), stretched by the last wave's tail."""
    mlp_bandwidth = resident_threads * max(bytes_in_flight, 1) / H200.dram_latency_s
    bandwidth = min(H200.copy_bandwidth, mlp_bandwidth)
    tail = math.ceil(waves) / waves if waves > 1 else 1.0
    return dram_bytes / bandwidth * tail


def model_case(op: str, mode: str, dtype_name: str, D: int, resources: dict, M: int | None = None) -> dict:
    # The backward's reduce has 2 x D / 32 blocks of alike work on disjoint columns: 8 of each row run, scaled.
    # (The row kernels of the model's runs have at most 2 blocks.)
    ops().set_block_sample(8)
    try:
        return _model_case(op, mode, dtype_name, D, resources, M)
    finally:
        ops().set_block_sample(0)


def _model_case(op: str, mode: str, dtype_name: str, D: int, resources: dict, M: int | None) -> dict:
    dtype = DTYPES[dtype_name]
    elem = torch.empty(0, dtype=dtype).element_size()
    M = M if M is not None else case_rows(mode, D, elem)
    o = ops()

    def plan_on_h200(blocks_per_sm: int = 0) -> list[int]:
        o.set_device(H200.sms, H200.threads_per_sm, None, H200.max_cluster_blocks)  # and an sm_90's 227 KB
        try:
            return o.plan(mode, M, D, elem, True, blocks_per_sm, parameter_count(op))
        finally:
            o.set_device(2, 2048)

    vec, items, tpr, rpb, blocks, cluster, shared_smem, slice_params, row_on_chip, partial_cluster = plan_on_h200()
    plan = {
        "vec": vec,
        "items": items,
        "threads_per_row": tpr,
        "rows_per_block": rpb,
        "blocks": blocks,
        "block_threads": tpr * rpb,
        # The shared-memory path keeps the row on chip, or (the backward's longest rows) reads it twice.
        "path": "registers" if items > 0 else ("shared" if row_on_chip else "reread") if cluster > 0 else "multipass",
        "cluster": cluster,
        "partial_cluster": partial_cluster,  # the backward's groups (blocks, rows' clusters) of one partial row
        "shared_smem": shared_smem,
        "slice_params": bool(slice_params),
    }
    # The row kernel's residency from its registers (found by name after one small run).
    probe = emulate(op, mode, D, rpb, dtype, (1 << 20, plan["block_threads"], None, H200.max_cluster_blocks))
    names = [launch["kernel"] for launch in probe]
    dependent = {launch["kernel"]: launch["dependent"] for launch in probe}
    row_kernel = names[0]
    res = {n: resources.get(n, {}) for n in names}
    registers = res[row_kernel].get("registers", 32)
    per_sm = kernel_resources.blocks_per_sm(registers, plan["block_threads"], row_kernel_smem(op, mode, plan, D, elem))
    # The forward's launcher copies the weight and bias to shared memory only where that keeps the occupancy its
    # registers allow; the emulated runs below always do (the emulated device does not count shared memory).
    unstaged_smem = row_kernel_smem(op, mode, plan, D, elem, staged=False)
    unstaged = kernel_resources.blocks_per_sm(registers, plan["block_threads"], unstaged_smem)
    assert per_sm == unstaged, f"{op} {dtype_name} D={D}: the launcher would not stage the weight here"
    if one_wave(mode, plan):  # one wave at the kernel's occupancy (limit_to_one_wave)
        blocks = plan["blocks"] = plan_on_h200(per_sm)[4]
    resident_blocks = min(blocks, H200.sms * per_sm)
    traffic = scaled_traffic(op, mode, D, M, dtype, plan, resident_blocks)

    total = {c: sum(t[c] for t in traffic.values()) for c in COUNTERS}
    seconds = 0.0
    for name, t in traffic.items():
        r = res.get(name, {})
        if name == row_kernel:
            threads, grid, bps = plan["block_threads"], blocks, per_sm
        else:  # the backward's reduce: 2 x ceil(D / 4 / 32) blocks of 512 threads (float32 vectors of 4)
            threads, grid = 512, 2 * math.ceil(D / 4 / 32)
            bps = kernel_resources.blocks_per_sm(r.get("registers", 32), threads, r.get("static_smem", 0))
        resident_threads = min(grid, H200.sms * bps) * threads
        waves = grid / (H200.sms * bps)
        dram = t["dram_read_bytes"] + t["dram_write_bytes"]
        launch_s = H200.dependent_launch_s if dependent[name] else H200.launch_s
        seconds += kernel_time(dram, resident_threads, r.get("bytes_in_flight", 4), waves) + launch_s
    dram_total = total["dram_read_bytes"] + total["dram_write_bytes"]
    if mode == "bwd" and plan["path"] == "multipass":  # at::zeros of the partial rows before the multi-pass backward
        memset = blocks * D * 4 * parameter_count(op)
        dram_total += memset
        seconds += memset / H200.copy_bandwidth + H200.launch_s
    ideal = ideal_bytes(op, mode, D, M, elem)
    plan.update({"blocks_per_sm": per_sm, "waves": round(blocks / (H200.sms * per_sm), 3)})
    plan["loads_in_flight"] = res[row_kernel].get("loads_in_flight")
    return {
        "op": op,
        "mode": mode,
        "dtype": dtype_name,
        "D": D,
        "M": M,
        "plan": plan,
        "ideal_bytes": ideal,
        "requested_bytes": round(total["load_bytes"] + total["store_bytes"]),
        "dram_bytes": round(dram_total),
        "sector_efficiency": round(total["coalesced_bytes"] / total["coalesced_sector_bytes"], 4)
        if total["coalesced_sector_bytes"]
        else 1.0,
        "registers": max(r.get("registers", 0) for r in res.values()),
        "spill_bytes": max(r.get("spill_stores", 0) + r.get("spill_loads", 0) for r in res.values()),
        "occupancy": round(per_sm * plan["block_threads"] / H200.threads_per_sm, 3),
        "predicted_us": round(seconds * 1e6, 2),
        "predicted_fraction_of_copy": round(ideal / seconds / H200.copy_bandwidth, 3),
    }


def table(records: list[dict]) -> str:
    head = (
        f"{'op':<10} {'mode':<4} {'dtype':<8} {'D':>6} {'M':>7} {'path':<10} {'blk thr':>7} {'occ':>5} {'regs':>4} "
        f"{'spill':>5} {'req/ideal':>9} {'dram/ideal':>10} {'sect eff':>8} {'pred us':>8} {'% copy':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        p = r["plan"]
        path = p["path"]
        if p.get("cluster", 0) > 1:
            path = f"{'cluster' if path == 'shared' else path}{p['cluster']}"
            if p["partial_cluster"] > 1:  # launched in clusters of that many rows' clusters
                path += f"x{p['partial_cluster']}"
        lines.append(
            f"{r['op']:<10} {r['mode']:<4} {r['dtype']:<8} {r['D']:>6} {r['M']:>7} {path:<10} "
            f"{p['block_threads']:>7} {r['occupancy']:>5.2f} {r['registers']:>4} {r['spill_bytes']:>5} "
            f"{r['requested_bytes'] / r['ideal_bytes']:>9.2f} {r['dram_bytes'] / r['ideal_bytes']:>10.2f} "
            f"{r['sector_efficiency']:>8.3f} {r['predicted_us']:>8.1f} {100 * r['predicted_fraction_of_copy']:>5.0f}%"
        )
    return "\n".join(lines)


RECORD_KEYS = [
    "op",
    "mode",
    "dtype",
    "D",
    "M",
    "plan",
    "ideal_bytes",
    "requested_bytes",
    "dram_bytes",
    "sector_efficiency",
    "registers",
    "spill_bytes",
    "occupancy",
    "predicted_us",
    "predicted_fraction_of_copy",
]


def compare(csv_paths: list[Path], resources: dict) -> str:
    """Measured (the benchmark's CSVs, provider torch_ln) beside predicted, case by case: one GPU run calibrates."""
    import csv

    head = (
        f"{'op':<10} {'mode':<4} {'dtype':<8} {'D':>6} {'M':>7} {'measured us':>11} {'predicted us':>12} "
        f"{'meas/pred':>9} {'measured % copy':>15} {'predicted % copy':>16}"
    )
    lines = [head]
    for path in csv_paths:
        for row in csv.DictReader(path.open()):
            if (
                row["provider"] != "torch_ln"
                or row["mode"] not in ("fwd", "bwd")
                or math.isnan(float(row["ms"] or "nan"))
            ):
                continue
            r = model_case(row["op"], row["mode"], row["dtype"], int(row["D"]), resources, M=int(row["M"]))
            measured_us = float(row["ms"]) * 1e3
            lines.append(
                f"{r['op']:<10} {r['mode']:<4} {r['dtype']:<8} {r['D']:>6} {r['M']:>7} {measured_us:>11.1f} "
                f"{r['predicted_us']:>12.1f} {measured_us / r['predicted_us']:>9.2f} {row['pct_copy']:>15} "
                f"{100 * r['predicted_fraction_of_copy']:>15.0f}%"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the records here")
    parser.add_argument("--ops", nargs="+", default=["layer_norm", "rms_norm"], choices=["layer_norm", "rms_norm"])
    parser.add_argument("--modes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    parser.add_argument("--D", nargs="+", type=int, default=DEFAULT_D)
    parser.add_argument("--compare", nargs="+", type=Path, help="benchmark CSVs: print measured beside predicted")
    args = parser.parse_args(argv)
    resources = kernel_resources.compile_all(verbose=True)
    if args.compare:
        print(compare(args.compare, resources))
        return 0
    records = []
    for op in args.ops:
        for mode in args.modes:
            for dtype in args.dtypes:
                for D in args.D:
                    records.append(model_case(op, mode, dtype, D, resources))
                    print(table(records[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    assert all(list(r) == RECORD_KEYS for r in records)
    print(
        f"Model of the CUDA kernels on an H200 (not a measurement; see benchmarks/README.md), {CASE_BYTES >> 20} MiB per case"
    )
    print(table(records))
    if args.json:
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
