"""A real ``equeue serve --flush sync`` with the group-commit wait's setting at its largest
(``--group-commit-wait-us 100000``) and several producer processes, each with one send in
flight (the case the wait is for). The wait is still at most twice the last fdatasync (the
smaller of the setting and that), a few ms on this machine's disk, so a signal need not
find the flusher waiting; the broker's stats show that waits happened before it (at least
one). After a SIGKILL every acknowledged send is in the store; a SIGTERM drains (drain cuts
a wait short) and keeps every acknowledged send. test_server_kill.py runs the same at the
default wait and says what a SIGKILL does and does not show; the drain's shortcut itself
is test_groupcommit_wait.py's test_drain_flushes_what_waits_without_finishing_the_wait."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
from server_helpers import short_home
from test_server_kill import run_until

home = pytest.fixture(short_home, name="home")

LONGEST_WAIT = ("--group-commit-wait-us", "100000")
ONE_IN_FLIGHT = ("--window", "1")


def waited(stats: dict[str, Any]) -> bool:
    return bool(stats["group_commit_waits"] > 0)


def test_sigkill_during_waits_loses_no_acknowledged_send(home: Path) -> None:
    run_until(home, signal.SIGKILL, "sync", LONGEST_WAIT, ONE_IN_FLIGHT, waited)


def test_sigterm_during_waits_drains_every_answer(home: Path) -> None:
    run_until(home, signal.SIGTERM, "sync", LONGEST_WAIT, ONE_IN_FLIGHT, waited)


def test_sigkill_with_overlapping_cohorts_loses_no_acknowledged_send(home: Path) -> None:
    """``--group-commit-overlap 1`` (the flag reaches the broker and cohorts overlapped:
    the stats count them) and a SIGKILL."""
    overlap = ("--group-commit-overlap", "1")
    run_until(home, signal.SIGKILL, "sync", overlap, ONE_IN_FLIGHT, overlapped)


def overlapped(stats: dict[str, Any]) -> bool:
    return bool(stats["group_commit_overlapped"] > 0)
