"""A failed fdatasync under a group commit (the store's flush="sync", the broker's
--flush sync) refuses every later send before anything is written, as a failed
background flush does: no send is stored, delivered, and then answered "may be lost"."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import equeue
from equeue import MessageStore, StoreConfig
from equeue.errors import DiskFullError, StoreWriteError
from equeue.server import BrokerThread

REFUSED = r"refusing the send.*close and reopen the store"
SMALL = {"chunk_data_size": 64 * 1024, "queue_chunk_records": 1024}


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="eq", dir="/tmp"))  # a socket path must be short
    yield path
    shutil.rmtree(path, ignore_errors=True)


class Failing:
    """os.fdatasync that fails with ``code`` on ``thread`` once armed; counts the calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, code: int, thread: str | None) -> None:
        self.real = os.fdatasync
        self.code, self.thread, self.armed, self.calls = code, thread, False, 0
        monkeypatch.setattr(os, "fdatasync", self)

    def __call__(self, fd: int) -> None:
        mine = self.thread is None or threading.current_thread().name == self.thread
        if self.armed and mine:
            self.calls += 1
            raise OSError(self.code, os.strerror(self.code) + " (injected)")
        self.real(fd)


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
def test_store_group_commit_failure_refuses_later_sends_with_nothing_written(
    base: Path, monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    config = StoreConfig(flush="sync", **SMALL)  # type: ignore[arg-type]
    store = MessageStore.open(base / "s", config)
    fails = Failing(monkeypatch, code, None)
    first = store.send("t", b"one", queue_id=0)
    fails.armed = True
    kind = DiskFullError if code == errno.ENOSPC else StoreWriteError
    with pytest.raises(kind, match=r"may be lost.*refused until the store is reopened"):
        store.send("t", b"two", queue_id=0)
    assert fails.calls == 1
    end = store.queue_range("t", 0)
    fails.armed = False  # the device works again: the chunk's failure stays, so must the refusal
    for send in (
        lambda: store.send("t", b"three", queue_id=0),
        lambda: store.send_batch("t", [b"four", b"five"]),
    ):
        with pytest.raises(kind, match=REFUSED) as info:
            send()
        assert info.value.errno == code
    assert store.queue_range("t", 0) == end  # nothing written by the refused sends
    assert fails.calls == 1  # and no fdatasync tried for them
    with pytest.raises(StoreWriteError):
        store.close()
    with MessageStore.open(base / "s", config) as store:
        bodies = [m.body for m in store.pull("t", 0, 0, max_count=10).messages]
        assert bodies[0] == b"one" and set(bodies[1:]) <= {b"two"}  # "two": written, unflushed
        assert store.read(first.position).body == b"one"
        store.send("t", b"after the reopen", queue_id=0)  # sending resumes


def test_broker_flush_failure_refuses_later_sends_with_nothing_written(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fails = Failing(monkeypatch, errno.EIO, "equeue-broker-flush")
    with (
        BrokerThread(base / "s", flush="sync", listen=[f"unix:{base}/b.sock"]) as broker,
        equeue.connect(broker.urls[0]) as client,
    ):
        client.create_topic("t", 1)
        assert client.send("t", b"one").queue_offset == 0
        fails.armed = True
        with pytest.raises(StoreWriteError, match=r"may be lost.*refused until the store is reop"):
            client.send("t", b"two")
        assert fails.calls == 1
        end = client.queue_range("t", 0)
        fails.armed = False
        for body in (b"three", b"four"):
            with pytest.raises(StoreWriteError, match=REFUSED):
                client.send("t", body)
        with pytest.raises(StoreWriteError, match="refusing the send"):
            client.send_batch("t", [b"five", b"six"])
        assert client.queue_range("t", 0) == end  # nothing stored, nothing to deliver
        bodies = [m.body for m in client.pull("t", 0, 0, max_count=10).messages]
        assert bodies[0] == b"one" and set(bodies[1:]) <= {b"two"}
        assert fails.calls == 1
    with MessageStore.open(base / "s", StoreConfig(flush="sync")) as store:  # reopened
        bodies = [m.body for m in store.pull("t", 0, 0, max_count=10).messages]
        assert bodies[0] == b"one" and set(bodies[1:]) <= {b"two"}
        store.send("t", b"after the reopen", queue_id=0)
