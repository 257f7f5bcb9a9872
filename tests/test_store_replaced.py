"""A store directory removed and made again, or moved, under a running broker (review 37a
L2): the broker stops within about a second, logging StoreReplacedError with what it
opened and what it found, and writes nothing into the new store (before: its checkpoint
at stop made the new store report 238,000 bytes of records lost). The control: the same
run without the change reports nothing and the broker stops cleanly at SIGTERM."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from client_helpers import BrokerProcess
from server_helpers import short_home
from store_helpers import settle_chunk_maker, snapshot

import equeue
from equeue import MessageStore, StoreConfig, StoreReplacedError

home = pytest.fixture(short_home, name="home")

SENDS = 2000


def _ids(path: Path) -> str:
    st = os.stat(path)
    return f"device {st.st_dev} inode {st.st_ino}"


def _verify(store: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "equeue", "verify", str(store)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize("change", ["none", "removed", "moved"])
def test_a_broker_writes_nothing_into_a_store_made_again_under_it(home: Path, change: str) -> None:
    store = home / "s"
    old = BrokerProcess(store)
    new: BrokerProcess | None = None
    try:
        with equeue.connect(old.url) as client:
            client.create_topic("t", 1)
            for number in range(SENDS):
                client.send("t", b"%d" % number + b"x" * 50)
        opened = (_ids(store), _ids(store / "LOCK"))
        if change == "removed":
            shutil.rmtree(store)
        elif change == "moved":
            store.rename(home / "moved")
        if change != "none":
            new = BrokerProcess(store)  # the new store, with its own broker
            with equeue.connect(new.url) as client:
                client.create_topic("t", 1)
                client.send("t", b"fresh")
            found = (_ids(store), _ids(store / "LOCK"))
            deadline = time.monotonic() + 30
            while old.process is not None and old.process.poll() is None:
                assert time.monotonic() < deadline, "the old broker did not stop by itself"
                time.sleep(0.1)
            assert old.process is not None and old.process.returncode == 1
            assert new.process is not None and new.process.poll() is None  # untouched
            assert (store / "keys.sqlite-wal").exists()  # the new broker's, still there
        old.stop()
        if new is not None:
            new.stop()
    finally:
        old.stop()
        if new is not None:
            new.stop()
    log = (home / "broker.log").read_text()
    result = _verify(store)
    assert result.returncode == 0, result.stdout + result.stderr
    with MessageStore.open(store, read_only=True) as reopened:
        assert reopened.recovery.problems == []
        count = 1 if change != "none" else SENDS
        assert reopened.queue_range("t", 0) == (0, count)
    if change == "none":
        assert old.process is not None and old.process.returncode == 0
        assert "StoreReplacedError" not in log and "no longer the one" not in log, log
        return
    assert f"expected {store} ({opened[0]}) with {store / 'LOCK'} ({opened[1]})" in log, log
    # Found: the new store, or nothing when the broker looked between the removal (or the
    # move) and the new broker's start.
    new_store = f"found {store} ({found[0]}) with {store / 'LOCK'} ({found[1]})"
    assert new_store in log or f"found {store} (nothing) with {store / 'LOCK'} (nothing)" in log
    assert "the broker stops" in log, log
    if change == "moved":  # the store moved keeps what the broker had acknowledged
        with MessageStore.open(home / "moved", read_only=True) as moved:
            assert moved.queue_range("t", 0) == (0, SENDS)


def test_the_embedded_writer_refuses_sends_and_writes_no_checkpoint(tmp_path: Path) -> None:
    store = tmp_path / "s"
    handle = MessageStore.open(store, StoreConfig(flush="async"))
    try:
        handle.create_topic("t", 1)
        handle.send("t", b"before")
        opened = tuple((st.st_dev, st.st_ino) for st in (os.stat(store), os.stat(store / "LOCK")))
        # The log's next file, made ahead after the open, made before the store goes: a
        # maker job running after the removal finds the store replaced first, and its
        # finding (what it saw then) is what the flush raises.
        settle_chunk_maker(handle)
        shutil.rmtree(store)
        with MessageStore.open(store) as other:  # a new store at the path
            other.create_topic("u", 1)
        checkpoint = (store / "checkpoint.json").read_bytes()
        topics = (store / "topics.json").read_bytes()
        with pytest.raises(StoreReplacedError, match="no longer the one this writer opened") as e:
            handle.flush()
        found = os.stat(store), os.stat(store / "LOCK")
        assert e.value.found == tuple((st.st_dev, st.st_ino) for st in found)
        assert e.value.expected == opened
        with pytest.raises(StoreReplacedError, match="refusing the send"):
            handle.send("t", b"after")
        with pytest.raises(StoreReplacedError):
            handle.commit_offset("g", "t", 0, 1)
        with pytest.raises(StoreReplacedError):
            handle.create_topic("v", 1)
    finally:
        with pytest.raises(StoreReplacedError):
            handle.close()
    assert (store / "checkpoint.json").read_bytes() == checkpoint
    assert (store / "topics.json").read_bytes() == topics
    assert not (store / "offsets.json").exists()
    with MessageStore.open(store, read_only=True) as reopened:
        assert reopened.recovery.problems == []
        assert reopened.topics() == ["u"]


@pytest.mark.parametrize("fills", ["log", "queue"])
def test_a_chunk_roll_creates_no_file_in_a_store_made_again_under_it(
    tmp_path: Path, fills: str
) -> None:
    # review3 R2: the guard ran at checkpoints and metadata writes only; a writer went on
    # rolling its log into the new store's messages/ (chunk files 2..11), which then no
    # longer opened (MissingChunkError)
    from equeue.format.chunk import MIN_CHUNK_DATA_SIZE

    store = tmp_path / "s"
    # "log": 4 KiB log chunks roll every ~4 sends; "queue": a 1 MiB log chunk holds every
    # send, and the queue's chunk of 342 entries (its least) rolls first
    small = StoreConfig(
        chunk_data_size=MIN_CHUNK_DATA_SIZE if fills == "log" else 1 << 20,
        queue_chunk_records=342,
        flush="os",
    )
    body = b"x" * (900 if fills == "log" else 1)
    handle = MessageStore.open(store, small)
    try:
        handle.create_topic("t", 1)
        for _ in range(8):
            handle.send("t", body)
        os.rename(store, tmp_path / "s.old")
        with MessageStore.open(store, small) as other:
            other.create_topic("t", 1)
            other.send("t", b"the new store's")
        before = snapshot(store)  # (the old handle's maker may be at work: settled)
        with pytest.raises(StoreReplacedError):
            for _ in range(400):
                handle.send("t", body)
        assert snapshot(store) == before
    finally:
        with pytest.raises(StoreReplacedError):
            handle.close()
    with MessageStore.open(store, read_only=True) as reopened:
        assert reopened.recovery.problems == []
        assert [m.body for m in reopened.pull("t", 0, 0, 10).messages] == [b"the new store's"]
