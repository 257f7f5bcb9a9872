"""A broker whose start fails after its flusher thread started (--flush sync) stops that
thread: a long-lived process that retries BrokerThread.start() does not collect them."""

from __future__ import annotations

import contextlib
import importlib
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from equeue.server import BrokerThread
from equeue.store.store import MessageStore

# The module: equeue.server.serve is the function of that name.
serve = importlib.import_module("equeue.server.serve")


class Refused(Exception):
    pass


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="eq", dir="/tmp"))  # a socket path must be short
    yield path
    shutil.rmtree(path, ignore_errors=True)


def flushers() -> set[int]:
    """The OS thread ids of the broker's flusher threads: the Python one (ThreadSync), or
    the C one (equeue/cext/flusher.c, named equeue-flush at the OS level). Ids, not a
    count: a C flusher another test left to the garbage collector may end meanwhile."""
    found = {
        t.native_id
        for t in threading.enumerate()
        if t.name == "equeue-broker-flush" and t.native_id is not None
    }
    for comm in Path("/proc/self/task").glob("*/comm"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            if comm.read_text().strip() == "equeue-flush":
                found.add(int(comm.parent.name))
    return found


@pytest.mark.parametrize("failing", ["GroupCoordinator", "OffsetCommitter", "Handlers"])
def test_a_failed_start_stops_the_flusher_thread(
    base: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise Refused(f"{failing} failed (the test's)")

    monkeypatch.setattr(serve, failing, refuse)
    before = flushers()
    for attempt in range(3):
        broker = BrokerThread(base / "s", flush="sync", listen=[f"unix:{base}/b{attempt}.sock"])
        with pytest.raises(Refused):
            broker.start()
        broker._thread.join(10)
        assert not broker._thread.is_alive()
        assert broker.store._closed  # the failed start closed the store ...
    assert flushers() <= before  # ... and stopped each flusher thread it started
    monkeypatch.undo()
    with BrokerThread(base / "s", flush="sync", listen=[f"unix:{base}/ok.sock"]) as broker:
        assert len(flushers() - before) == 1  # control: a started broker has one
        assert isinstance(broker.store, MessageStore)
    assert flushers() <= before
