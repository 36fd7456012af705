"""Per-call latency of LayerNorm and RMSNorm at decode-time batch sizes (issue 36, item 5): a few rows, M = 1, 8, 64,
at D = 4096 and 8192, where a call costs its launch and its fixed overheads rather than its bytes.

Providers: `torch` (eager F.layer_norm / F.rms_norm), `compile` (torch.compile of that function, dynamic=False: every
shape compiled on its own, the dynamo cache reset per case, compile time not timed) and `torch_ln`
(torch_ln.layer_norm / rms_norm). Inputs, providers and the accuracy check are the shared harness's
(benchmarks/harness.py); `fwd` is an inference call (no input requires grad), `fwd+bwd` the forward and
torch.autograd.grad of x, weight (and bias).

Modes:
  eager   CUDA: CUDA events around a loop of --calls back-to-back calls, per call, median over --rounds rounds, the
          providers taking turns round by round; whichever is slower, the host's dispatch or the kernels, sets it.
          CPU: the harness's timing core (torch_ln/_timing.py: interleaved blocks of calls, median).
  graph   CUDA only: --graph-calls calls captured in one torch.cuda.CUDAGraph (after a warm-up on a side stream),
          the graph replayed --replays times between CUDA events, per call, median over --rounds rounds. The last
          captured call's results must equal an eager call's bitwise, else the row's check says so.

The summary gives, per case, the fastest provider and torch_ln's distance to it in microseconds, against the goal
of the issue: torch_ln no slower than torch eager and within 1 us of the fastest peer (in the same mode). The goal
is reported, not enforced: the exit status is 1 only when a torch_ln row fails its accuracy check or capture.

    python benchmarks/bench_latency.py                          # CUDA if available, else the CPU (eager only)
    python benchmarks/bench_latency.py --quick --steps fwd --out /tmp/latency
    python benchmarks/bench_latency.py --device cpu --quick --providers torch_ln torch --M 1 8 --D 4096
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import harness
import torch

from torch_ln._timing import Timing, device_name, measure

OPS = ("layer_norm", "rms_norm")
STEPS = ("fwd", "fwd+bwd")
PROVIDERS = ("torch_ln", "torch", "compile")
DEFAULT_M = (1, 8, 64)
DEFAULT_D = (4096, 8192)
GOAL_US = 1.0  # torch_ln within this of the fastest peer


@dataclass(frozen=True)
class Budget:
    """How much to time: --calls per eager round, --graph-calls captured per graph, --replays per graph round."""

    calls: int
    graph_calls: int
    replays: int
    rounds: int
    cpu_seconds: float


FULL = Budget(calls=200, graph_calls=20, replays=20, rounds=15, cpu_seconds=0.5)
QUICK = Budget(calls=100, graph_calls=20, replays=10, rounds=5, cpu_seconds=0.1)


@dataclass
class Row:
    """One provider in one mode on one (op, dtype, step, M, D) case."""

    op: str
    device: str
    dtype: str
    step: str
    M: int
    D: int
    provider: str
    mode: str
    us_per_call: float = math.nan
    max_error: float = math.nan
    check: str = "ok"


def _inputs(op: str, device: str, dtype: torch.dtype, step: str, M: int, D: int) -> harness._Inputs:
    inputs = harness._make_inputs(op, device, dtype, M, D)
    if step == "fwd":  # inference: nothing requires grad, so there is no autograd graph to build
        detach = [None if t is None else t.detach() for t in (inputs.x, inputs.weight, inputs.bias)]
        return harness._Inputs(*detach, inputs.dy)
    return inputs


def _median_us(samples: Sequence[float]) -> float:
    return statistics.median(samples) * 1e6


def _cuda_eager_us(steps: dict[str, Callable[[], object]], budget: Budget) -> dict[str, float]:
    """Per-call microseconds of back-to-back calls, CUDA events around each loop, providers taking turns."""
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for fn in steps.values():  # warm-up
        for _ in range(5):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(budget.rounds):
        for name, fn in steps.items():
            torch.cuda.synchronize()
            start.record()
            for _ in range(budget.calls):
                fn()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / 1e3 / budget.calls)
    return {name: _median_us(s) for name, s in samples.items()}


def _flatten(result: object) -> list[torch.Tensor]:
    return [result] if isinstance(result, torch.Tensor) else [t for t in result if t is not None]


class _Captured:
    """`graph_calls` calls of a step captured in one CUDA graph, with the last call's results kept."""

    def __init__(self, fn: Callable[[], object], graph_calls: int):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up away from the default stream, as torch.cuda.graphs asks
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            for _ in range(graph_calls):
                last = fn()
        self.last = _flatten(last)
        self.calls = graph_calls

    def matches(self, fn: Callable[[], object]) -> bool:
        """Whether a replay leaves the last captured call's results bitwise equal to an eager call's."""
        self.graph.replay()
        torch.cuda.synchronize()
        return all(torch.equal(a, b) for a, b in zip(self.last, _flatten(fn()), strict=True))


def _cuda_graph_us(graphs: dict[str, _Captured], budget: Budget) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for captured in graphs.values():
        captured.graph.replay()
    for _ in range(budget.rounds):
        for name, captured in graphs.items():
            torch.cuda.synchronize()
            start.record()
            for _ in range(budget.replays):
                captured.graph.replay()
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) / 1e3 / (budget.replays * captured.calls))
    return {name: _median_us(s) for name, s in samples.items()}


def _error(error: Exception) -> str:
    text = str(error).splitlines()[0][:100] if str(error) else ""
    return f"error: {type(error).__name__}: {text}"


def run_case(
    op: str,
    device: str,
    dtype: torch.dtype,
    step: str,
    M: int,
    D: int,
    providers: Sequence[str],
    budget: Budget,
    graph: bool = True,
) -> list[Row]:
    """Checks, then times every provider on one case: eager, and on CUDA (unless `graph` is False) under a CUDA
    graph too."""
    torch._dynamo.reset()  # dynamic=False compiles each shape anew: keep the cache from filling up
    inputs = _inputs(op, device, dtype, step, M, D)
    dtype_name = str(dtype).removeprefix("torch.")
    modes = ("eager", "graph") if device == "cuda" and graph else ("eager",)
    rows = {(name, mode): Row(op, device, dtype_name, step, M, D, name, mode) for name in providers for mode in modes}
    steps = {}
    for name in providers:
        provider = harness._build(name, op)
        checked = harness.Result(op, device, dtype_name, step, M, D, name)
        harness._check(provider, op, step, inputs, checked)  # also compiles, outside the timing
        for mode in modes:
            rows[name, mode].max_error, rows[name, mode].check = checked.max_error, checked.check
        if not checked.check.startswith("error"):
            steps[name] = harness._step(provider, step, inputs)
    if device == "cuda":
        for name, us in _cuda_eager_us(steps, budget).items():
            rows[name, "eager"].us_per_call = us
    if "graph" in modes:
        graphs = {}
        for name, fn in steps.items():
            row = rows[name, "graph"]
            try:
                graphs[name] = _Captured(fn, budget.graph_calls)
                if not graphs[name].matches(fn):
                    row.check = "graph MISMATCH: replayed results differ from eager ones"
            except Exception as error:  # noqa: BLE001 - a provider may refuse capture: report it, go on
                row.check = f"graph {_error(error)}"
                graphs.pop(name, None)
                torch.cuda.synchronize()
        for name, us in _cuda_graph_us(graphs, budget).items():
            rows[name, "graph"].us_per_call = us
        del graphs
    if device == "cpu":
        timing = Timing(seconds=budget.cpu_seconds, rounds=budget.rounds)
        for name, ms in measure(steps, device, timing).items():
            rows[name, "eager"].us_per_call = ms * 1e3
    return list(rows.values())


# Reporting.

_COLUMNS = "{:<10} {:<9} {:<7} {:>4} {:>6} {:<9} {:<6} {:>10}  {}"


def print_header() -> None:
    print(_COLUMNS.format("op", "dtype", "step", "M", "D", "provider", "mode", "us/call", "check"))


def print_row(row: Row) -> None:
    print(
        _COLUMNS.format(
            row.op, row.dtype, row.step, row.M, row.D, row.provider, row.mode, f"{row.us_per_call:.2f}", row.check
        ),
        flush=True,
    )


def summarize(rows: Sequence[Row]) -> list[str]:
    """Per case and mode: the fastest provider, torch_ln's distance to it and to torch eager, and the goal."""
    lines = []
    cases = dict.fromkeys((r.op, r.dtype, r.step, r.M, r.D, r.mode) for r in rows)
    for case in cases:
        times = {
            r.provider: r.us_per_call
            for r in rows
            if (r.op, r.dtype, r.step, r.M, r.D, r.mode) == case and not math.isnan(r.us_per_call)
        }
        if not times:
            continue
        op, dtype, step, M, D, mode = case
        fastest = min(times, key=times.get)
        line = f"  {op:<10} {dtype:<9} {step:<7} M={M:<3} D={D:<5} {mode:<5}: fastest {fastest} {times[fastest]:.2f} us"
        if "torch_ln" in times:
            ours = times["torch_ln"]
            peers = {p: t for p, t in times.items() if p != "torch_ln"}
            if peers:
                best = min(peers, key=peers.get)
                line += f"; torch_ln {ours:.2f} us, {ours - peers[best]:+.2f} us vs {best}"
                ok = ours - peers[best] <= GOAL_US and ours <= times.get("torch", math.inf)
                if "torch" in times and best != "torch":
                    line += f", {ours - times['torch']:+.2f} us vs torch"
                line += f"  goal (<= torch, within {GOAL_US:g} us of the fastest peer): {'met' if ok else 'MISSED'}"
        lines.append(line)
    return lines


def write_csv(rows: Sequence[Row], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=[f.name for f in fields(Row)])
        writer.writeheader()
        writer.writerows(asdict(row) for row in rows)


def main(argv: Sequence[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if cuda else "cpu")
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--dtypes", nargs="+", choices=tuple(harness.DTYPES), default=["float32", "bfloat16"])
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    parser.add_argument("--M", nargs="+", type=int, default=list(DEFAULT_M), help="rows per call")
    parser.add_argument("--D", nargs="+", type=int, default=list(DEFAULT_D), help="normalized sizes")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--no-graph", action="store_true", help="CUDA: eager only, no CUDA graphs")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"), help="where the CSV goes")
    parser.add_argument("--quick", action="store_true", help="fewer calls and rounds")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not cuda:
        parser.error("CUDA is not available")
    budget = QUICK if args.quick else FULL
    device = args.device
    csv_path = args.out / f"latency_{device}.csv"
    print(f"per-call latency on {device_name(device)}; torch {torch.__version__}")
    providers = list(dict.fromkeys(args.providers))
    rows: list[Row] = []
    print_header()
    # Step outermost: a run cut short by a timeout has every forward first.
    for step in args.steps:
        for op in args.ops:
            for dtype in args.dtypes:
                for D in args.D:
                    for M in args.M:
                        dtype_ = harness.DTYPES[dtype]
                        case = run_case(op, device, dtype_, step, M, D, providers, budget, not args.no_graph)
                        for row in case:
                            print_row(row)
                        for line in summarize(case):
                            print(line, flush=True)
                        rows += case
                        write_csv(rows, csv_path)  # after every case: a run stopped early keeps what it measured
    print(f"\nwrote {csv_path}\n\nper case: the fastest provider and torch_ln's distance to it (us per call)")
    for line in summarize(rows):
        print(line)
    failed = [r for r in rows if r.provider == "torch_ln" and r.check != "ok"]
    for row in failed:
        print(f"FLAGGED: torch_ln {row.op} {row.dtype} {row.step} M={row.M} D={row.D} {row.mode}: {row.check}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
