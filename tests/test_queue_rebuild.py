"""Queue chunks are derived data: a writable open rebuilds a damaged queue from the log.

Each case damages the first (completed) queue chunk of a queue, with or without
retention having removed the log's start, and checks that a writable open moves the
queue's chunks to its recovered/, rebuilds it at the original offsets, keeps its next
offset, reports the rebuild, and that verify is clean afterwards."""

from __future__ import annotations

import datetime as dt
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from store_helpers import Sent, pull_all, send

from equeue import MessageStore, StoreConfig
from equeue.cli import main
from equeue.errors import CorruptionError, CorruptRecordError
from equeue.format.chunk import FRAME_SUFFIX, HEADER_SIZE
from equeue.format.message import QUEUE_RECORD, QUEUE_RECORD_SIZE
from equeue.store.meta import MESSAGES_DIR, QUEUES_DIR

CONFIG = StoreConfig(
    chunk_data_size=4096, queue_chunk_records=342, flush="os", retention=dt.timedelta(hours=1)
)


def _build(path: Path, retention: bool) -> list[Sent]:
    sent: list[Sent] = []
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("u", 1)
        sent += [send(store, "u", b"m%d" % i) for i in range(200)]
        if retention:  # every completed log chunk so far is past retention
            assert store.apply_retention(now=time.time() + 7200) > 0
        sent += [send(store, "u", b"n%d" % i) for i in range(200)]
    return sent


def _first_chunk(path: Path) -> Path:
    return sorted((path / QUEUES_DIR / "u" / "0").glob("chunk-*"))[0]


def _delete(chunk: Path) -> None:
    chunk.unlink()


def _truncate(chunk: Path) -> None:
    os.truncate(chunk, chunk.stat().st_size - 100)


def _zero_header(chunk: Path) -> None:
    with open(chunk, "r+b") as f:
        f.write(bytes(HEADER_SIZE))


def _wrong_entry(chunk: Path) -> None:
    """The chunk's last entry (offset 341) takes the entry of offset 340: another record."""
    with open(chunk, "r+b") as f:
        f.seek(HEADER_SIZE + 340 * QUEUE_RECORD_SIZE)
        stored, tag = QUEUE_RECORD.unpack(f.read(QUEUE_RECORD_SIZE))
        f.write(QUEUE_RECORD.pack(stored, tag))


DAMAGES: dict[str, Callable[[Path], None]] = {
    "deleted": _delete,
    "truncated": _truncate,
    "zeroed header": _zero_header,
    "wrong entry": _wrong_entry,
}


@pytest.mark.parametrize("retention", [False, True], ids=["log from 0", "after retention"])
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_queue_chunk_is_rebuilt_from_the_log(
    tmp_path: Path, damage: str, retention: bool
) -> None:
    path = tmp_path / "store"
    sent = _build(path, retention)
    chunk = _first_chunk(path)
    DAMAGES[damage](chunk)
    with MessageStore.open(path, CONFIG) as store:
        log_first = store._messages.first_position
        assert (log_first > 0) == retention
        retained = [s for s in sent if s.position >= log_first]
        assert store.queue_range("u", 0) == (retained[0].offset, 400)
        pulled = pull_all(store)[("u", 0)]
        assert [(m.queue_offset, m.body) for m in pulled] == [(s.offset, s.body) for s in retained]
        rebuilt = [p for p in store.recovery.problems if "was rebuilt from the message log" in p]
        assert rebuilt and "offsets [" in rebuilt[0] and ", 400)" in rebuilt[0]
        assert any("is damaged" in p and "recovered" in p for p in store.recovery.problems)
        assert send(store, "u", b"next").offset == 400  # the next offset did not move back
    side = list((chunk.parent / "recovered").glob("chunk-*.damaged"))
    if damage != "deleted":
        assert any(p.name.startswith(chunk.name) for p in side)
    assert side
    assert main(["verify", str(path)]) == 0
    with MessageStore.open(path, CONFIG) as store:  # the rebuild is done once
        assert store.recovery.clean
        assert store.queue_range("u", 0) == (retained[0].offset, 401)


@pytest.mark.parametrize("damage", ["truncated", "zeroed header"])
def test_read_only_open_names_the_damaged_queue_chunk(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "store"
    _build(path, retention=False)
    chunk = _first_chunk(path)
    DAMAGES[damage](chunk)
    with pytest.raises(CorruptionError) as caught:
        MessageStore.open(path, CONFIG, read_only=True)
    assert str(chunk) in str(caught.value) and "a writable open" in str(caught.value)
    assert chunk.exists() and not (chunk.parent / "recovered").exists()  # nothing changed


@pytest.mark.parametrize("retention", [False, True], ids=["log from 0", "after retention"])
def test_undamaged_queue_is_not_rebuilt(tmp_path: Path, retention: bool) -> None:
    path = tmp_path / "store"
    _build(path, retention)
    with MessageStore.open(path, CONFIG) as store:
        assert not any("rebuilt" in p or "damaged" in p for p in store.recovery.problems)
        assert store.recovery.redispatched == 0
        assert store.queue_range("u", 0)[1] == 400
    assert not (path / QUEUES_DIR / "u" / "0" / "recovered").exists()


def test_damaged_message_record_does_not_rebuild_its_queue(tmp_path: Path) -> None:
    """A bit flipped in the body of the message a queue chunk's first entry points at is
    no evidence against the entry: the queue stays, that message alone is unreadable."""
    path = tmp_path / "store"
    sent = _build(path, retention=False)
    first = sent[0]
    number, local = divmod(first.position, CONFIG.layout.chunk_data_size)
    chunk = next((path / MESSAGES_DIR).glob(f"chunk-{number:012d}.*"))
    at = HEADER_SIZE + local + first.frame_size - FRAME_SUFFIX.size - 1  # the body's last byte
    with open(chunk, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 1]))
    with MessageStore.open(path, CONFIG) as store:
        assert not any("rebuilt" in p or "damaged" in p for p in store.recovery.problems)
        assert store.queue_range("u", 0) == (0, 400)
        with pytest.raises(CorruptRecordError):
            store.pull("u", 0, 0, max_count=1)
        assert store.pull("u", 0, 1, max_count=1).messages[0].body == sent[1].body
    assert not (path / QUEUES_DIR / "u" / "0" / "recovered").exists()


def test_rebuilt_queue_whose_messages_retention_removed_keeps_its_next_offset(
    tmp_path: Path,
) -> None:
    """The log holds none of the queue's messages: the rebuilt queue is empty and starts
    at the checkpoint's next offset, so the next send does not reuse an offset."""
    path = tmp_path / "store"
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("v", 1)
        store.create_topic("u", 1)
        for i in range(10):
            send(store, "v", b"v%d" % i)
        for i in range(200):
            send(store, "u", b"m%d" % i)
        assert store.apply_retention(now=time.time() + 7200) > 0
        assert store.queue_range("v", 0) == (10, 10)
    chunk = sorted((path / QUEUES_DIR / "v" / "0").glob("chunk-*"))[0]
    _zero_header(chunk)
    with MessageStore.open(path, CONFIG) as store:
        assert store.queue_range("v", 0) == (10, 10)
        assert any("v/0" in p and "was rebuilt" in p for p in store.recovery.problems)
        assert send(store, "v", b"next").offset == 10
    assert list((chunk.parent / "recovered").glob(f"{chunk.name}.*.damaged"))
    assert main(["verify", str(path)]) == 0
