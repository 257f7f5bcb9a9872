"""Kill tests: a writer subprocess SIGKILLed at random moments, then recovery.

tests/crash_writer.py sends continuously from several producer threads (small
chunks, so message and queue chunks roll over every few sends) and reports each
acknowledged send on stdout; it is SIGKILLed at a random moment (during
startup and recovery, right after it got ready, after a random number of
acknowledgements, or after a random delay), once or several times on one
store, each run resuming after the previous one's recovery. The store is then
reopened and checked by tests/crash_checks.py (see its docstring). A SIGKILL
keeps the OS page cache, so under every policy every acknowledged send must
survive, byte-identical; the power-loss tests cover what "sync" adds.

Each case is reproducible as to its plan (not its timing) with
``python tools/crash_test.py --policy P --seed S --iterations 1``, which also runs
hundreds of iterations. EQUEUE_CRASH_SEED shifts the seeds CI uses.

With retention (tests/retention_checks.py): the writer keeps a few log chunks and
applies retention every few milliseconds; after each kill the store is checked for a
queue offset that went back or an acknowledged, retained message missing or changed.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from crash_checks import (
    Expectation,
    KillPlan,
    run_kill_iteration,
    run_writer,
    verify_recovered_store,
)
from crash_writer import POLICIES, PRODUCERS, store_config
from retention_checks import run_retention_iteration

from equeue.format.chunk import HEADER_SIZE, MIN_CHUNK_DATA_SIZE

ITERATIONS_PER_POLICY = 8
RETENTION_KILLS = 4  # per policy: 12 in make test
SEED_BASE = int(os.environ.get("EQUEUE_CRASH_SEED", "0"))


@pytest.mark.parametrize("seed", range(SEED_BASE, SEED_BASE + ITERATIONS_PER_POLICY))
@pytest.mark.parametrize("policy", POLICIES)
def test_sigkill_loses_nothing_acknowledged(tmp_path: Path, policy: str, seed: int) -> None:
    result = run_kill_iteration(tmp_path, policy, seed)
    assert not result.problems, result.describe()


def test_kill_check_fails_when_acknowledged_sends_are_lost(tmp_path: Path) -> None:
    """The checker is not vacuous: zero the log from an acknowledged send on, as if it
    had never been written, and the check reports acknowledged messages lost."""
    store = tmp_path / "store"
    run = run_writer(store, "sync", 1, KillPlan("acks", acks=300))
    assert run.returncode == -signal.SIGKILL and len(run.acks) >= 300, run.stderr
    exp = Expectation()
    for ack in run.acks:
        exp.acknowledge(ack, durable=True)
    victim = max(run.acks, key=lambda a: a.position)
    number = victim.position // MIN_CHUNK_DATA_SIZE
    for later in (store / "messages").glob("chunk-*"):
        if int(later.name[6:18]) > number:
            later.unlink()
    chunk = store / "messages" / f"chunk-{number:012d}.0000"
    data = bytearray(chunk.read_bytes())
    start = HEADER_SIZE + victim.position % MIN_CHUNK_DATA_SIZE
    data[start:] = bytes(len(data) - start)  # the records from the victim on, and any footer
    chunk.write_bytes(bytes(data))
    verdict = verify_recovered_store(store, store_config("sync"), exp)
    lost = [p for p in verdict.problems if "acknowledged messages lost" in p]
    assert lost and f"producer {victim.producer} " in " ".join(lost), verdict.problems
    assert len(lost) <= len(PRODUCERS)


@pytest.mark.parametrize("policy", POLICIES)
def test_sigkill_with_retention_never_moves_an_offset_back(tmp_path: Path, policy: str) -> None:
    """The retention kill loop (tests/retention_checks.py), reduced: 4 kills a policy."""
    result = run_retention_iteration(tmp_path, policy, SEED_BASE, RETENTION_KILLS)
    assert not result.problems, result.describe()
    assert result.kills == RETENTION_KILLS and result.history.stats["losses"] == 0
