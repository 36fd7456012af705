"""The SIMT emulator's own checks (csrc/emulated/simt_emulator.cpp): barriers and shuffles give the right values,
a kernel that would hang a GPU (a barrier some threads never reach) or diverge at barriers fails at once with a
message instead of hanging, a dependent launch that would read its predecessor's output too early fails, and the
race check (TORCH_LN_RACECHECK=1) reports shared memory that two threads access with no barrier between; mbarriers
and st.async (the cluster reductions) exchange values, bulk copies stream through a ring of stages, each thread's
cp.async copies through its own slots, and their misuse fails or is reported as a race."""

from __future__ import annotations

import os
import subprocess

import emulated_build as build
import pytest


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    program = tmp_path_factory.mktemp("emulator") / "emulator_checks"
    emulator = build.ROOT / "csrc" / "emulated"
    source = build.ROOT / "tests" / "emulated" / "emulator_checks.cpp"
    compile_ = ["g++", "-std=c++20", "-O1", f"-I{emulator}", str(source), str(emulator / "simt_emulator.cpp")]
    subprocess.run([*compile_, "-o", str(program)], check=True, env=_without_preload())
    return program


def _without_preload():
    return {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}


def _run(program, check, **env):
    return subprocess.run(
        [str(program), check], check=False, capture_output=True, text=True, timeout=60, env=_without_preload() | env
    )


def test_barriers_and_shuffles(checks):
    result = _run(checks, "values")
    assert result.returncode == 0, result.stderr
    # Every block: the sum of 0..63 (pairs swapped, nothing lost or repeated); 6 blocks.
    assert result.stdout.split() == ["sum", str(6 * 63 * 64 // 2)]


@pytest.mark.parametrize(
    "check,message",
    [
        ("deadlock", "deadlock: threads wait at a barrier that not every thread of the block reaches"),
        ("divergent", "divergent barrier: some threads reached 'cluster barrier', others 'block end'"),
        # On a GPU the read could see the kernel before it still writing (programmatic dependent launch).
        ("dependent", "a dependent launch touched global memory before wait_for_prior_grid"),
    ],
)
def test_hang_fails_with_a_message(checks, check, message):
    result = _run(checks, check)
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_dependent_launch_reads_after_waiting(checks):
    result = _run(checks, "dependent_waits")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["read"]


def test_race_check_reports_an_unsynchronized_read(checks):
    result = _run(checks, "race", TORCH_LN_RACECHECK="1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "shared-memory race" in result.stderr and "read after write" in result.stderr, result.stderr
    assert "thread 40 of block rank 0 after thread 3 of block rank 0" in result.stderr, result.stderr


@pytest.mark.parametrize(
    "check,env", [("race_synced", {"TORCH_LN_RACECHECK": "1"}), ("race", {"TORCH_LN_RACECHECK": "0"})]
)
def test_race_check_quiet(checks, check, env):
    # A barrier between the write and the read orders them; without TORCH_LN_RACECHECK nothing is checked.
    result = _run(checks, check, **env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["no", "race"]


# Two clusters of 4 blocks, 5 rounds; each block's thread 33 adds its cluster's sum of 1000 * round + 10 * block + rank
# every round: per block 4000 * (0 + 1 + ... + 4) + 5 * (10 * (sum of its cluster's block indices) + 0 + 1 + 2 + 3).
EXCHANGE_TOTAL = 4 * (40000 + 5 * (10 * (0 + 1 + 2 + 3) + 6)) + 4 * (40000 + 5 * (10 * (4 + 5 + 6 + 7) + 6))
# Three blocks, each adding the chunks 1..24 of the global array once (by its thread 33).
BULK_TOTAL = 3 * (24 * 25 // 2)


@pytest.mark.parametrize("racecheck", ["0", "1"])
@pytest.mark.parametrize(
    "check,total",
    [
        # st.async stores into every peer completing on its mbarrier, waits by phase parity, two halves alternating.
        ("exchange", EXCHANGE_TOTAL),
        # Bulk copies into a ring of two stages, each completing on its stage's mbarrier; a block barrier frees a stage.
        ("bulk", BULK_TOTAL),
        # The same, a stage freed by every thread's arrival on its second mbarrier, which thread 0 waits for (the
        # race check orders each arriving thread's reads before the refill).
        ("bulk_empty", BULK_TOTAL),
    ],
)
def test_mbarrier_protocols(checks, check, total, racecheck):
    # The values arrive, and the race check finds the orderings through the mbarrier phases (no cluster barrier per
    # round).
    result = _run(checks, check, TORCH_LN_RACECHECK=racecheck)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["total", str(total)]


@pytest.mark.parametrize(
    "check,message",
    [
        # st.async's bytes count as unwritten until the reader has waited for the phase they complete.
        ("exchange_early_read", "read after write"),
        # One half reused every round: a peer's next store may land before this block's slow threads read the last.
        ("exchange_one_slot", "write after read"),
        # A bulk copy's bytes, the same.
        ("bulk_early_read", "read after write"),
        # An arrival on the stage's second mbarrier releases the reads before it only: reads after it race the refill.
        ("bulk_empty_early", "write after read"),
    ],
)
def test_mbarrier_race_check(checks, check, message):
    result = _run(checks, check, TORCH_LN_RACECHECK="1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "shared-memory race" in result.stderr and message in result.stderr, result.stderr


@pytest.mark.parametrize(
    "check,message",
    [
        # Stores into a peer's mbarrier before the cluster barrier that follows its init.
        ("exchange_unsynced_init", "an mbarrier used before mbarrier_init"),
        # A phase expecting a byte that never lands: on a GPU the wait would hang.
        ("exchange_short", "deadlock"),
        # Thread 0 refills stages before the others read them: their parity waits see a later phase, and a wait that
        # would hang a GPU ends the run as a deadlock, naming the race before it.
        ("bulk_no_release", "mbarrier phase 0 overtaken"),
        ("bulk_misaligned", "bulk_load_shared: addresses and size must be non-zero multiples of 16 bytes"),
    ],
)
def test_mbarrier_misuse_fails_with_a_message(checks, check, message):
    result = _run(checks, check, TORCH_LN_RACECHECK="1")
    assert result.returncode != 0 and message in result.stderr, result.stderr


# Three blocks; thread 33 of each adds its two values of chunks 0..4: (i * 64 + 33) * 2 + 1 and + 2 of chunk i.
COPY_TOTAL = 3 * sum((i * 64 + 33) * 4 + 3 for i in range(5))


@pytest.mark.parametrize("racecheck", ["0", "1"])
def test_copy_async_ring(checks, racecheck):
    # Each thread's own slots, refilled a chunk ahead: its wait orders its reads, no barrier needed.
    result = _run(checks, "copy", TORCH_LN_RACECHECK=racecheck)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["total", str(COPY_TOTAL)]


@pytest.mark.parametrize(
    "check,message,racecheck",
    [
        # A copy's bytes are off limits, to its issuer too, until its wait covers their group.
        ("copy_early_read", "read before the wait for a cp.async", "1"),
        # Another thread's slot: its copies are ordered for it alone (a barrier after its wait would order them).
        ("copy_neighbour", "shared-memory race", "1"),
        # On a GPU the copy would land in shared memory after the block ended, maybe in the next block's.
        ("copy_unwaited", "ended its block with cp.async copies it never waited for", "0"),
        ("copy_misaligned", "copy_async: 4, 8 or 16 bytes at addresses aligned to them", "0"),
    ],
)
def test_copy_async_misuse(checks, check, message, racecheck):
    result = _run(checks, check, TORCH_LN_RACECHECK=racecheck)
    assert result.returncode != 0 and message in result.stderr, result.stderr
