"""The C flusher's wait bound (equeue/cext/flusher.c arm/expired, a timerfd): re-arming or
disarming drops an expiry the loop has not read yet, with no read of the timer first
(timerfd_settime zeroes the count: one system call a flush less); a bound armed again
expires again. And its eventfd: written once a flush's outcome is in place. Real timerfd,
eventfd and fdatasync, polled with select; every wait bounded."""

from __future__ import annotations

import os
import select
import sys
import time
from pathlib import Path

import pytest

from equeue import speedups

pytestmark = pytest.mark.skipif(
    speedups.SPEEDUPS is None or not sys.platform.startswith("linux"),
    reason="the C flusher needs the accelerator on Linux",
)
LIMIT_S = 5.0


def _fires(fd: int) -> bool:
    return bool(select.select([fd], [], [], LIMIT_S)[0])


@pytest.mark.parametrize("then", ["rearm", "disarm"])
def test_an_unread_expiry_is_dropped_by_arming_again(then: str) -> None:
    from equeue._speedups import Flusher

    flusher = Flusher()
    try:
        flusher.arm(1)
        assert _fires(flusher.timer_fd)  # expired, not read
        flusher.arm(10_000_000 if then == "rearm" else 0)
        assert not select.select([flusher.timer_fd], [], [], 0.05)[0]
        assert not flusher.expired()
        flusher.arm(1)  # armed again, it expires again: the control
        assert _fires(flusher.timer_fd)
        assert flusher.expired()
        assert not flusher.expired()  # read once
    finally:
        flusher.close()


def test_once_the_eventfd_fires_the_flushs_outcome_is_there(tmp_path: Path) -> None:
    """The thread writes the eventfd with its lock let go (the loop, woken, takes the lock
    in collect() without waiting for it): the outcome must be in place before the write,
    so a collect() right after the eventfd fired never finds nothing. 2,000 real
    fdatasyncs of a file, each collected the moment select() sees the eventfd."""
    from equeue._speedups import Flusher

    flusher = Flusher()
    fd = os.open(tmp_path / "log", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for _ in range(2_000):
            os.write(fd, b"x" * 100)
            flusher.start(fd)
            assert _fires(flusher.event_fd)
            outcome = flusher.collect()
            assert outcome is not None
            error, took, ended = outcome
            assert error == 0 and 0 <= took < LIMIT_S and ended <= time.monotonic()
        assert flusher.collect() is None  # each outcome collected once
    finally:
        flusher.close()
        os.close(fd)
