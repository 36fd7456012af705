"""A per-unit cycle model of the CUDA kernels on an H200, computed without a GPU.

Each row kernel runs as resident *units* that walk rows one at a time: a warp that holds whole rows (rows of up to
32 threads), a block (its rows share block barriers), or a thread-block cluster (a row staged over its blocks'
shared memory; the backward's clusters of 16 walk their groups' rows in lockstep). A unit does load -> reduce ->
store for one row before it issues the next row's loads, so its **period** is a sum of phases (DRAM burst latency,
the burst's own transfer, stores, block barriers, distributed-shared-memory reads of the cluster reductions,
shared-memory passes), and units overlap only with one another:

    time = max(steps x period, DRAM bytes / copy bandwidth) + launches (+ the backward's reduce kernel)

where `steps` is the rows each unit walks (the grid is one wave of units). What goes into a period comes from the
real kernels, not from fitted guesses:
- the launch plan (`plan_rows` through the emulated build) and the residency: registers and shared memory from
  ptxas for sm_90 (benchmarks/kernel_resources.py), blocks per SM from the occupancy rules, clusters of 8 and 16
  leaving 4 of 132 SMs idle;
- the bytes each unit loads and stores per row, from the SIMT emulator's counters (csrc/emulated: the exact kernel
  source, run on a few rows and regressed per row, per block and fixed);
- the dependent chain per row (block barriers, cluster reductions and the ranks they read, shared-memory bytes,
  load rounds), counted from the kernels' structure here and checked against the emulator's shared-memory request
  and barrier counts (`structure_check`: a mismatch means the kernels changed and this model no longer describes
  them).

Seven constants turn those counts into time (CALIBRATION below): six fitted by least squares on the 16 LayerNorm
cells of the first H200 run, the seventh (lone DRAM round trips) on its 16 fused-add cells (`--calibrate`); one more
(lone L2 round trips) is assumed. benchmarks/README.md states the assumptions and blind spots. The figures are a
model's, not measurements: until a GPU run confirms them they are not expected performance.

    python benchmarks/kernel_model.py [--json PATH] [--D 1024 4096] [--dtypes float32] [--ops rms_norm] [--fused]
    python benchmarks/kernel_model.py --compare bench/layer_norm_cuda.csv [more CSVs]
    python benchmarks/kernel_model.py --calibrate R/{layer_norm,add_layer_norm,add_rms_norm}_cuda.csv --out FIT.json
    python benchmarks/kernel_model.py --predict OUT_DIR      # the cells of scripts/gpu_check.sh's bench phase
    python benchmarks/kernel_model.py --score OUT_DIR/predictions.csv RUN/*_cuda.csv   # no emulator or ptxas
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import math
import sys
import time
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
    """The H200 the model predicts for: hardware facts, none fitted."""

    sms: int = 132
    threads_per_sm: int = 2048
    l2_bytes: float = 50e6  # 60 MB of L2; about 50 MB usable by one kernel's stream
    copy_bandwidth: float = 4.286e12  # dst.copy_(src), bytes/s, as the first H200 run's harness measured it
    launch_s: float = 4e-6  # per kernel launch (3-5 us)
    # A programmatic dependent launch (the backward's reduce): its launch overlaps the end of the kernel before it.
    dependent_launch_s: float = 1e-6
    max_cluster_blocks: int = 16  # sm_90's non-portable cluster size (the launchers opt in beyond 8)
    max_shared_per_block: int = 227 * 1024  # dynamic shared memory a block may opt in to
    l1_shared_bytes: int = 256 * 1024  # an SM's L1 data cache and shared memory, one array
    # The shared-memory carveouts an sm_90 SM can be configured with (KiB); the rest of the 256 KiB is L1.
    carveouts_kib: tuple[int, ...] = (0, 8, 16, 32, 64, 100, 132, 164, 196, 228)


H200 = Gpu()
CASE_BYTES = 256 * 2**20
BENCH_BYTES = 2 * 2**30  # the GPU benchmarks' x per case (bench_*.py --device cuda)
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

# The period's terms: each feature of a step (one row per unit) times its constant, in microseconds per unit.
FEATURES = {
    "latency": "DRAM burst latency: bursts of loads in flight together per step (a burst beyond the L1 left beside "
    "the shared-memory carveout counts as burst / L1 bursts)",
    "lone_dram": "lone DRAM round trips per step: a load from DRAM used before the next is issued (the fused add's "
    "residual and its gradient, read vector by vector, each in its own branch)",
    "load_kib": "the unit's own loads per SM per step: the last load of a burst waits behind the rest",
    "store_kib": "the SM's stores per step (all its units): a unit's next loads queue behind them",
    "barriers": "block barriers per step (__syncthreads, with the warps' skew and the row sums read between them)",
    "dsmem_ranks": "ranks read over distributed shared memory per step: each cluster reduction of the calibrated "
    "kernels read every block's partials (generic loads, after a cluster barrier that fences the GPU: MEMBAR.ALL.GPU); "
    "0 for today's kernels, which exchange them by st.async and mbarriers (cluster_exchanges)",
    "shared_kib": "the SM's shared-memory vector traffic per step (staging, passes, weights, gradient sums)",
}

# Not fitted: a lone round trip that hits L2 (the backward's second read of a row too long for the cluster's shared
# memory, weights read per row from global memory). No calibration cell isolates it; Hopper-class L2 hits take about
# 200-300 cycles (about 0.13 us at 1.98 GHz): an assumption, to be measured (ncu: l1tex__t_sectors_lookup_hit).
#
# Not fitted either: a cluster reduction's exchange (ClusterReduce2: each block's results stored into every block by
# st.async, completing on the receiver's mbarrier; no cluster barrier), which no measured kernel had. Its dependent
# chain is one distributed shared-memory store (about 180-210 cycles on Hopper by published microbenchmarks) and the
# mbarrier's completion and wake-up: about 0.2 us, an assumption to be measured (ncu: the shared-memory kernels'
# stall reasons at the mbarrier wait).
ASSUMED_US_PER = {"lone_l2": 0.13, "cluster_exchanges": 0.2}

# Fitted by `--calibrate` on benchmarks/results/2026-12-04-h200-torch2.11/
# {layer_norm,add_layer_norm,add_rms_norm}_cuda.csv
# (weighted non-negative least squares on the relative error of the predicted times: stage 1, every constant but
# lone_dram on the 16 LayerNorm cells, provider torch_ln; stage 2, lone_dram on the 16 fused-add cells, provider
# fused). The fit's figures, the per-cell ratios and the leave-one-out check are in
# benchmarks/results/2026-12-04-kernel-model-predictions/ (calibration.txt, calibration.json); tests/emulated/
# test_kernel_model.py checks that these are that fit's constants.
CALIBRATION = {
    "source": "benchmarks/results/2026-12-04-h200-torch2.11/{layer_norm,add_layer_norm,add_rms_norm}_cuda.csv",
    "us_per": {
        "latency": 1.799064,
        "lone_dram": 0.47383,
        "load_kib": 0.004359,
        "store_kib": 0.02559,
        "barriers": 0.205084,
        "dsmem_ranks": 0.145252,
        "shared_kib": 0.007041,
    },
}

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


def bench_rows(D: int, elem: int) -> int:
    """The GPU benchmarks' M: 2 GiB of x."""
    return max(1, BENCH_BYTES // (D * elem))


def ideal_bytes(op: str, mode: str, D: int, M: int, elem: int) -> int:
    """fwd: read x, write y, read weight/bias once; bwd: read x and dy, write dx and dweight/dbias once."""
    return M * moved_bytes_per_row(mode, D, elem) + parameter_count(op) * D * elem


def bench_bytes(op: str, mode: str, D: int, M: int, es: int, fused: bool = False) -> int:
    """The bytes the benchmarks divide by the time (harness.layer_norm_bytes / rms_norm_bytes, and
    bench_add_norm.add_norm_bytes for the fused add), parameters in the input's dtype."""
    nparams = parameter_count(op)
    nstats = 2 if op == "layer_norm" else 1
    if fused:
        if mode == "fwd":
            return 4 * M * D * es + nparams * D * es + nstats * M * 4
        return 4 * M * D * es + nstats * M * 4 + D * es + nparams * D * es
    if mode == "fwd":
        return 2 * M * D * es + nparams * D * es + nstats * M * 4
    return 3 * M * D * es + nstats * M * 4 + D * es + nparams * D * es


def _inputs(op: str, D: int, rows: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, D, generator=g).to(dtype)
    weight = torch.randn(D, generator=g).to(dtype)
    bias = torch.randn(D, generator=g).to(dtype) if op == "layer_norm" else None
    dy = torch.randn(rows, D, generator=g).to(dtype)
    residual = torch.randn(rows, D, generator=g).to(dtype)
    dh = torch.randn(rows, D, generator=g).to(dtype)
    return x, weight, bias, dy, residual, dh


def emulate(
    op: str, mode: str, D: int, rows: int, dtype: torch.dtype, device: tuple, fused: bool = False
) -> list[dict]:
    """The launches of one forward or backward call on an emulated device of `device` = (SMs, threads per SM[,
    shared memory per block, cluster blocks at most[, shared memory per SM counted in residency]]): the emulator's
    counters, with the traffic of the inputs x, dy, weight, bias, mean, rstd (and the fused add's residual,
    residual_out and its gradient) apart ("regions").
    `fused`: the residual add + norm (add_layer_norm / add_rms_norm), residual in x's dtype."""
    o = ops()
    x, weight, bias, dy, residual, dh = _inputs(op, D, rows, dtype)
    o.set_device(*device)
    o.set_counting(True)
    named = {"x": x, "weight": weight, **({"bias": bias} if bias is not None else {})}
    if fused:
        named["residual"] = residual
    o.set_regions(list(named), list(named.values()))
    try:
        stats = {}
        if op == "layer_norm":
            if fused:
                _, h, stats["mean"], stats["rstd"] = o.add_layer_norm_fwd(x, residual, [D], weight, bias, 1e-5, None)
            else:
                _, stats["mean"], stats["rstd"] = o.layer_norm_fwd(x, [D], weight, bias, 1e-5)
        elif fused:
            _, h, stats["rstd"] = o.add_rms_norm_fwd(x, residual, [D], weight, 1e-6, None)
        else:
            _, stats["rstd"] = o.rms_norm_fwd(x, [D], weight, 1e-6)
        log = json.loads(o.take_launch_log())
        if mode == "bwd":
            source = h if fused else x
            named = {"x": source, "weight": weight, **({"bias": bias} if bias is not None else {}), "dy": dy, **stats}
            if fused:
                named["grad_residual_out"] = dh
            o.set_regions(list(named), list(named.values()))
            mean, rstd = stats.get("mean"), stats["rstd"]
            if op == "layer_norm" and fused:
                o.add_layer_norm_bwd(dy, dh, h, [D], mean, rstd, weight, bias, [True, True, True])
            elif op == "layer_norm":
                o.layer_norm_bwd(dy, x, [D], mean, rstd, weight, bias, [True, True, True])
            elif fused:
                o.add_rms_norm_bwd(dy, dh, h, [D], rstd, weight, [True, True])
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


def traffic_coefficients(op, mode, D, M, dtype, plan, concurrent_blocks, fused=False):
    """Each kernel's counters as fixed + per_row * rows (+ per_block * blocks), from small emulated runs, evaluated
    at M rows and the plan's grid: {kernel: {"total": {counter: value}, "per_row": {counter: value}}}.

    Every counter is linear in the rows and in the blocks (each block of the register kernels copies the forward's
    weight and bias, or writes the backward's partial rows, once). A one-wave grid is capped by the device
    (set_device), so three runs separate rows from blocks; the forward's multi-pass grid is one block a row, so two
    runs fit it. The emulator's L2 model is told how many blocks the full-size launch keeps in flight."""
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
    shared_per_sm = emulated_shared_per_sm(op, mode, plan, D, dtype.itemsize)
    for (rows, sms), reg in zip(runs, regress):
        log = emulate(op, mode, D, rows, dtype, (sms, threads, None, H200.max_cluster_blocks, shared_per_sm), fused)
        assert log[0]["block_threads"] == threads, (
            f"emulated blocks of {log[0]['block_threads']} threads, planned {threads}"
        )
        blocks = log[0]["grid"]
        for name, counters in _per_kernel(log).items():
            kernels.setdefault(name, []).append((reg(rows, blocks), counters))
    o.set_l2_model(H200.l2_bytes, 0)
    out = {}
    for name, samples in kernels.items():
        coeffs = _fit(samples)
        out[name] = {
            "total": {k: max(0.0, float(sum(c * f for c, f in zip(v, full)))) for k, v in coeffs.items()},
            "per_row": {k: float(v[1]) for k, v in coeffs.items()},
        }
    return out


def _before_ring(op: str, mode: str, plan: dict, D: int, elem: int) -> int:
    """The register kernels' shared memory ahead of their prefetch ring: two float32 per warp for the row sums of rows
    over 32 threads; the backward with several rows a block (or a cluster of blocks) adds their partial rows on chip;
    the forward's copy of the weight and bias comes first (StagedParams)."""
    smem = 2 * 4 * (plan["block_threads"] // 32) if plan["threads_per_row"] > 32 else 0
    if mode == "bwd" and (plan["rows_per_block"] > 1 or plan["partial_cluster"] > 1):
        smem = max(smem, plan["rows_per_block"] * D * 4)
    if mode == "fwd" and plan["path"] == "registers":
        smem += staged_params_bytes(op, D, elem)
    return smem


def staged_params_bytes(op: str, D: int, elem: int) -> int:
    """The forward register kernel's copy of the weight and bias (StagedParams), 16-byte aligned."""
    return -(-parameter_count(op) * D * elem // 16) * 16


def ring_instance(plan: dict, elem: int) -> bool:
    """Whether the row kernel's instance has a prefetch ring (ring_prefetches: vectorized register rows with float32
    sums)."""
    return plan["path"] == "registers" and plan["vec"] > 1 and elem != 8


def prefetch_stage_bytes(mode: str, plan: dict, elem: int, residual: bool = False) -> int:
    """A stage of a register kernel's prefetch ring (ThreadRing): each thread's vectors of x, and of the fused add's
    residual where `residual` (the forward's RowPrefetch); of x (the fused add's residual stream) and dy, and its
    row's mean and rstd (float32; the backward's TilePrefetch). The residual stream in x's dtype, as the model runs
    it."""
    per_thread = plan["items"] * plan["vec"] * elem
    if mode == "fwd":
        return plan["block_threads"] * per_thread * (2 if residual else 1)
    return plan["block_threads"] * (2 * per_thread + 2 * 4)


def _ring_smem(op: str, mode: str, plan: dict, D: int, elem: int, stages: int, residual: bool = False) -> int:
    """The register kernel's dynamic shared memory with a ring of `stages` (16-byte aligned after the rest)."""
    smem = _before_ring(op, mode, plan, D, elem)
    return -(-smem // 16) * 16 + stages * prefetch_stage_bytes(mode, plan, elem, residual) if stages else smem


def blocks_without_ring(op: str, mode: str, plan: dict, D: int, elem: int, registers: int, static_smem: int) -> int:
    """The blocks an SM holds of a register kernel without its ring: by registers, threads and its other shared
    memory (the forward's weight copy)."""
    return kernel_resources.blocks_per_sm(
        registers, plan["block_threads"], _ring_smem(op, mode, plan, D, elem, 0) + static_smem
    )


def ring_stages(
    op: str, mode: str, plan: dict, D: int, elem: int, registers: int | None, static_smem: int
) -> tuple[int, bool]:
    """The launchers' choice of ring (place_ring in launch_common.h, its callers in backward_launch.h and
    forward_launch.h): 3 stages, else 2, the first the block's shared memory holds and its caller keeps, else none;
    and whether it holds the fused add's residual. The forward's only where it is wanted (forward_ring_wanted), of
    both streams first for the fused add, else of x alone; it keeps a ring only where the SM still holds as many
    blocks (its registers' occupancy and shared memory, kernel_resources.blocks_per_sm; registers None: the emulated
    device's residency, which counts threads alone and so keeps every ring)."""
    if not ring_instance(plan, elem):
        return 0, False
    # The forward's blocks an SM without a ring, which a ring must keep (None: keep any ring that fits, the backward's
    # rule and the emulated device's residency).
    threads, resident = plan["block_threads"], None
    if mode == "fwd" and registers is not None:
        resident = blocks_without_ring(op, mode, plan, D, elem, registers, static_smem)
    register_prefetch = plan["items"] * plan["vec"] * elem <= PREFETCH_BYTES and plan["threads_per_row"] > 32
    for residual in (True, False) if mode == "fwd" and plan["residual"] else (False,):
        if mode == "fwd" and register_prefetch and not residual:
            continue  # forward_ring_wanted: block rows that the register prefetch serves, x alone
        for stages in (3, 2):
            smem = _ring_smem(op, mode, plan, D, elem, stages, residual)
            if smem <= H200.max_shared_per_block and (
                resident is None or kernel_resources.blocks_per_sm(registers, threads, smem + static_smem) == resident
            ):
                return stages, residual
    return 0, False


def grown_for_ring(op: str, mode: str, plan: dict, D: int, elem: int, registers: int | None, static_smem: int) -> dict:
    """The plan with the launchers' ring (ring_stages: "prefetch_stages", "ring_residual"), its forward rows a block
    grown as forward_launch.h grows them: doubled, up to FORWARD_MAX_THREADS, where a wanted ring finds no room beside
    each block's copy of the weight and bias, and the larger blocks keep as many threads an SM (registers None: the
    emulated device's residency, by threads alone, under which no ring is refused and none grows)."""
    stages, residual = ring_stages(op, mode, plan, D, elem, registers, static_smem)
    if mode == "fwd" and registers is not None and stages == 0:

        def threads_per_sm(p: dict) -> int:
            return blocks_without_ring(op, mode, p, D, elem, registers, static_smem) * p["block_threads"]

        grown = plan
        while grown["block_threads"] * 2 <= FORWARD_MAX_THREADS:
            grown = {
                **grown,
                "rows_per_block": grown["rows_per_block"] * 2,
                "block_threads": grown["block_threads"] * 2,
            }
            grown_stages, grown_residual = ring_stages(op, mode, grown, D, elem, registers, static_smem)
            if grown_stages and threads_per_sm(grown) >= threads_per_sm(plan):
                return {**grown, "prefetch_stages": grown_stages, "ring_residual": grown_residual}
    return {**plan, "prefetch_stages": stages, "ring_residual": residual}


def launched_row_smem(
    op: str, mode: str, D: int, dtype: torch.dtype, plan: dict, registers: int, static_smem: int, fused: bool
) -> int:
    """The register row kernel's dynamic shared memory as its launcher sizes it (the weight's copy, the ring) on an
    emulated device whose SMs hold what the H200's do: the forward's, the blocks its registers allow and the H200's
    shared memory an SM less their static shared memory (counted in residency); the backward's, the H200's threads
    (its ring keeps any occupancy). 16 blocks of rows, so that the backward's partial clusters are sized as at M."""
    threads = plan["block_threads"]
    if mode == "fwd":
        held = kernel_resources.blocks_per_sm(registers, threads, static_smem)
        shared_per_sm = kernel_resources.SHARED_BYTES_PER_SM - held * static_smem
        device = (H200.sms, held * threads, None, H200.max_cluster_blocks, shared_per_sm)
    else:
        device = (H200.sms, H200.threads_per_sm, None, H200.max_cluster_blocks)
    return emulate(op, mode, D, 16 * plan["rows_per_block"], dtype, device, fused)[0]["dynamic_smem"]


def emulated_shared_per_sm(op: str, mode: str, plan: dict, D: int, elem: int) -> int | None:
    """The shared memory an SM of the emulated device counts in residency (set_device's shared_per_sm) so that its
    forward launcher sizes the register kernel's block as the H200's does (rows a block, the weight's copy, the ring,
    its stages and streams): the traffic runs keep one block an SM (their (rows, blocks) points must stay apart for
    the fit), so they cannot take the H200's residency; room for exactly the plan's block refuses a larger ring, and
    the blocks of other sizes that the H200 refuses. None elsewhere: residency by threads alone."""
    if mode != "fwd" or plan["path"] != "registers":
        return None
    return row_kernel_smem(op, mode, plan, D, elem) + kernel_resources.RESERVED_SHARED_PER_BLOCK


def row_kernel_smem(op: str, mode: str, plan: dict, D: int, elem: int) -> int:
    """Dynamic shared memory of the row kernel (launchers in csrc/cuda): the register kernels' (_before_ring) and
    their prefetch ring of plan["prefetch_stages"] (none until the case's facts choose it), the multi-pass kernels'
    row sums (and the backward's partial rows); the shared-memory kernel's, as the plan says (its slice of the row,
    and of the weight and bias where they fit)."""
    if plan["path"] in ("shared", "reread"):
        return plan["shared_smem"]
    return _ring_smem(op, mode, plan, D, elem, plan.get("prefetch_stages", 0), plan.get("ring_residual", False))


def l1_free_bytes(blocks_per_sm: int, smem_per_block: int) -> int:
    """The L1 left beside the smallest shared-memory carveout that holds the SM's blocks (with the 1 KiB the system
    reserves per block): on sm_90 L1 and shared memory are one 256 KiB array."""
    need = blocks_per_sm * (smem_per_block + kernel_resources.RESERVED_SHARED_PER_BLOCK)
    carveout = next((c for c in H200.carveouts_kib if c * 1024 >= need), H200.carveouts_kib[-1]) * 1024
    return H200.l1_shared_bytes - carveout


SHARED_ROW_THREADS = 512  # kSharedRowThreads (csrc/cuda/launch_plan.h)
FORWARD_SHARED_UNROLL = 8  # kSharedRowUnroll
BACKWARD_SHARED_UNROLL = 4  # kBackwardSharedUnroll: x and dy, 8 vectors a thread in flight
REREAD_VECTOR_BYTES = 16  # backward_reread_unroll: BACKWARD_SHARED_UNROLL where a vector as accumulated is <= this
FORWARD_MAX_THREADS = 512  # kForwardBudget.max_threads: the forward register kernels' blocks at most
PREFETCH_BYTES = 64  # kPrefetchBytes: the forward register kernels that hold the next row's loads (prefetches_next_row)


BULK_STAGES = 4  # kBulkStages: the chunks of the shared-memory kernels' bulk loads (SliceRing)


def bulk_loads(mode: str, plan: dict, elem: int, fused: bool) -> bool:
    """Whether the shared-memory kernel loads its slices by bulk copies (launch_plan.h's bulk_stages and bulk_loads:
    an sm_90 such as the H200, slices kept as stored in 16-byte vectors; the forward: a row normalized as loaded,
    every slice; the backward: the row on chip, x and dy of one size, which the model takes the fused add's x, its
    residual stream, not to be)."""
    return plan["path"] == "shared" and not fused and plan["vec"] * elem == 16


def kept_in_registers(mode: str, plan: dict, elem: int, fused: bool) -> bool:
    """Whether the forward's shared-memory kernel keeps its bulk-loaded slice in registers (forward.cuh's `kept`): at
    most one register round (FORWARD_SHARED_UNROLL vectors a thread), read from shared memory once, every chunk
    released for the next row's copies right after."""
    return (
        mode == "fwd"
        and bulk_loads(mode, plan, elem, fused)
        and plan["slice_vectors"] <= FORWARD_SHARED_UNROLL * SHARED_ROW_THREADS
    )


def held_sums(op: str, mode: str, plan: dict, fused: bool) -> int:
    """The gradients whose sums the shared-memory backward holds in registers (launch_plan.h's held_gradients, as
    planned), with no shared-memory read and write of them a row: none with the fused add (the plan is the plain
    norm's; its rows are not bulk-loaded)."""
    return min(plan["held"], parameter_count(op)) if mode == "bwd" and not fused else 0


def prefetched_share(mode: str, plan: dict, elem: int, bursts: int, fused: bool) -> float:
    """The share of a step's load bursts that the row kernel issues during the row before (its reductions, passes
    and stores), so that they overlap the rest of the period instead of adding to it (period_us): all of them in the
    register kernels with a prefetch ring, and in the forward register kernels without one whose next row, as
    stored, is at most PREFETCH_BYTES a thread (prefetches_next_row); every chunk where the forward keeps its slice
    in registers (all refilled after the first pass); with other bulk loads, every chunk but the last (each
    refilled once the last pass over it, the forward's normalize or the backward's dx pass, has read it; the last at
    the row's end); the first of the other forward shared-memory kernels' rounds (load_slice_round); none
    elsewhere."""
    if not bursts:
        return 0.0
    if kept_in_registers(mode, plan, elem, fused):
        return 1.0
    if bulk_loads(mode, plan, elem, fused):
        return (BULK_STAGES - 1) / BULK_STAGES
    if plan.get("prefetch_stages"):
        return 1.0
    if mode != "fwd":
        return 0.0
    if plan["path"] == "registers":
        return 1.0 if plan["items"] * plan["vec"] * elem <= PREFETCH_BYTES else 0.0
    return 1.0 / bursts if plan["path"] == "shared" else 0.0


def _pieces(vec: int, elem_bytes: int) -> int:
    """16-byte shared-memory pieces of one vector (SharedVectors)."""
    return max(1, -(-vec * elem_bytes // 16))


def _row_sum_requests(threads_per_row: int) -> int:
    """Shared-memory requests of one row_sum2 over a row of `threads_per_row` threads, summed over its warps: lane 0
    of each warp stores two totals, then every lane reads two per warp of the row (nothing within a warp)."""
    if threads_per_row <= 32:
        return 0
    warps = threads_per_row // 32
    return warps * (2 + 2 * warps)


def structure(op: str, mode: str, plan: dict, D: int, elem: int, fused: bool) -> dict:
    """What one row costs a unit, counted from the kernels' code (csrc/cuda/forward.cuh, backward.cuh, reduce.cuh)
    for the plan's path: per row, summed over the row's blocks, the block barriers, cluster barriers (none per row
    since the st.async exchange), the ranks the cluster reductions read over distributed shared memory (none since:
    dsmem_ranks describes the calibrated kernels), the shared-memory requests (warp instructions) and the bytes of the
    vector ones; per block, the cluster reductions' exchanges. Per step (one row per unit), the dependent load rounds, read from the SASS for sm_90:
    `bursts` of loads in flight together, `lone_dram` loads from DRAM each used before the next is issued (the fused
    add's residual, read vector by vector each in its own branch, and its gradient in the backward's store phase),
    `lone_l2` such loads that hit L2 (weights read from global memory per row, the backward's second read of a row
    too long for its cluster's shared memory: one vector of x and dy a thread per iteration).

    The request and barrier counts are what the emulator counts for the same kernels (structure_mismatch)."""
    vec = plan["vec"]
    nvec = -(-D // vec)
    ln = op == "layer_norm"
    out = {
        "barriers": 0.0,
        "dsmem_ranks": 0.0,
        "cluster_exchanges": 0.0,
        "shared_requests": 0.0,
        "shared_bytes": 0.0,
    }
    if plan["path"] == "registers":
        tpr, items = plan["threads_per_row"], plan["items"]
        per_lane = min(items, -(-nvec // tpr))  # the vectors a lane of the row holds, at most
        reductions = (2 if ln else 1) if mode == "fwd" else 1
        # Warp-wide requests per row of one vector each: a warp's k-th vector where any lane of it is in the row.
        if tpr >= 32:
            slots = sum(1 for w in range(tpr // 32) for k in range(items) if k * tpr + 32 * w < nvec)
        else:
            slots = per_lane * tpr / 32  # a warp holds 32 / tpr rows
        out["barriers"] = (2 * reductions if tpr > 32 else 0) / 1.0
        out["shared_requests"] = reductions * _row_sum_requests(tpr)
        if mode == "fwd":  # the weight and bias from the block's copy (the launcher stages them; model_case checks)
            # and x, and the fused add's residual, from the prefetch ring (copied there by cp.async)
            ring_streams = (2 if plan.get("ring_residual") else 1) if plan.get("prefetch_stages") else 0
            streams = parameter_count(op) + ring_streams
            out["shared_requests"] += streams * slots * _pieces(vec, elem)
            out["shared_bytes"] = streams * D * elem
        elif plan.get("prefetch_stages"):  # the row read from the prefetch ring (copied there by cp.async)
            # x and dy; the mean (LayerNorm) and rstd, a scalar request per warp of the row
            out["shared_requests"] += slots * 2 * _pieces(vec, elem) + (2 if ln else 1) * tpr / 32
            out["shared_bytes"] = 2 * D * elem
        # The fused add: the forward reads the residual (where no ring copies it) and the backward the gradient of
        # residual_out vector by vector, each load in its own branch before its use (SASS: LDG, use, STG per vector).
        ring_residual = mode == "fwd" and plan.get("ring_residual", False)
        out["bursts"], out["lone_dram"], out["lone_l2"] = 1, per_lane if fused and not ring_residual else 0, 0
        out["burst_streams"] = 2 if mode == "bwd" or ring_residual else 1
        return out
    if plan["path"] in ("shared", "reread"):
        c = max(1, plan["cluster"])
        threads = SHARED_ROW_THREADS
        warps = threads // 32
        count = plan["slice_vectors"]  # every block's slice is this long for the model's D (checked below)
        assert count * c >= nvec and (count - 1) * c < nvec, "the slices of this D are not equal"
        slots = -(-count // 32)  # warp instructions per pass over the slice
        per_thread = -(-count // threads)
        calls = (2 if ln else 1) if mode == "fwd" else 1  # ClusterReduce2 calls per row
        # Bulk loads: the copy engine's chunks of the slices in flight together (one round). A chunk of the last
        # pass (the forward's normalize, the backward's dx) is released by every thread's arrival on its empty
        # mbarrier, which only thread 0 waits for before the refill: no block barrier. (Not a term: that warp's wait
        # for the block's slowest, which the row's next reduction absorbs; an assumption for the GPU run to check.)
        bulk = bulk_loads(mode, plan, elem, fused)
        # Per exchange: every warp's reads of the c results (the st.async into the c blocks, a few bytes of
        # distributed shared memory, are not counted: simt_emulator.h).
        per_block_scalar = calls * (_row_sum_requests(threads) + (warps * 2 * c if c > 1 else 0))
        if mode == "fwd":
            params = parameter_count(op) if plan["slice_params"] else 0
            # The slice's passes: staged (or bulk-loaded and summed), then read by the variance and normalize passes;
            # kept in registers, read once.
            passes = 1 if kept_in_registers(mode, plan, elem, fused) else 3
            vector = slots * (passes * _pieces(vec, elem) + params * _pieces(vec, elem))
            vector_bytes = count * vec * elem * (passes + params)
            out["bursts"] = 1 if bulk else -(-per_thread // FORWARD_SHARED_UNROLL)
            out["burst_streams"] = 1
            out["lone_dram"] = per_thread if fused else 0  # the residual, added vector by vector after the burst
            out["lone_l2"] = 0 if plan["slice_params"] else per_thread  # the weight and bias from global memory
        else:
            # The gradient sums' read and write a row, in shared memory (not those the held-sums instances hold).
            grads = parameter_count(op) - held_sums(op, mode, plan, fused)
            acc = _pieces(vec, 4)
            on_chip = plan["path"] == "shared"
            # The weight read in both passes from the block's copy, or from the held-sums instance's weight ring.
            weight_on_chip = plan["slice_params"] or plan.get("weight_stages", 0) > 0
            vector = slots * (
                (4 * _pieces(vec, elem) if on_chip else 0)
                + (2 * _pieces(vec, elem) if weight_on_chip else 0)
                + grads * 2 * acc
            )
            vector_bytes = (
                count * vec * ((4 * elem if on_chip else 0) + (2 * elem if weight_on_chip else 0) + grads * 2 * 4)
            )
            out["bursts"] = 1 if bulk else -(-per_thread // BACKWARD_SHARED_UNROLL)
            out["burst_streams"] = 2
            # The dx pass: the row read again (from L2) where it is not on chip, BACKWARD_SHARED_UNROLL vectors of x
            # and dy a thread at a time where a vector as accumulated is at most 16 bytes (backward_reread_unroll),
            # one at a time for 16-bit rows, with the gradient of residual_out beside each vector; that gradient
            # alone (from DRAM) where the row is on chip; the weight from global memory in both passes where it is
            # not on chip (the weight ring's copies, issued stages - 1 uses ahead, are not waited on one by one).
            acc_bytes = 8 if elem == 8 else 4
            reread = BACKWARD_SHARED_UNROLL if vec * acc_bytes <= REREAD_VECTOR_BYTES else 1
            out["lone_l2"] = (0 if on_chip else -(-per_thread // reread)) + (0 if weight_on_chip else 2 * per_thread)
            out["lone_dram"] = per_thread if fused and on_chip else 0
        out["barriers"] += c * calls * 2.0
        out["cluster_exchanges"] = calls if c > 1 else 0.0  # per block: each waits for every reduction's exchange
        out["shared_requests"] = c * (vector + per_block_scalar)
        out["shared_bytes"] = c * vector_bytes
        return out
    # The multi-pass kernels (no shared-memory room; sm_80 and unaligned rows take them): one vector a thread at
    # a time over 2-3 passes. Not calibrated: no measured cell takes them.
    threads = plan["block_threads"]
    passes = (3 if ln else 2) if mode == "fwd" else 2
    out["barriers"] = 2.0 * ((2 if ln else 1) if mode == "fwd" else 1)
    out["bursts"], out["lone_dram"], out["lone_l2"] = 0, -(-nvec // threads), (passes - 1) * -(-nvec // threads)
    out["burst_streams"] = 1
    out["shared_requests"] = None  # not checked
    return out


def structure_mismatch(s: dict, plan: dict, per_row: dict) -> str:
    """ "ok" where structure()'s shared-memory requests and barriers (block and cluster) per row are the emulator's
    (`per_row`: the row kernel's counters per row), else what differs: then the kernels changed and structure() no
    longer describes them."""
    if s["shared_requests"] is None:
        return "not checked (multi-pass)"
    barriers = s["barriers"]
    if plan["path"] == "registers":  # block barriers: per block per tile of rpb rows
        barriers /= plan["rows_per_block"]
    emulated = (per_row["shared_requests"], per_row["barriers"])
    if all(abs(a - b) <= 0.02 * max(1.0, b) for a, b in zip(emulated, (s["shared_requests"], barriers))):
        return "ok"
    return (
        f"mismatch: emulator {emulated[0]:.1f} shared requests and {emulated[1]:.2f} barriers per row, "
        f"counted {s['shared_requests']:.1f} and {barriers:.2f}"
    )


def check_structure(op: str, mode: str, dtype_name: str, D: int, fused: bool = False) -> str:
    """structure_mismatch for one case on the emulator alone (no ptxas): the plan at one block per SM, its row
    kernel's counters per row from small runs."""
    elem = DTYPES[dtype_name].itemsize
    M = case_rows(mode, D, elem)
    plan = plan_on_h200(op, mode, D, M, elem, 1, fused)
    plan = grown_for_ring(op, mode, plan, D, elem, None, 0)
    ops().set_block_sample(8)
    try:
        traffic = traffic_coefficients(op, mode, D, M, DTYPES[dtype_name], plan, plan["blocks"], fused)
    finally:
        ops().set_block_sample(0)
    row = next(iter(traffic.values()))  # the first launch: the row kernel
    return structure_mismatch(structure(op, mode, plan, D, elem, fused), plan, row["per_row"])


def units(plan: dict, blocks_per_sm: int) -> dict:
    """The resident units of a plan: what walks rows in lockstep, how many rows it takes per step, over how many
    SMs, and how many share an SM."""
    tpr, rpb, threads = plan["threads_per_row"], plan["rows_per_block"], plan["block_threads"]
    if plan["path"] in ("shared", "reread"):
        c, g = max(1, plan["cluster"]), plan["partial_cluster"]
        return {
            "unit": f"cluster{c * g}" if c * g > 1 else "block",
            "rows_per_unit": g,
            "sms_per_unit": c * g,
            "units_per_sm": 1,
            "rows_per_sm_step": 1.0 / c,
            "units": plan["blocks"] // (c * g),
        }
    if plan["path"] == "registers" and tpr <= 32:  # warps that hold whole rows: no block barrier between them
        return {
            "unit": "warp",
            "rows_per_unit": 32 // tpr,
            "sms_per_unit": 1,
            "units_per_sm": blocks_per_sm * threads // 32,
            "rows_per_sm_step": float(blocks_per_sm * rpb),
            "units": plan["blocks"] * threads // 32,
        }
    return {
        "unit": "block",
        "rows_per_unit": rpb,
        "sms_per_unit": 1,
        "units_per_sm": blocks_per_sm,
        "rows_per_sm_step": float(blocks_per_sm * rpb),
        "units": plan["blocks"],
    }


FACTS_VERSION = 1
CACHE = ROOT / "build" / "kernel_model"


def _sources_hash() -> str:
    """What the facts depend on: the kernels, their launchers and the emulator, and this model's counting."""
    h = hashlib.sha256(f"facts {FACTS_VERSION}".encode())
    paths = [*(ROOT / "csrc" / "cuda").iterdir(), *(ROOT / "csrc" / "emulated").iterdir(), *(ROOT / "csrc").glob("*")]
    for path in sorted(p for p in paths if p.is_file()):
        h.update(str(path.relative_to(ROOT)).encode() + path.read_bytes())
    return h.hexdigest()[:16]


_resources: dict | None = None


def resources() -> dict:
    global _resources
    if _resources is None:
        _resources = kernel_resources.compile_all(verbose=True)
    return _resources


def case_facts(op: str, mode: str, dtype_name: str, D: int, M: int, fused: bool = False, cache: bool = True) -> dict:
    """Everything the model needs of one case, from the emulator and ptxas; cached in build/kernel_model by a hash
    of csrc/ (the emulated runs of the long rows take seconds each)."""
    key = f"{op}-{mode}-{dtype_name}-{D}-{M}-{'fused' if fused else 'plain'}"
    path = CACHE / _sources_hash() / f"{key}.json"
    if cache and path.exists():
        return json.loads(path.read_text())
    ops().set_block_sample(8)  # the backward's reduce: 8 blocks of each row run, scaled (alike work)
    try:
        facts = _case_facts(op, mode, dtype_name, D, M, fused)
    finally:
        ops().set_block_sample(0)
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(facts, indent=1) + "\n")
    return facts


def plan_on_h200(op: str, mode: str, D: int, M: int, elem: int, blocks_per_sm: int = 0, fused: bool = False) -> dict:
    """The launchers' plan on an H200 (132 SMs, 227 KB of shared memory a block, clusters of 16), through the
    emulated build's plan_rows; the grid at `blocks_per_sm` (0: by threads alone). `fused`: the rows have a residual
    stream (the fused add), which the forward's prefetch ring copies beside x."""
    o = ops()
    o.set_device(H200.sms, H200.threads_per_sm, None, H200.max_cluster_blocks)
    try:
        planned = o.plan(mode, M, D, elem, True, blocks_per_sm, parameter_count(op))
    finally:
        o.set_device(2, 2048)
    (
        vec,
        items,
        tpr,
        rpb,
        blocks,
        cluster,
        shared_smem,
        slice_params,
        row_on_chip,
        partial_cluster,
        held,
        weight_stages,
    ) = planned
    return {
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
        "slice_vectors": -(-math.ceil(D / vec) // cluster) if cluster > 0 else 0,  # plan_rows: ceil(nvec / cluster)
        "held": held,  # the backward's held-sums instance: the gradients whose sums it holds (SharedRowSpace::held)
        # that instance's weight ring (WeightRing: copied ahead by cp.async where its slices leave no room for the
        # weight; 0: none), counted in shared_smem
        "weight_stages": weight_stages,
        "residual": fused,
    }


def _case_facts(op: str, mode: str, dtype_name: str, D: int, M: int, fused: bool) -> dict:
    dtype = DTYPES[dtype_name]
    elem = torch.empty(0, dtype=dtype).element_size()
    res_all = resources()
    plan = plan_on_h200(op, mode, D, M, elem, fused=fused)
    rpb = plan["rows_per_block"]
    # The row kernel's residency from its registers (found by name after one small run).
    probe = emulate(op, mode, D, rpb, dtype, (1 << 20, plan["block_threads"], None, H200.max_cluster_blocks), fused)
    names = [launch["kernel"] for launch in probe]
    dependent = {launch["kernel"]: launch["dependent"] for launch in probe}
    row_kernel = names[0]
    res = {n: res_all.get(n, {}) for n in names}
    registers = res[row_kernel].get("registers", 32)
    static_smem = res[row_kernel].get("static_smem", 0)
    plan = grown_for_ring(op, mode, plan, D, elem, registers, static_smem)
    smem = row_kernel_smem(op, mode, plan, D, elem) + static_smem
    per_sm = kernel_resources.blocks_per_sm(registers, plan["block_threads"], smem)
    # The model's mirror of the launchers' rules (the forward's weight copy, either ring) against the launchers on a
    # device that counts shared memory as the H200 does; the shared-memory path's plan (the emulated plan(), which
    # once passed its layout shifted arguments) against the probe's launch, on the H200's shared memory a block.
    if plan["path"] != "multipass":
        launched = (
            launched_row_smem(op, mode, D, dtype, plan, registers, static_smem, fused)
            if plan["path"] == "registers"
            else probe[0]["dynamic_smem"]
        )
        assert launched + static_smem == smem, (
            f"{op} {mode} {dtype_name} D={D}: the launcher gives {launched} bytes, the model {smem - static_smem}"
        )
    if one_wave(mode, plan):  # one wave at the kernel's occupancy (limit_to_one_wave, limit_to_resident_clusters)
        # (the emulated plan() shares M's rows out at plan_rows' rows a block, before grown_for_ring)
        plan["blocks"] = min(plan_on_h200(op, mode, D, M, elem, per_sm)["blocks"], -(-M // plan["rows_per_block"]))
    blocks = plan["blocks"]
    resident_blocks = min(blocks, H200.sms * per_sm)
    traffic = traffic_coefficients(op, mode, D, M, dtype, plan, resident_blocks, fused)
    others = []
    for name in names[1:]:  # the backward's reduce: 2 x ceil(D / 4 / 32) blocks of 512 threads
        t = traffic[name]["total"]
        others.append(
            {"kernel": name, "dram_bytes": t["dram_read_bytes"] + t["dram_write_bytes"], "dependent": dependent[name]}
        )
    row = traffic[row_kernel]
    total = {c: sum(t["total"][c] for t in traffic.values()) for c in COUNTERS}
    memset = blocks * D * 4 * parameter_count(op) if mode == "bwd" and plan["path"] == "multipass" else 0
    plan.update({"blocks_per_sm": per_sm})
    return {
        "op": op,
        "mode": mode,
        "dtype": dtype_name,
        "D": D,
        "M": M,
        "fused": fused,
        "elem": elem,
        "plan": plan,
        "row_kernel": row_kernel,
        "registers": registers,
        "spill_bytes": max(r.get("spill_stores", 0) + r.get("spill_loads", 0) for r in res.values()),
        "row_smem": smem,
        "row_dram_bytes": row["total"]["dram_read_bytes"] + row["total"]["dram_write_bytes"],
        "per_row": row["per_row"],
        "others": others,
        "memset_bytes": memset,
        "requested_bytes": total["load_bytes"] + total["store_bytes"],
        "dram_bytes": total["dram_read_bytes"] + total["dram_write_bytes"] + memset,
        "sector_efficiency": total["coalesced_bytes"] / total["coalesced_sector_bytes"]
        if total["coalesced_sector_bytes"]
        else 1.0,
    }


def features(facts: dict) -> dict:
    """The period's features of a case (FEATURES), the steps its units walk, the fixed time around the row kernel
    (launches, the backward's reduce, the multi-pass memset) and the row kernel's time at copy bandwidth; with the
    structure check: the emulator's shared-memory requests and barriers per row against structure()'s."""
    plan, per_row = facts["plan"], facts["per_row"]
    op, mode, D, M, elem = facts["op"], facts["mode"], facts["D"], facts["M"], facts["elem"]
    s = structure(op, mode, plan, D, elem, facts["fused"])
    u = units(plan, plan["blocks_per_sm"])
    check = structure_mismatch(s, plan, per_row)
    rows_sm = u["rows_per_sm_step"]
    if plan["path"] == "registers":
        unit_rows = u["rows_per_unit"]
        barriers_step = s["barriers"]  # per block per tile: the block's rows together
        burst_round_sm = D * elem * s["burst_streams"] * rows_sm
    elif plan["path"] in ("shared", "reread"):
        unit_rows = 1.0 / max(1, plan["cluster"])  # a block's slice of its group's row
        barriers_step = s["barriers"] / max(1, plan["cluster"])
        unroll = FORWARD_SHARED_UNROLL if mode == "fwd" else BACKWARD_SHARED_UNROLL
        round_vectors = min(plan["slice_vectors"], SHARED_ROW_THREADS * unroll)  # a block's vectors in one burst
        # (bulk loads land in shared memory, not in registers through L1: no stretch)
        bulk = bulk_loads(mode, plan, elem, facts["fused"])
        burst_round_sm = 0.0 if bulk else round_vectors * 16 * s["burst_streams"]
    else:
        unit_rows = 1.0
        barriers_step = s["barriers"]
        burst_round_sm = 0.0
    l1 = l1_free_bytes(plan["blocks_per_sm"], facts["row_smem"])
    stretch = max(1.0, burst_round_sm / l1) if s["bursts"] else 1.0
    shared_sm = s["shared_bytes"] * (rows_sm if plan["path"] == "registers" else 1.0 / max(1, plan["cluster"]))
    f = {
        "latency": s["bursts"] * stretch,
        "lone_dram": s["lone_dram"],
        "lone_l2": s["lone_l2"],
        "load_kib": per_row["load_bytes"] * unit_rows / 1024,
        "store_kib": per_row["store_bytes"] * rows_sm / 1024,
        "barriers": barriers_step,
        "dsmem_ranks": s["dsmem_ranks"],
        "cluster_exchanges": s["cluster_exchanges"],
        "shared_kib": shared_sm / 1024,
        "prefetch": prefetched_share(mode, plan, elem, s["bursts"], facts["fused"]),
        # the bursts in flight during a period: the register backward's ring of 3 stages holds two tiles ahead
        "prefetch_ahead": max(1, plan.get("prefetch_stages", 0) - 1),
    }
    rows_per_step = u["units"] * u["rows_per_unit"]
    steps = math.ceil(M / rows_per_step)
    fixed_s = (
        H200.launch_s + facts["memset_bytes"] / H200.copy_bandwidth + (H200.launch_s if facts["memset_bytes"] else 0)
    )
    for k in facts["others"]:
        fixed_s += k["dram_bytes"] / H200.copy_bandwidth + (
            H200.dependent_launch_s if k["dependent"] else H200.launch_s
        )
    return {
        "features": f,
        "steps": steps,
        "unit": u,
        "stretch": stretch,
        "l1_free_kib": l1 / 1024,
        "copy_bound_us": facts["row_dram_bytes"] / H200.copy_bandwidth * 1e6,
        "fixed_us": fixed_s * 1e6,
        "structure_check": check,
    }


def period_us(f: dict, us_per: dict) -> float:
    """A unit's period: the fitted constants and the assumed one times their features, summed; for a unit that
    prefetches (f["prefetch"]: the share of its bursts issued during the row before), those bursts (their latency,
    and the unit's own loads) are in flight during the rest of the period, which is then the longer of the two; with
    f["prefetch_ahead"] rows in flight (the backward's ring of 3 stages: 2), a burst's latency spans that many
    periods.
    (Not calibrated: the measured kernels did not prefetch.)"""
    # (the calibration cells' stored features predate cluster_exchanges: their kernels had none)
    terms = {k: us_per[k] * f[k] for k in FEATURES} | {k: v * f.get(k, 0.0) for k, v in ASSUMED_US_PER.items()}
    share = f.get("prefetch", 0)
    if not share:
        return sum(terms.values())
    # With `prefetch_ahead` bursts in flight (a ring holding that many rows ahead), each needs 1 / ahead of a period.
    hidden = share * terms["latency"] + terms["load_kib"]
    in_flight = share * terms["latency"] / f.get("prefetch_ahead", 1) + terms["load_kib"]
    return max(in_flight, sum(terms.values()) - hidden)


def predict(facts: dict, us_per: dict | None = None) -> dict:
    us_per = us_per or CALIBRATION["us_per"]
    x = features(facts)
    period = period_us(x["features"], us_per)
    latency_us = x["steps"] * period
    row_us = max(latency_us, x["copy_bound_us"])
    total = row_us + x["fixed_us"]
    nbytes = bench_bytes(facts["op"], facts["mode"], facts["D"], facts["M"], facts["elem"], facts["fused"])
    return {
        **x,
        "period_us": period,
        "bound": "units" if latency_us >= x["copy_bound_us"] else "copy",
        "predicted_us": total,
        "bench_bytes": nbytes,
        "predicted_pct_copy": 100 * nbytes / (total * 1e-6) / H200.copy_bandwidth,
    }


def model_case(
    op: str, mode: str, dtype_name: str, D: int, M: int | None = None, fused: bool = False, us_per: dict | None = None
) -> dict:
    """The record of one case (RECORD_KEYS): its plan, residency, traffic, features and predicted time."""
    elem = DTYPES[dtype_name].itemsize
    M = M if M is not None else case_rows(mode, D, elem)
    facts = case_facts(op, mode, dtype_name, D, M, fused)
    p = predict(facts, us_per)
    plan = facts["plan"]
    return {
        "op": op,
        "mode": mode,
        "dtype": dtype_name,
        "D": D,
        "M": M,
        "fused": fused,
        "plan": plan,
        "unit": p["unit"],
        "registers": facts["registers"],
        "spill_bytes": facts["spill_bytes"],
        "occupancy": round(plan["blocks_per_sm"] * plan["block_threads"] / H200.threads_per_sm, 3),
        "ideal_bytes": ideal_bytes(op, mode, D, M, elem),
        "requested_bytes": round(facts["requested_bytes"]),
        "dram_bytes": round(facts["dram_bytes"]),
        "sector_efficiency": round(facts["sector_efficiency"], 4),
        "features": {k: round(v, 4) for k, v in p["features"].items()},
        "l1_free_kib": p["l1_free_kib"],
        "steps": p["steps"],
        "period_us": round(p["period_us"], 4),
        "bound": p["bound"],
        "fixed_us": round(p["fixed_us"], 2),
        "structure_check": p["structure_check"],
        "predicted_us": round(p["predicted_us"], 2),
        "predicted_pct_copy": round(p["predicted_pct_copy"], 1),
    }


RECORD_KEYS = [
    "op",
    "mode",
    "dtype",
    "D",
    "M",
    "fused",
    "plan",
    "unit",
    "registers",
    "spill_bytes",
    "occupancy",
    "ideal_bytes",
    "requested_bytes",
    "dram_bytes",
    "sector_efficiency",
    "features",
    "l1_free_kib",
    "steps",
    "period_us",
    "bound",
    "fixed_us",
    "structure_check",
    "predicted_us",
    "predicted_pct_copy",
]


def path_name(plan: dict) -> str:
    path = plan["path"]
    if plan.get("cluster", 0) > 1:
        path = f"{'cluster' if path == 'shared' else path}{plan['cluster']}"
    if plan.get("partial_cluster", 1) > 1 and plan["path"] != "registers":
        path += f"x{plan['partial_cluster']}"  # launched in clusters of that many rows' clusters
    return path


def table(records: list[dict]) -> str:
    head = (
        f"{'op':<14} {'mode':<4} {'dtype':<8} {'D':>6} {'M':>8} {'path':<11} {'unit':<9} {'u/SM':>4} {'regs':>4} "
        f"{'steps':>6} {'lat':>5} {'ld KiB':>6} {'st KiB':>6} {'bar':>4} {'xchg':>5} {'smem KiB':>8} "
        f"{'period us':>9} {'pred us':>8} {'% copy':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        f, u = r["features"], r["unit"]
        op = ("add_" if r["fused"] else "") + r["op"]
        lines.append(
            f"{op:<14} {r['mode']:<4} {r['dtype']:<8} {r['D']:>6} {r['M']:>8} {path_name(r['plan']):<11} "
            f"{u['unit']:<9} {u['units_per_sm']:>4} {r['registers']:>4} {r['steps']:>6} {f['latency']:>5.2f} "
            f"{f['load_kib']:>6.1f} {f['store_kib']:>6.1f} {f['barriers']:>4.1f} {f['cluster_exchanges']:>5.0f} "
            f"{f['shared_kib']:>8.1f} {r['period_us']:>9.3f} {r['predicted_us']:>8.1f} {r['predicted_pct_copy']:>5.0f}%"
            + ("" if r["structure_check"] == "ok" else f"  [{r['structure_check']}]")
        )
    return "\n".join(lines)


def _csv_rows(path: Path) -> list[dict]:
    with Path(path).open(newline="") as f:
        return list(csv.DictReader(f))


def measured_cells(csv_paths: list[Path], providers=("torch_ln", "fused")) -> list[dict]:
    """The benchmark CSVs' timed rows of torch_ln's own kernels: provider torch_ln (bench_layer_norm/rms_norm.py)
    and fused (bench_add_norm.py; op add_layer_norm / add_rms_norm); forward and backward alone."""
    cells = []
    for path in csv_paths:
        for row in _csv_rows(path):
            if row["provider"] not in providers or row["mode"] not in ("fwd", "bwd"):
                continue
            if math.isnan(float(row["ms"] or "nan")):
                continue
            fused = row["op"].startswith("add_")
            cells.append(
                {
                    "op": row["op"].removeprefix("add_"),
                    "fused": fused,
                    "mode": row["mode"],
                    "dtype": row["dtype"],
                    "D": int(row["D"]),
                    "M": int(row["M"]),
                    "provider": row["provider"],
                    "measured_us": float(row["ms"]) * 1e3,
                    "measured_pct_copy": float(row["pct_copy"]),
                }
            )
    seen, unique = set(), []
    for c in cells:  # the add CSVs repeat some rows
        key = (c["op"], c["fused"], c["provider"], c["mode"], c["dtype"], c["D"], c["M"])
        if key not in seen:
            seen.add(key)
            unique.append(c)
    return unique


def pair_us(op: str, mode: str, dtype_name: str, D: int, M: int) -> tuple[float, dict]:
    """The unfused torch_ln pair of bench_add_norm.py: torch's add (two reads, one write; in the backward, of the two
    gradients of h), taken at copy bandwidth, and torch_ln's norm of h. Returns its time and the norm's record."""
    norm = model_case(op, mode, dtype_name, D, M, False)
    return norm["predicted_us"] + 3 * M * D * DTYPES[dtype_name].itemsize / H200.copy_bandwidth * 1e6, norm


def compare(csv_paths: list[Path]) -> str:
    """Measured (the benchmark's CSVs: torch_ln, fused and torch_ln_pair) beside predicted, case by case."""
    head = (
        f"{'op':<14} {'provider':<13} {'mode':<4} {'dtype':<8} {'D':>6} {'M':>8} {'path':<11} {'measured us':>11} "
        f"{'predicted us':>12} {'meas/pred':>9} {'measured % copy':>15} {'predicted % copy':>16}"
    )
    lines = [head]
    for c in measured_cells(csv_paths, providers=("torch_ln", "fused", "torch_ln_pair")):
        if c["provider"] == "torch_ln_pair":
            predicted, r = pair_us(c["op"], c["mode"], c["dtype"], c["D"], c["M"])
            elem = DTYPES[c["dtype"]].itemsize
            pct = (
                100
                * bench_bytes(c["op"], c["mode"], c["D"], c["M"], elem, True)
                / (predicted * 1e-6)
                / H200.copy_bandwidth
            )
        else:
            r = model_case(c["op"], c["mode"], c["dtype"], c["D"], c["M"], c["fused"])
            predicted, pct = r["predicted_us"], r["predicted_pct_copy"]
        op = ("add_" if c["fused"] else "") + c["op"]
        lines.append(
            f"{op:<14} {c['provider']:<13} {c['mode']:<4} {c['dtype']:<8} {c['D']:>6} {c['M']:>8} "
            f"{path_name(r['plan']):<11} {c['measured_us']:>11.1f} {predicted:>12.1f} "
            f"{c['measured_us'] / predicted:>9.2f} {c['measured_pct_copy']:>15.1f} {pct:>15.1f}%"
            + ("" if r["structure_check"] == "ok" else f"  [{r['structure_check']}]")
        )
    return "\n".join(lines)


# Calibration -------------------------------------------------------------------------------------------------------


def nnls(a, b, tolerance: float = 1e-12):
    """Non-negative least squares, min |a x - b| with x >= 0 (Lawson and Hanson's active-set method)."""
    import numpy as np

    a, b = np.asarray(a, float), np.asarray(b, float)
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, bool)
    for _ in range(3 * n + 10):
        w = a.T @ (b - a @ x)
        if passive.all() or w[~passive].max(initial=-np.inf) <= tolerance:
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > tolerance).all():
                x = z
                break
            negative = passive & (z <= tolerance)
            alpha = np.min(x[negative] / (x[negative] - z[negative]))
            x = x + alpha * (z - x)
            passive &= x > tolerance
    return x


def fit_constants(rows: list[dict], names: list[str], fixed: dict | None = None) -> tuple[dict, list[bool]]:
    """The constants `names` that minimize the squared relative error of the predicted times over `rows` (each with
    "features", "steps", "fixed_us", "copy_bound_us", "measured_us"), none negative, the other constants held at
    `fixed`. A cell whose measured time is within 5% of its copy bound and that the fit predicts at the bound carries
    no information on the period (only that it is short enough): such cells are left out of the least squares,
    repeatedly until the set settles. Returns all the constants and, per row, whether it was left out."""
    import numpy as np

    if any(r["features"].get("prefetch") for r in rows):
        raise ValueError(
            "fit_constants: the least squares is linear in the features, and a prefetching kernel's period is not "
            "(period_us); fit on cells whose kernels do not prefetch (the first H200 run's: calibrate at commit "
            "8cf9431 or earlier, where no kernel prefetched)"
        )
    fixed = {k: v for k, v in (fixed or {}).items() if k not in names}
    capped = [False] * len(rows)
    for _ in range(10):
        use = [i for i, c in enumerate(capped) if not c]
        a = np.array([[rows[i]["features"][k] for k in names] for i in use], float)
        known = np.array([period_us(rows[i]["features"], {**dict.fromkeys(names, 0.0), **fixed}) for i in use])
        y = np.array([(rows[i]["measured_us"] - rows[i]["fixed_us"]) / rows[i]["steps"] for i in use])
        x = nnls(a / y[:, None], (y - known) / y)
        us_per = {**fixed, **dict(zip(names, (float(v) for v in x)))}
        new = []
        for r in rows:
            at_bound = r["steps"] * period_us(r["features"], us_per) <= r["copy_bound_us"]
            near = r["measured_us"] <= 1.05 * (r["copy_bound_us"] + r["fixed_us"])
            new.append(at_bound and near)
        if new == capped:
            break
        capped = new
    return {k: us_per[k] for k in FEATURES}, capped


def predicted_us(row: dict, us_per: dict) -> float:
    return max(row["steps"] * period_us(row["features"], us_per), row["copy_bound_us"]) + row["fixed_us"]


def _calibration_rows(cells: list[dict]) -> list[dict]:
    rows = []
    for c in cells:
        facts = case_facts(c["op"], c["mode"], c["dtype"], c["D"], c["M"], c["fused"])
        x = features(facts)
        rows.append({**c, **{k: x[k] for k in ("features", "steps", "fixed_us", "copy_bound_us", "structure_check")}})
        rows[-1]["path"] = path_name(facts["plan"])
        rows[-1]["unit"] = x["unit"]["unit"]
    return rows


def _stage(rows: list[dict], names: list[str], fixed: dict) -> dict:
    """One stage of the calibration: the fit, each cell's ratio, and the leave-one-out check."""
    us_per, capped = fit_constants(rows, names, fixed)
    for i, r in enumerate(rows):
        r["predicted_us"] = predicted_us(r, us_per)
        r["ratio"] = r["measured_us"] / r["predicted_us"]
        r["copy_bound_in_fit"] = capped[i]
        loo, _ = fit_constants(rows[:i] + rows[i + 1 :], names, fixed)
        r["loo_predicted_us"] = predicted_us(r, loo)
        r["loo_ratio"] = r["measured_us"] / r["loo_predicted_us"]
    return us_per


def calibrate(csv_paths: list[Path]) -> dict:
    """Fits the constants on the measured cells of `csv_paths`, in two stages:
    1. every constant but lone_dram on torch_ln's plain cells (the first H200 run: the 16 LayerNorm cells), none of
       which has a lone DRAM round trip;
    2. lone_dram alone on the fused add's cells (provider fused), the other constants held at stage 1's.
    Each cell gets its ratio (measured / fitted) and a leave-one-out ratio (its stage refitted without it)."""
    cells = measured_cells(csv_paths, providers=("torch_ln", "fused"))
    plain = _calibration_rows([c for c in cells if not c["fused"]])
    fused = _calibration_rows([c for c in cells if c["fused"]])
    stage1 = [k for k in FEATURES if k != "lone_dram"]
    us_per = _stage(plain, stage1, {"lone_dram": 0.0})
    if fused:
        us_per = _stage(fused, ["lone_dram"], us_per)
    return {
        "source": [str(p) for p in csv_paths],
        "us_per": us_per,
        "assumed_us_per": ASSUMED_US_PER,
        "cells": plain,
        "fused_cells": fused,
    }


def calibration_report(cal: dict) -> str:
    us = cal["us_per"]
    lines = ["Fitted constants (us per unit of each feature):"]
    for k, v in us.items():
        lines.append(f"  {k:<12} {v:10.5f}   {FEATURES[k]}")
    for k, v in cal["assumed_us_per"].items():
        lines.append(f"  {k:<12} {v:10.5f}   assumed, not fitted")
    rates = [(n, k) for n, k in (("load burst", "load_kib"), ("stores", "store_kib"), ("shared", "shared_kib"))]
    lines.append("  as rates: " + ", ".join(f"{n} {1024 / us[k] / 1e3:.1f} GB/s per SM" for n, k in rates if us[k] > 0))
    head = (
        f"{'op':<14} {'mode':<4} {'dtype':<8} {'D':>6} {'M':>8} {'path':<11} {'unit':<9} {'measured us':>11} "
        f"{'fit us':>8} {'meas/fit':>8} {'LOO us':>8} {'meas/LOO':>8}"
    )
    for title, rows in (("Stage 1: LayerNorm cells", cal["cells"]), ("Stage 2: fused add cells", cal["fused_cells"])):
        if not rows:
            continue
        lines += ["", title, head]
        for r in rows:
            op = ("add_" if r["fused"] else "") + r["op"]
            lines.append(
                f"{op:<14} {r['mode']:<4} {r['dtype']:<8} {r['D']:>6} {r['M']:>8} {r['path']:<11} {r['unit']:<9} "
                f"{r['measured_us']:>11.1f} {r['predicted_us']:>8.1f} {r['ratio']:>8.3f} {r['loo_predicted_us']:>8.1f} "
                f"{r['loo_ratio']:>8.3f}"
                + ("  (copy-bound: left out of the fit)" if r["copy_bound_in_fit"] else "")
                + ("" if r["structure_check"] == "ok" else f"  [{r['structure_check']}]")
            )
        ratios = [r["ratio"] for r in rows]
        loo = [r["loo_ratio"] for r in rows]
        lines.append(
            f"measured / fitted: {min(ratios):.3f}-{max(ratios):.3f}; leave-one-out: {min(loo):.3f}-{max(loo):.3f}"
        )
    return "\n".join(lines)


# The cells of scripts/gpu_check.sh's bench phase (each --device cuda --quick --dtypes float32 bfloat16 --modes fwd
# bwd): bench_add_norm.py --op rms_norm --D 1024 4096 8192; bench_layer_norm.py (quick: D 512 4096 32768 262144);
# bench_add_norm.py --op layer_norm --D 4096; bench_rms_norm.py --D 4096 32768 262144 (D=512 predicted as well).
BENCH_CELLS = [
    ("rms_norm", True, [1024, 4096, 8192]),
    ("layer_norm", False, [512, 4096, 32768, 262144]),
    ("layer_norm", True, [4096]),
    ("rms_norm", False, [512, 4096, 32768, 262144]),
]
GPU_CHECK_RMS_D = (4096, 32768, 262144)


def predictions(out_dir: Path) -> list[dict]:
    """Writes predictions.csv for the cells of BENCH_CELLS (the fused add also as the unfused torch_ln pair, with
    torch's add taken at copy bandwidth) and returns its rows."""
    out = []
    for op, fused, Ds in BENCH_CELLS:
        for dtype in ("float32", "bfloat16"):
            for mode in ("fwd", "bwd"):
                for D in Ds:
                    elem = DTYPES[dtype].itemsize
                    M = bench_rows(D, elem)
                    r = model_case(op, mode, dtype, D, M, fused)
                    name = ("add_" if fused else "") + op
                    row = {
                        "op": name,
                        "dtype": dtype,
                        "mode": mode,
                        "D": D,
                        "M": M,
                        "provider": "fused" if fused else "torch_ln",
                        "predicted_ms": round(r["predicted_us"] / 1e3, 4),
                        "predicted_gbps": round(r["predicted_pct_copy"] / 100 * H200.copy_bandwidth / 1e9, 1),
                        "predicted_pct_copy": r["predicted_pct_copy"],
                        "path": path_name(r["plan"]),
                        "unit": r["unit"]["unit"],
                        "units_per_sm": r["unit"]["units_per_sm"],
                        "steps": r["steps"],
                        "period_us": r["period_us"],
                        "bound": r["bound"],
                        **{f"f_{k}": v for k, v in r["features"].items()},
                        "structure_check": r["structure_check"],
                        "in_gpu_check": not (op == "rms_norm" and not fused and D not in GPU_CHECK_RMS_D),
                        "calibration_cell": op == "layer_norm" and not fused,
                    }
                    out.append(row)
                    if fused:  # the unfused pair: torch's add (2 reads, 1 write) + torch_ln's norm of h
                        pair, plain = pair_us(op, mode, dtype, D, M)
                        pair_bytes = bench_bytes(op, mode, D, M, elem, True)
                        out.append(
                            {
                                **{k: row[k] for k in ("op", "dtype", "mode", "D", "M")},
                                "provider": "torch_ln_pair",
                                "predicted_ms": round(pair / 1e3, 4),
                                "predicted_gbps": round(pair_bytes / (pair * 1e-6) / 1e9, 1),
                                "predicted_pct_copy": round(100 * pair_bytes / (pair * 1e-6) / H200.copy_bandwidth, 1),
                                "path": path_name(plain["plan"]),
                                "unit": plain["unit"]["unit"],
                                "units_per_sm": plain["unit"]["units_per_sm"],
                                "steps": plain["steps"],
                                "period_us": plain["period_us"],
                                "bound": plain["bound"] + "+add at copy",
                                **{f"f_{k}": v for k, v in plain["features"].items()},
                                "structure_check": plain["structure_check"],
                                "in_gpu_check": True,
                                "calibration_cell": False,
                            }
                        )
                    print(f"{name} {dtype} {mode} D={D}: {r['predicted_us'] / 1e3:.3f} ms", file=sys.stderr, flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / "predictions.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(out[0]))
        writer.writeheader()
        writer.writerows(out)
    return out


PREDICTION_GOAL = 0.20  # issue 36: the next GPU run's cells within +-20% of the predictions written before it


def score(predictions_csv: Path, measured_csvs: list[Path]) -> tuple[str, int, int]:
    """Measured (benchmark CSVs) against a predictions.csv written before the run, cell by cell, without the emulator
    or ptxas: the ratio measured / predicted and whether it is within PREDICTION_GOAL. Returns the table, the cells
    matched and those within the goal."""
    predicted = {}
    for row in _csv_rows(predictions_csv):
        key = (row["op"], row["provider"], row["dtype"], row["mode"], int(row["D"]), int(row["M"]))
        predicted[key] = float(row["predicted_ms"])
    head = (
        f"{'op':<14} {'provider':<13} {'dtype':<8} {'mode':<4} {'D':>6} {'M':>8} {'measured ms':>11} "
        f"{'predicted ms':>12} {'meas/pred':>9}"
    )
    lines, matched, within = [head], 0, 0
    for path in measured_csvs:
        for row in _csv_rows(path):
            key = (row["op"], row["provider"], row["dtype"], row["mode"], int(row["D"]), int(row["M"]))
            if key not in predicted or math.isnan(float(row["ms"] or "nan")):
                continue
            ratio = float(row["ms"]) / predicted.pop(key)
            matched += 1
            within += abs(ratio - 1) <= PREDICTION_GOAL
            lines.append(
                f"{key[0]:<14} {key[1]:<13} {key[2]:<8} {key[3]:<4} {key[4]:>6} {key[5]:>8} {float(row['ms']):>11.4f} "
                f"{float(row['ms']) / ratio:>12.4f} {ratio:>9.2f}"
                + ("" if abs(ratio - 1) <= PREDICTION_GOAL else "  MISS")
            )
    lines.append(
        f"{within} of {matched} measured cells within +-{PREDICTION_GOAL:.0%}; "
        f"{len(predicted)} predicted cells not measured"
    )
    return "\n".join(lines), matched, within


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the records here")
    parser.add_argument("--ops", nargs="+", default=["layer_norm", "rms_norm"], choices=["layer_norm", "rms_norm"])
    parser.add_argument("--modes", nargs="+", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    parser.add_argument("--D", nargs="+", type=int, default=DEFAULT_D)
    parser.add_argument("--fused", action="store_true", help="the fused residual add + norm")
    parser.add_argument("--compare", nargs="+", type=Path, help="benchmark CSVs: print measured beside predicted")
    parser.add_argument("--calibrate", nargs="+", type=Path, help="benchmark CSVs: fit the constants on them")
    parser.add_argument("--out", type=Path, help="--calibrate: write the fit (constants, cells, LOO) as JSON here")
    parser.add_argument("--predict", type=Path, metavar="DIR", help="write predictions.csv for gpu_check's cells")
    parser.add_argument(
        "--score",
        nargs="+",
        type=Path,
        metavar="CSV",
        help="PREDICTIONS.csv MEASURED.csv...: measured against predictions written before the run (no emulator)",
    )
    args = parser.parse_args(argv)
    start = time.time()
    if args.score:
        text, _, _ = score(args.score[0], args.score[1:])
        print(text)
    elif args.calibrate:
        cal = calibrate(args.calibrate)
        print(calibration_report(cal))
        print("\nCALIBRATION us_per = " + json.dumps({k: round(v, 6) for k, v in cal["us_per"].items()}))
        if args.out:
            args.out.write_text(json.dumps(cal, indent=1) + "\n")
    elif args.compare:
        print(compare(args.compare))
    elif args.predict:
        rows = predictions(args.predict)
        print(f"{len(rows)} predictions written to {args.predict / 'predictions.csv'}")
    else:
        records = []
        for op in args.ops:
            for mode in args.modes:
                for dtype in args.dtypes:
                    for D in args.D:
                        records.append(model_case(op, mode, dtype, D, fused=args.fused))
                        print(table(records[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
        assert all(list(r) == RECORD_KEYS for r in records)
        print(
            f"Model of the CUDA kernels on an H200 (a model, not a measurement, not expected performance until a GPU "
            f"run confirms it; see benchmarks/README.md), {CASE_BYTES >> 20} MiB per case"
        )
        print(table(records))
        if args.json:
            args.json.write_text(json.dumps(records, indent=1) + "\n")
    print(f"kernel model: {time.time() - start:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
