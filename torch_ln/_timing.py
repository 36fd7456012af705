"""The timing core of ``python -m torch_ln``, also the base of the benchmark harness (benchmarks/harness.py):
median times of several functions timed in interleaved rounds, the device's copy bandwidth and its name."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils.benchmark import Timer


@dataclass(frozen=True)
class Timing:
    """How long to time each provider of a case: `seconds` in all. On CUDA in `rounds` interleaved rounds; on the
    CPU in rounds of CPU_BLOCK_SECONDS each (see measure)."""

    seconds: float
    rounds: int


FULL = Timing(seconds=1.0, rounds=5)
QUICK = Timing(seconds=0.3, rounds=3)
# A CPU round runs each provider for about this long. A shared machine has slow spells of tens of milliseconds that
# would decide a comparison of long blocks; rounds this short put every provider in each spell alike.
CPU_BLOCK_SECONDS = 0.005


def _cpu_interleaved_times(fns: dict[str, Callable[[], object]], seconds: float) -> dict[str, list[float]]:
    """Seconds per call of each function, from short blocks of calls, alternating between the functions (in an
    order that rotates every round), about `seconds` for each in all (at least 3 rounds)."""
    threads = torch.get_num_threads()
    timers = {name: Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads) for name, fn in fns.items()}
    call_seconds = {name: timer.timeit(1).mean for name, timer in timers.items()}
    calls = {name: max(1, round(CPU_BLOCK_SECONDS / t)) for name, t in call_seconds.items()}
    # A block is one call at least: a slow provider makes the rounds longer, so fewer of them fill `seconds`.
    rounds = max(3, round(seconds / max(CPU_BLOCK_SECONDS, *call_seconds.values())))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for round_index in range(rounds):
        start = round_index % len(names)
        for name in names[start:] + names[:start]:
            samples[name].append(timers[name].timeit(calls[name]).mean)
    return samples


def _cuda_times(fn: Callable[[], object], seconds: float) -> list[float]:
    for _ in range(3):  # warm-up
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    # Enough repetitions to fill `seconds`, each timed by its own pair of events.
    reps = int(min(max(seconds / max(start.elapsed_time(end) / 1e3, 1e-6), 10), 2000))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in events]


def measure(fns: dict[str, Callable[[], object]], device: str, timing: Timing) -> dict[str, float]:
    """Median milliseconds of each function, timed in interleaved rounds so that noise hits all alike."""
    if device == "cuda":
        samples: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(timing.rounds):
            for name, fn in fns.items():
                samples[name] += _cuda_times(fn, timing.seconds / timing.rounds)
    else:
        samples = _cpu_interleaved_times(fns, timing.seconds)
    return {name: statistics.median(times) * 1e3 for name, times in samples.items()}


def copy_bandwidth(device: str, nbytes: int) -> float:
    """GB/s of a large `dst.copy_(src)` on the device, counting the read and the write (2 * nbytes)."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    ms = measure({"copy": lambda: dst.copy_(src)}, device, Timing(seconds=1.0, rounds=1))["copy"]
    return 2 * nbytes / (ms * 1e-3) / 1e9


def device_name(device: str) -> str:
    """A readable name for the device, with its thread count on the CPU."""
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"CPU, {torch.get_num_threads()} threads"
