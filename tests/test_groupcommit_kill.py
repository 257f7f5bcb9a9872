"""A real ``equeue serve --flush sync`` with the group-commit wait at its largest
(``--group-commit-wait-us 100000``, so a kill or a SIGTERM most likely finds the flusher
waiting) and several producer processes, each with one send in flight (the case the wait
is for): after a SIGKILL every acknowledged send is in the store; a SIGTERM drains (drain
cuts the wait short) and keeps every acknowledged send. test_server_kill.py runs the same
at the default wait and says what a SIGKILL does and does not show."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from server_helpers import short_home
from test_server_kill import run_until

home = pytest.fixture(short_home, name="home")

LONGEST_WAIT = ("--group-commit-wait-us", "100000")
ONE_IN_FLIGHT = ("--window", "1")


def test_sigkill_during_waits_loses_no_acknowledged_send(home: Path) -> None:
    run_until(home, signal.SIGKILL, "sync", LONGEST_WAIT, ONE_IN_FLIGHT)


def test_sigterm_during_waits_drains_every_answer(home: Path) -> None:
    run_until(home, signal.SIGTERM, "sync", LONGEST_WAIT, ONE_IN_FLIGHT)
