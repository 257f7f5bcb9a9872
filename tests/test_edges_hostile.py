"""A hostile or missing file in a store the broker serves: before it starts (it refuses
to start with an equeue error naming the file, or starts and reports the file in its
recovery problems), and while it serves (a chunk file cut short, emptied or deleted by
hand under it: pulls of those messages fail with an equeue error naming the file, the
rest is served, the broker goes on). Then a read-only store in this process beside a
live broker process: every message it sees is intact and in order. Controls: the
undamaged store."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from client_helpers import BrokerProcess
from server_helpers import short_dir

import equeue
from equeue import MessageStore, StoreConfig
from equeue.errors import (
    ChunkReplacedError,
    EQueueError,
    MissingChunkError,
    StorePathError,
    TruncatedError,
)
from equeue.inspect.verify import verify_store
from equeue.server import BrokerThread

CONFIG = StoreConfig(
    chunk_data_size=4096, queue_chunk_records=342, default_queue_count=1, max_open_chunks=4
)
COUNT = 800  # 35 log chunks, 3 queue chunks


def body(i: int) -> bytes:
    return b"m%04d" % i + b"x" * 100


@pytest.fixture(scope="module")
def pristine() -> Iterator[Path]:
    directory = short_dir()
    try:
        with MessageStore.open(directory / "s", CONFIG) as created:
            created.create_topic("t", 1)
            created.send_batch("t", [body(i) for i in range(COUNT)])
        yield directory / "s"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def store(pristine: Path) -> Iterator[Path]:
    """A copy of the pristine store (closed cleanly) for one test to damage."""
    directory = short_dir()
    try:
        shutil.copytree(pristine, directory / "s", symlinks=True)
        yield directory / "s"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _log(store: Path, n: int) -> Path:
    return sorted((store / "messages").glob("chunk-*"))[n]


def _queue(store: Path, n: int) -> Path:
    return sorted((store / "queues" / "t" / "0").glob("chunk-*"))[n]


def _symlink(path: Path) -> None:
    target = path.parent.parent.parent / f"outside-{path.name}"
    shutil.copy(path, target)
    path.unlink()
    path.symlink_to(target)


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _dir(path: Path) -> None:
    path.unlink()
    path.mkdir()


# name -> (damage, the error the start raises, the file it names)
REFUSED: dict[str, tuple[Callable[[Path], Path], type[EQueueError]]] = {
    "symlink chunk": (lambda s: _log(s, 2), StorePathError),
    "symlink last chunk": (lambda s: _log(s, -1), StorePathError),
    "symlink topics.json": (lambda s: s / "topics.json", StorePathError),
    "symlink queue chunk": (lambda s: _queue(s, -1), StorePathError),
    "fifo chunk": (lambda s: _log(s, 2), StorePathError),
    "fifo topics.json": (lambda s: s / "topics.json", StorePathError),
    "directory chunk": (lambda s: _log(s, 2), StorePathError),
    "truncated footer": (lambda s: _log(s, 2), TruncatedError),
    "zero-length chunk": (lambda s: _log(s, 2), TruncatedError),
    "zero-length last chunk": (lambda s: _log(s, -1), TruncatedError),
    "missing chunk": (lambda s: _log(s, 3), MissingChunkError),
}


def _damage(name: str, path: Path) -> None:
    if name.startswith("symlink"):
        _symlink(path)
    elif name.startswith("fifo"):
        _fifo(path)
    elif name.startswith("directory"):
        _dir(path)
    elif name == "truncated footer":
        os.truncate(path, path.stat().st_size - 10)
    elif name.startswith("zero-length"):
        os.truncate(path, 0)
    elif name.startswith("missing"):
        path.unlink()


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_hostile_file_refuses_the_start_naming_it(store: Path, name: str) -> None:
    where, error = REFUSED[name]
    path = where(store)
    _damage(name, path)
    with pytest.raises(error) as raised:
        BrokerThread(store).start().stop()
    named = path if name != "missing chunk" else _log(store, 2)  # (names its neighbours)
    assert named.name in str(raised.value), raised.value


def _pull_all(url: str) -> tuple[list[bytes], list[EQueueError]]:
    """Every message of t/0 from offset 0, message by message past a failing one."""
    bodies: list[bytes] = []
    errors: list[EQueueError] = []
    with equeue.connect(url, timeout=10) as client:
        offset, end = client.queue_range("t", 0)
        for _ in range(2 * COUNT):  # (bounded)
            if offset >= end:
                break
            try:
                result = client.pull("t", 0, offset, 50)
            except EQueueError as exc:
                errors.append(exc)
                offset += 1
                continue
            bodies += [m.body for m in result.messages]
            offset = max(result.next_offset, offset + 1)
        client.send("t", b"served on")  # the broker goes on
    return bodies, errors


@pytest.mark.parametrize(
    "name", ["control", "missing queue chunk", "missing last queue chunk", "fifo consumers"]
)
def test_a_damaged_file_the_start_repairs_is_served_and_reported(store: Path, name: str) -> None:
    if name == "fifo consumers":
        path = store / "consumers" / "g.json"
        path.parent.mkdir(exist_ok=True)
        os.mkfifo(path)
    elif name != "control":
        path = _queue(store, 1 if name == "missing queue chunk" else -1)
        path.unlink()
    broker = BrokerThread(store).start()
    try:
        problems = [str(p) for p in broker.store.recovery.problems]
        bodies, errors = _pull_all(broker.urls[0])
    finally:
        broker.stop()
    assert not errors
    assert bodies == [body(i) for i in range(COUNT)]
    if name == "control":
        assert problems == []
    else:
        where = path.parent.relative_to(store.parent).as_posix()  # (the queue's directory)
        assert problems and where in problems[0], problems
    assert verify_store(store) == []


SERVED: dict[str, type[EQueueError]] = {
    "truncated": TruncatedError,
    "zero-length": TruncatedError,
    "deleted": MissingChunkError,
    "queue": TruncatedError,
    # Another chunk's bytes: said before as CorruptRecordError (its records' positions);
    # round 20's stale checks the chunk id when a file is mapped again by name.
    "swapped": ChunkReplacedError,
    "fifo": StorePathError,
}


@pytest.mark.parametrize("name", ["control", *SERVED])
def test_a_file_damaged_while_served_fails_its_pulls_naming_it(store: Path, name: str) -> None:
    """Log chunk 2 (not mapped any more: max_open_chunks=4) cut to 2000 bytes, emptied,
    deleted, overwritten by chunk 5's bytes or replaced by a FIFO by hand under the
    broker, or queue chunk 0 cut short: the pulls of its messages fail with an equeue
    error naming it (before: a BrokerError carrying a ValueError or struct.error, or,
    deleted, its 29 messages skipped without a word; swapped and FIFO were said before
    too); every other message is served."""
    broker = BrokerThread(store).start()
    try:
        assert len(_pull_all(broker.urls[0])[0]) == COUNT  # maps every chunk once
        path = _queue(store, 0) if name == "queue" else _log(store, 2)
        if name in ("truncated", "queue"):
            os.truncate(path, 2000)
        elif name == "zero-length":
            os.truncate(path, 0)
        elif name == "deleted":
            path.unlink()
        elif name == "swapped":
            shutil.copy(_log(store, 5), path)
        elif name == "fifo":
            _fifo(path)
        bodies, errors = _pull_all(broker.urls[0])
    finally:
        broker.stop()
    if name == "control":
        assert not errors and len(bodies) == COUNT + 1
        return
    assert errors
    for error in errors:
        assert type(error) is SERVED[name], repr(error)
        assert path.relative_to(store).as_posix() in str(error), error
    lost = 342 if name == "queue" else len(errors)
    assert len(bodies) == COUNT + 1 - lost  # (the earlier pull's "served on" too)


def test_a_read_only_view_beside_a_live_broker_sees_intact_messages() -> None:
    """A broker process, a producer thread sending through it; three read-only opens in
    this process meanwhile: each sees at least what was acknowledged before it opened,
    and every message it sees reads back whole and in order."""
    directory = short_dir()
    try:
        with MessageStore.open(directory / "s", CONFIG) as created:
            created.create_topic("t", 1)
        with BrokerProcess(directory / "s", "--flush", "sync") as broker:
            acked: list[int] = []
            stop = threading.Event()

            def produce() -> None:
                with equeue.connect(broker.url) as client:
                    for i in range(5000):
                        if stop.is_set():
                            return
                        acked.append(client.send("t", body(i)).queue_offset)

            thread = threading.Thread(target=produce, daemon=True)
            thread.start()
            least = 0
            try:
                for _ in range(3):
                    for _ in range(100):  # (bounded: 5 s) some sent since the last look
                        if len(acked) > least + 20:
                            break
                        stop.wait(0.05)
                    least = len(acked)
                    with MessageStore.open(directory / "s", read_only=True) as view:
                        first, end = view.queue_range("t", 0)
                        assert (first, end >= least) == (0, True), (first, end, least)
                        got = view.pull("t", 0, 0, end).messages if end else []
                    assert [m.body for m in got] == [body(i) for i in range(end)]
            finally:
                stop.set()
                thread.join(30)
            assert acked == list(range(len(acked))) and acked
    finally:
        shutil.rmtree(directory, ignore_errors=True)
