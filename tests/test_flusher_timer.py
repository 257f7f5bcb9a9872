"""The C flusher's wait bound (equeue/cext/flusher.c arm/expired, a timerfd): re-arming or
disarming drops an expiry the loop has not read yet, with no read of the timer first
(timerfd_settime zeroes the count: one system call a flush less); a bound armed again
expires again. Real timerfd, polled with select; every wait bounded."""

from __future__ import annotations

import select
import sys

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
