"""Static gates on the CUDA kernels, without a GPU (run by scripts/run.sh after the emulated tests).

- Every kernel instantiation the CUDA build compiles for sm_90 (read from ptxas, so new kernels are covered as they
  appear) neither spills nor uses a stack frame (local memory).
- Every one of them is launched by the emulated tests, and every branch arm of the kernel sources is taken: gcov
  counts from `TORCH_LN_COVERAGE=1 pytest tests/emulated` (scripts/run.sh runs it just before this file).
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "emulated"))
import emulated_build
import kernel_resources

if kernel_resources.nvcc() is None:
    if os.environ.get("TORCH_LN_REQUIRE_GATES"):
        raise RuntimeError("TORCH_LN_REQUIRE_GATES is set but nvcc was not found (set CUDA_HOME)")
    pytest.skip("nvcc not found: the sm_90 gates need it", allow_module_level=True)

KERNELS = kernel_resources.compile_all()
NAMES = kernel_resources.demangle(sorted(KERNELS))


def _ids(names):
    return [kernel_resources.short_name(NAMES[n]) for n in names]


@pytest.mark.parametrize("kernel", sorted(KERNELS), ids=_ids(sorted(KERNELS)))
def test_no_spills_or_local_memory(kernel):
    k = KERNELS[kernel]
    assert (k["spill_stores"], k["spill_loads"], k["stack"]) == (0, 0, 0), (
        f"{NAMES[kernel]}: {k['registers']} registers, spills {k['spill_stores']}/{k['spill_loads']} bytes, "
        f"stack {k['stack']} bytes"
    )


def _no_coverage(why: str):
    """The coverage gates read what an earlier coverage run of the emulated tests counted: a plain `pytest` has
    none, so they skip there, and fail where scripts/run.sh requires them (TORCH_LN_REQUIRE_GATES)."""
    how = "run `TORCH_LN_COVERAGE=1 pytest tests/emulated` first (bash scripts/run.sh test does both)"
    if os.environ.get("TORCH_LN_REQUIRE_GATES"):
        pytest.fail(f"{why}: {how}")
    pytest.skip(f"{why}: {how}")


def _gcov_report() -> list[dict]:
    """gcov's JSON for the coverage build's kernel objects, from the last coverage run of the emulated tests."""
    build = emulated_build.COVERAGE_DIR
    notes = sorted(build.glob("*.gcno"))
    data = sorted(build.glob("*.gcda"))
    if not notes or not data:
        _no_coverage(f"no coverage data in {build}")
    library = max(build.glob("*.so"), key=lambda p: p.stat().st_mtime)
    if min(d.stat().st_mtime for d in data) < library.stat().st_mtime:
        _no_coverage(f"the coverage data in {build} is older than its build")
    files = []
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["gcov", "-j", "-b", *map(str, notes)], cwd=tmp, check=True, capture_output=True)
        for report in Path(tmp).glob("*.gcov.json.gz"):
            files += json.loads(gzip.decompress(report.read_bytes()))["files"]
    return files


@pytest.fixture(scope="module")
def coverage():
    return _gcov_report()


def _kernel_source(path: str) -> bool:
    p = Path(path)
    return p.parent.name == "cuda" and p.suffix == ".cuh"


# Kernels that are never launched by design: the occupancy API's subject where largest_cluster
# (csrc/cuda/cuda_context.cuh) asks whether a cluster of 16 fits; it does nothing.
NEVER_LAUNCHED = {"torch_ln::detail::cluster_probe_kernel()"}


def test_every_instantiation_launched(coverage):
    executed = defaultdict(int)
    for f in coverage:
        for fn in f["functions"]:
            executed[fn["name"]] += fn["execution_count"]
    assert NEVER_LAUNCHED <= set(NAMES.values()), "a kernel named in NEVER_LAUNCHED is gone: drop it there"
    never = [NAMES[k] for k in sorted(KERNELS) if executed[k] == 0 and NAMES[k] not in NEVER_LAUNCHED]
    assert not never, f"{len(never)} of {len(KERNELS)} kernel instantiations never launched:\n" + "\n".join(never)


def test_every_branch_arm_taken(coverage):
    # Per source line, arm i of the instantiations with the same number of arms (one template's instances):
    # taken when any instance took it. Exception edges are not branches of the kernel. A lambda inside a kernel is
    # one function for gcov whatever the instance: its lines list the arms of every instance together (calls'
    # fall-throughs included), so a lambda that some instances never call fails here; use a function template.
    taken: dict[tuple, int] = defaultdict(int)
    for f in coverage:
        if not _kernel_source(f["file"]):
            continue
        for line in f["lines"]:
            arms = [b for b in line["branches"] if not b["throw"]]
            for i, arm in enumerate(arms):
                taken[(Path(f["file"]).name, line["line_number"], len(arms), i)] += arm["count"]
    assert taken, "no branch data for csrc/cuda/*.cuh: is the coverage build missing the kernels?"
    missed = sorted(k for k, count in taken.items() if count == 0)
    assert not missed, (
        "branch arms never taken (file, line, arms, arm; on a lambda's line: an instance that never calls it): "
        + ", ".join(map(str, missed))
    )
