"""Benchmark harness of benchmarks/bench_*.py (its timing core, torch_ln/_timing.py, is the package's).

Times torch_ln's LayerNorm/RMSNorm against torch eager, torch.compile and, on CUDA,
Liger, Apex and QuACK when they are installed; reports each case's time, effective
bandwidth (also as a share of the device's measured copy bandwidth), speedup over
torch eager and peak memory, and writes a CSV and one PNG plot per (dtype, mode).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import math
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

import torch_ln
from torch_ln._timing import FULL, QUICK, Timing, copy_bandwidth, device_name, measure

OPS = ("layer_norm", "rms_norm")
MODES = ("fwd", "bwd", "fwd+bwd")
PROVIDERS = ("torch_ln", "torch", "compile", "liger", "apex", "quack")
EXTERNAL = ("liger", "apex", "quack")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_D = (256, 512, 768, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
QUICK_D = (512, 4096, 32768, 262144)
EPS = {"layer_norm": 1e-5, "rms_norm": 1e-6}
# Largest error allowed against torch in float32, relative to the largest magnitude of its result.
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 3e-2, torch.float16: 1e-2}

Norm = Callable[[Tensor, Tensor, Tensor | None], Tensor]


@dataclass(frozen=True)
class Provider:
    """An implementation under test: ``fn(x, weight, bias)``; ``bias=False`` if it takes no LayerNorm bias."""

    name: str
    fn: Norm
    bias: bool = True


@dataclass
class Result:
    """One row of the report: a provider timed on one (op, dtype, mode, M, D) case."""

    op: str
    device: str
    dtype: str
    mode: str
    M: int
    D: int
    provider: str
    ms: float = math.nan
    gbps: float = math.nan
    pct_copy: float = math.nan
    speedup_vs_torch: float = math.nan
    peak_mib: float | None = None
    peak_vs_torch: float | None = None
    max_error: float = math.nan
    check: str = "ok"


# Bytes each case must move at the least: every tensor read or written exactly once.


def layer_norm_bytes(mode: str, M: int, D: int, es: int, ps: int) -> int:
    """Bytes LayerNorm moves; es/ps: element size of the input/parameter dtype; mean and rstd are float32."""
    fwd = (
        M * D * es  # read x
        + M * D * es  # write y
        + 2 * D * ps  # read weight and bias
        + 2 * M * 4  # write mean and rstd
    )
    bwd = (
        2 * M * D * es  # read x and dy
        + 2 * M * 4  # read mean and rstd
        + D * ps  # read weight
        + M * D * es  # write dx
        + 2 * D * ps  # write dweight and dbias
    )
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


def rms_norm_bytes(mode: str, M: int, D: int, es: int, ps: int) -> int:
    """Bytes RMSNorm moves: LayerNorm's without the mean and the bias."""
    fwd = (
        M * D * es  # read x
        + M * D * es  # write y
        + D * ps  # read weight
        + M * 4  # write rstd
    )
    bwd = (
        2 * M * D * es  # read x and dy
        + M * 4  # read rstd
        + D * ps  # read weight
        + M * D * es  # write dx
        + D * ps  # write dweight
    )
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[mode]


BYTES = {"layer_norm": layer_norm_bytes, "rms_norm": rms_norm_bytes}


# Providers.


def _torch_fn(op: str) -> Norm:
    eps = EPS[op]
    if op == "layer_norm":
        return lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, eps)
    return lambda x, w, b: F.rms_norm(x, x.shape[-1:], w, eps)


def _torch_ln_fn(op: str) -> Norm:
    eps = EPS[op]
    if op == "layer_norm":
        return lambda x, w, b: torch_ln.layer_norm(x, x.shape[-1:], w, b, eps)
    return lambda x, w, b: torch_ln.rms_norm(x, x.shape[-1:], w, eps)


def _liger(op: str) -> Provider:
    eps = EPS[op]
    if op == "layer_norm":
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction

        return Provider("liger", lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, eps))
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    # offset 0, llama casting, in_place=False: in place, Liger would overwrite dy with dx.
    return Provider("liger", lambda x, w, b: LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", False))


def _apex(op: str) -> Provider:
    from apex.normalization.fused_layer_norm import fused_layer_norm_affine, fused_rms_norm_affine

    eps = EPS[op]
    if op == "layer_norm":
        return Provider("apex", lambda x, w, b: fused_layer_norm_affine(x, w, b, x.shape[-1:], eps))
    return Provider("apex", lambda x, w, b: fused_rms_norm_affine(x, w, x.shape[-1:], eps))


def _quack(op: str) -> Provider:
    eps = EPS[op]
    # QuACK wants a float32 weight; its LayerNorm has no bias.
    if op == "layer_norm":
        from quack.layernorm import layernorm

        return Provider("quack", lambda x, w, b: layernorm(x, w.float(), eps=eps), bias=False)
    from quack.rmsnorm import rmsnorm

    return Provider("quack", lambda x, w, b: rmsnorm(x, w.float(), eps=eps))


_EXTERNAL_LOADERS = {"liger": _liger, "apex": _apex, "quack": _quack}


def _build(name: str, op: str) -> Provider:
    if name == "torch_ln":
        return Provider(name, _torch_ln_fn(op))
    if name == "torch":
        return Provider(name, _torch_fn(op))
    if name == "compile":
        return Provider(name, torch.compile(_torch_fn(op), dynamic=False))
    return _EXTERNAL_LOADERS[name](op)


def resolve_providers(op: str, device: str, names: Sequence[str]) -> list[str]:
    """The requested providers that can run here (torch always, as the baseline); prints why others cannot."""
    usable = []
    for name in dict.fromkeys(["torch", *names]):
        if name in EXTERNAL and device != "cuda":
            print(f"note: {name} skipped: CUDA-only")
            continue
        if name in EXTERNAL:
            try:
                _build(name, op)
            except Exception as error:  # noqa: BLE001 - an import can fail in many ways (no module, CUDA mismatch)
                print(f"note: {name} skipped: not importable ({type(error).__name__}: {error})")
                continue
        usable.append(name)
    return usable


def keep_freed_memory() -> str:
    """Tells glibc's malloc to keep freed memory for reuse instead of returning it to the OS; returns what was done.

    With its defaults, whether a large output lands on pages already mapped or on fresh ones that fault in on first
    touch depends on what the previously timed provider allocated and freed: a cost of the allocator, decided by the
    call order, that would swamp differences between kernels. (Fresh pages also cost streaming stores, torch_ln's
    for large outputs, more than plain ones: the page is zeroed into the cache, then written around it.) CPU
    deployments that care use jemalloc or tcmalloc, which also keep memory; --malloc-defaults times without this.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "malloc: not glibc, left as it is"
    m_trim_threshold, m_mmap_max = -1, -4  # from <malloc.h>
    # No mmap at all: the mmap threshold tops out at 32 MiB, so raising it left every larger block a fresh mapping,
    # faulted in on each call (until 2026-12-03: the 64 MiB cases timed torch's faults, not kernels).
    if mallopt(m_trim_threshold, 2**30) != 1 or mallopt(m_mmap_max, 0) != 1:
        return "malloc: glibc refused the settings, left as it is"
    return "malloc: glibc keeps freed memory (trim threshold 1 GiB, no mmap: every size from the heap)"


def add_model_step_arguments(parser: argparse.ArgumentParser, hidden: int) -> None:
    """The arguments of the benchmarks that time a model's step (bench_compile_pass.py, bench_memory_efficient.py)."""
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--quick", action="store_true")


def speed_columns(nbytes: int, ms: dict[str, float], provider: str, copy_gbps: float) -> dict:
    """A provider's time, bandwidth (from the case's byte count), share of copy bandwidth and speedup over torch
    eager (ms["torch"]), as the CSV columns ms, gbps, pct_copy, speedup_vs_torch."""
    gbps = nbytes / ms[provider] / 1e6
    return {
        "ms": round(ms[provider], 4),
        "gbps": round(gbps, 2),
        "pct_copy": round(100 * gbps / copy_gbps, 1),
        "speedup_vs_torch": round(ms["torch"] / ms[provider], 2),
    }


def write_rows(rows: Sequence[dict], path: Path) -> None:
    """Rows of one benchmark (dicts with the same keys) as a CSV at `path`, its folder made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def peak_memory_mib(fn: Callable[[], object], device: str) -> float | None:
    """MiB allocated by one call at its peak, above what was allocated before; None where unmeasurable (CPU)."""
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


# One case: inputs, output check, timing.


@dataclass
class _Inputs:
    x: Tensor
    weight: Tensor
    bias: Tensor | None
    dy: Tensor

    def args(self, provider: Provider) -> tuple[Tensor, Tensor, Tensor | None]:
        return self.x, self.weight, self.bias if provider.bias else None


def _make_inputs(op: str, device: str, dtype: torch.dtype, M: int, D: int) -> _Inputs:
    def randn(*shape: int, scale: float = 1.0, shift: float = 0.0) -> Tensor:
        return (torch.randn(*shape, device=device) * scale + shift).to(dtype).requires_grad_()

    bias = randn(D, scale=0.1) if op == "layer_norm" else None
    return _Inputs(randn(M, D), randn(D, scale=0.1, shift=1.0), bias, randn(M, D).detach())


def _outputs(provider: Provider, mode: str, inputs: _Inputs) -> list[Tensor]:
    """The output and, for modes with a backward, the gradients of x, weight (and bias)."""
    args = inputs.args(provider)
    y = provider.fn(*args)
    if mode == "fwd":
        return [y.detach()]
    return [y.detach(), *torch.autograd.grad(y, [a for a in args if a is not None], inputs.dy)]


def _check(provider: Provider, op: str, mode: str, inputs: _Inputs, row: Result) -> None:
    """Sets row.max_error and row.check: 'ok', 'INACCURATE <error>' or 'error: <why the provider failed>'.

    Every provider, torch included, is judged against the same yardstick: torch eager run in float64 on upcast
    copies of the inputs. So an INACCURATE torch row means torch itself is that far from the exact result (on the
    CPU, torch's own bfloat16 LayerNorm dweight and dbias are off by several percent), not that torch_ln disagrees.
    The error is the largest over the output (and gradients), relative to the yardstick's largest magnitude.
    """
    try:
        got = _outputs(provider, mode, inputs)
    except Exception as error:  # noqa: BLE001 - a provider may reject a shape or dtype: report it, go on
        row.check = f"error: {type(error).__name__}: {str(error).splitlines()[0][:100] if str(error) else ''}"
        return
    upcast = [
        None if t is None else t.detach().double().requires_grad_() for t in (inputs.x, inputs.weight, inputs.bias)
    ]
    want = _outputs(Provider("torch", _torch_fn(op), provider.bias), mode, _Inputs(*upcast, inputs.dy.double()))
    row.max_error = max(
        ((g.double() - w).abs().max() / w.abs().max().clamp_min(1e-6)).item() for g, w in zip(got, want)
    )
    row.check = "ok" if row.max_error <= TOLERANCE[inputs.x.dtype] else f"INACCURATE {row.max_error:.1e}"


def _step(provider: Provider, mode: str, inputs: _Inputs) -> Callable[[], object]:
    """What one timed repetition runs; "bwd" backpropagates through a graph built once, here."""
    args = inputs.args(provider)
    wrt = [a for a in args if a is not None]
    if mode == "fwd":
        return lambda: provider.fn(*args)
    if mode == "fwd+bwd":
        return lambda: torch.autograd.grad(provider.fn(*args), wrt, inputs.dy)
    y = provider.fn(*args)
    return lambda: torch.autograd.grad(y, wrt, inputs.dy, retain_graph=True)


def run_case(
    op: str,
    device: str,
    dtype: torch.dtype,
    mode: str,
    M: int,
    D: int,
    providers: Sequence[str],
    timing: Timing,
    copy_gbps: float,
) -> list[Result]:
    """Checks then times every provider on one (M, D) case; `providers` must include "torch"."""
    torch._dynamo.reset()  # dynamic=False compiles each shape anew: keep the cache from filling up
    inputs = _make_inputs(op, device, dtype, M, D)
    built = {name: _build(name, op) for name in providers}
    dtype_name = str(dtype).removeprefix("torch.")
    results = {name: Result(op, device, dtype_name, mode, M, D, name) for name in providers}
    # A compiled backward that donates its buffers refuses retain_graph=True, which "bwd" needs.
    with torch._functorch.config.patch(donated_buffer=mode != "bwd"):
        for name, provider in built.items():
            _check(provider, op, mode, inputs, results[name])
        steps = {
            name: _step(p, mode, inputs) for name, p in built.items() if not results[name].check.startswith("error")
        }
        times = measure(steps, device, timing)
        nbytes = BYTES[op](mode, M, D, inputs.x.element_size(), inputs.weight.element_size())
        for name, step in steps.items():
            row = results[name]
            row.ms = times[name]
            row.gbps = nbytes / (row.ms * 1e-3) / 1e9
            row.pct_copy = 100 * row.gbps / copy_gbps
            row.speedup_vs_torch = times["torch"] / row.ms
            row.peak_mib = peak_memory_mib(step, device)
    for row in results.values():
        if row.peak_mib is not None and results["torch"].peak_mib:
            row.peak_vs_torch = row.peak_mib / results["torch"].peak_mib
    return list(results.values())


# Reporting.

_COLUMNS = "{:<9} {:<7} {:>7} {:>8} {:<9} {:>9} {:>8} {:>6} {:>8} {:>9}  {}"


def print_header() -> None:
    """Prints the column titles of the table that print_row continues."""
    print(
        _COLUMNS.format("dtype", "mode", "D", "M", "provider", "ms", "GB/s", "%copy", "vs torch", "peak MiB", "check")
    )


def print_row(row: Result) -> None:
    """Prints one result as a table row."""
    peak = "n/a" if row.peak_mib is None else f"{row.peak_mib:.1f}"
    print(
        _COLUMNS.format(
            row.dtype,
            row.mode,
            row.D,
            row.M,
            row.provider,
            f"{row.ms:.4f}",
            f"{row.gbps:.1f}",
            f"{row.pct_copy:.0f}",
            f"{row.speedup_vs_torch:.2f}x",
            peak,
            row.check + ("  SLOWER than torch" if is_slower(row) else ""),
        ),
        flush=True,
    )


def is_slower(row: Result) -> bool:
    """Whether a torch_ln row took longer than torch eager on the same case."""
    return row.provider == "torch_ln" and row.speedup_vs_torch < 1.0


def print_legend() -> None:
    """Explains the columns a reader could misread, under a table."""
    print(
        "  %copy: GB/s (the bytes each tensor must move once, per second) over the device's large-copy bandwidth;\n"
        "         a case whose data stays in cache can exceed 100%.\n"
        "  check: each provider's result against float64 (torch run on upcast inputs); INACCURATE on a torch row\n"
        "         is torch's own rounding, not a torch_ln failure."
    )


def flag_inaccurate(results: Sequence[Result]) -> None:
    """Prints a FLAGGED line for each row whose accuracy check failed."""
    for row in results:
        if row.check != "ok":
            print(f"FLAGGED: {row.provider} {row.dtype} {row.mode} D={row.D}: {row.check}")


def write_outputs(results: Sequence[Result], csv_path: Path, copy_gbps: float, device: str) -> None:
    """Writes the CSV and, beside it, the plots."""
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    write_csv(results, csv_path)
    print(f"\nwrote {csv_path}")
    for path in plot(results, copy_gbps, csv_path.parent, device_name(device)):
        print(f"wrote {path}")


def write_csv(results: Sequence[Result], path: Path) -> None:
    """One row per (dtype, mode, D, provider); peak memory columns are empty where unmeasured."""
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=[f.name for f in fields(Result)])
        writer.writeheader()
        writer.writerows(asdict(row) for row in results)


def plot(results: Sequence[Result], copy_gbps: float, out: Path, device_name: str) -> list[Path]:
    """One PNG of GB/s against D per (dtype, mode), a line per provider; [] if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is not installed; no plots (pip install matplotlib)")
        return []
    paths = []
    for dtype, mode in dict.fromkeys((r.dtype, r.mode) for r in results):
        rows = [r for r in results if (r.dtype, r.mode) == (dtype, mode) and not math.isnan(r.gbps)]
        fig, ax = plt.subplots(figsize=(8, 5))
        for provider in dict.fromkeys(r.provider for r in rows):
            mine = [r for r in rows if r.provider == provider]
            ax.plot([r.D for r in mine], [r.gbps for r in mine], marker="o", label=provider)
        ax.axhline(copy_gbps, color="grey", linestyle="--", label=f"copy ({copy_gbps:.0f} GB/s)")
        ax.set_xscale("log", base=2)
        ax.set(
            xlabel="D (normalized size)", ylabel="effective GB/s", title=f"{rows[0].op} {dtype} {mode}, {device_name}"
        )
        ax.legend()
        ax.grid(alpha=0.3)
        path = out / f"{rows[0].op}_{rows[0].device}_{dtype}_{mode.replace('+', '_')}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def summarize(results: Sequence[Result]) -> bool:
    """Prints, per (dtype, mode), the median and min over D of torch_ms / torch_ln_ms.

    On the CPU it also judges the bar for fwd and fwd+bwd (median >= 1.0 and min >= 0.9) and
    returns whether every such bar was met (True when there is nothing to judge).
    """
    passed = True
    print("\nspeedup of torch_ln over torch eager (torch ms / torch_ln ms) across D:")
    for dtype, mode in dict.fromkeys((r.dtype, r.mode) for r in results):
        ratios = {
            r.D: r.speedup_vs_torch
            for r in results
            if (r.dtype, r.mode, r.provider) == (dtype, mode, "torch_ln") and not math.isnan(r.ms)
        }
        if not ratios:
            continue
        median, worst = statistics.median(ratios.values()), min(ratios, key=ratios.get)
        line = f"  {dtype:<9} {mode:<7} median {median:.2f}x  min {ratios[worst]:.2f}x (D={worst})"
        if results[0].device == "cpu" and mode != "bwd":
            ok = median >= 1.0 and ratios[worst] >= 0.9
            passed &= ok
            line += f"  CPU bar (median>=1.0, min>=0.9): {'PASS' if ok else 'FAIL'}"
        print(line)
    return passed


def sweep(
    op: str,
    device: str,
    dtypes: Sequence[torch.dtype],
    modes: Sequence[str],
    sizes: Sequence[int],
    providers: Sequence[str],
    case_bytes: int,
    timing: Timing,
    copy_gbps: float,
) -> list[Result]:
    """Runs every (dtype, mode, D) case, printing each row as it comes; M*D*element_size ~= case_bytes."""
    results = []
    print_header()
    for dtype in dtypes:
        for mode in modes:
            for D in sizes:
                M = max(1, case_bytes // (D * dtype.itemsize))
                for row in run_case(op, device, dtype, mode, M, D, providers, timing, copy_gbps):
                    print_row(row)
                    results.append(row)
    return results


# Command line.


def parse_bytes(text: str) -> int:
    """'16MiB', '2GiB', '500MB', '1e9' or '1048576' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*(?:([KMGT])(i?)B)?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 16MiB, 2GiB)")
    scale = (1024 if match[3] else 1000) ** "_KMGT".index(match[2]) if match[2] else 1
    return int(float(match[1]) * scale)


def cli(op: str, argv: Sequence[str] | None = None) -> int:
    """The command line of benchmarks/bench_<op>.py; returns the exit status.

    It is 1 when torch_ln's results disagree with torch's or, on the CPU, when the speed bar is missed.
    """
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=f"Benchmark torch_ln.{op} against torch and other providers.")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if cuda else "cpu")
    parser.add_argument(
        "--dtypes", nargs="+", choices=tuple(DTYPES), help="default: float32 bfloat16 [float16 on cuda]"
    )
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--D", nargs="+", type=int, help=f"normalized sizes; default {' '.join(map(str, DEFAULT_D))}")
    parser.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"), help="where the CSV and PNGs go")
    parser.add_argument(
        "--bytes", type=parse_bytes, help="input size per case (M*D*element_size); default 2GiB on cuda, 16MiB on cpu"
    )
    parser.add_argument("--quick", action="store_true", help=f"D in {QUICK_D} unless --D, shorter timing")
    parser.add_argument(
        "--malloc-defaults", action="store_true", help="CPU: leave glibc's malloc as it is (see keep_freed_memory)"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not cuda:
        parser.error("CUDA is not available")
    dtypes = args.dtypes or ["float32", "bfloat16", *(["float16"] if args.device == "cuda" else [])]
    sizes = args.D or (QUICK_D if args.quick else DEFAULT_D)
    case_bytes = args.bytes or (2 * 2**30 if args.device == "cuda" else 16 * 2**20)
    timing = QUICK if args.quick else FULL

    print(
        f"torch_ln.{op} on {device_name(args.device)}; torch {torch.__version__}; "
        f"{case_bytes / 2**20:.0f} MiB of input per case"
    )
    if args.device == "cpu" and not args.malloc_defaults:
        print(keep_freed_memory())
    copy_gbps = copy_bandwidth(args.device, max(case_bytes, 256 * 2**20))
    print(f"copy bandwidth: {copy_gbps:.1f} GB/s")
    providers = resolve_providers(op, args.device, args.providers)
    results = sweep(
        op, args.device, [DTYPES[d] for d in dtypes], args.modes, sizes, providers, case_bytes, timing, copy_gbps
    )
    print_legend()
    flag_inaccurate(results)
    passed = summarize(results) and all(r.check == "ok" for r in results if r.provider == "torch_ln")
    write_outputs(results, args.out / f"{op}_{args.device}.csv", copy_gbps, args.device)
    if args.device == "cpu":
        print("peak memory: n/a on the CPU (torch keeps no CPU allocator statistics)")
    return 0 if passed else 1
