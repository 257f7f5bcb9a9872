"""Review fixes of the cache of open queues (issue 25): a failed fdatasync of a closed
queue chunk sticks, a send re-entered on the thread holding the write lock is refused,
a queue closed during a checkpoint's flush is synced by it, the C-bound send keeps its
signature."""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from code_paths import code_path  # noqa: F401 - the fixture
from many_queues_child import body, low_config

from equeue import MessageStore, StoreConfig
from equeue.chunks import ChunkManager
from equeue.errors import ReentrantSendError, StoreWriteError
from equeue.inspect.verify import verify_store
from equeue.store.meta import CHECKPOINT_FILE


def _evict_many(store: MessageStore, rounds: int = 2) -> None:
    for r in range(rounds):
        for i in range(20):  # more queues than stay open: most are closed, unflushed
            store.send(f"t{i}", body(f"t{i}", 0, r), queue_id=0)


def test_a_failed_fdatasync_of_a_closed_queue_chunk_sticks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first closed chunk's fdatasync fails: that file and the ones after it stay
    listed, every later flush fails too, and no checkpoint is written after it (the code
    before dropped them all and the next flush wrote a checkpoint)."""
    store = MessageStore.open(tmp_path / "s", low_config(flush="os"))
    try:
        _evict_many(store)
        files = store._files
        listed = sorted(files._unsynced)
        assert len(listed) >= 3
        real = os.fdatasync
        seen: list[str] = []

        def failing(fd: int) -> None:
            name = os.readlink(f"/proc/self/fd/{fd}")
            if name == listed[0]:
                seen.append(name)
                raise OSError(5, "Input/output error")
            real(fd)

        checkpoint = tmp_path / "s" / CHECKPOINT_FILE
        before = checkpoint.read_bytes() if checkpoint.exists() else b""
        monkeypatch.setattr(os, "fdatasync", failing)
        with pytest.raises(StoreWriteError, match="flushing a closed queue chunk"):
            store.flush()
        monkeypatch.setattr(os, "fdatasync", real)
        assert seen == [listed[0]]
        assert sorted(files._unsynced) == listed  # none of them vouched for
        with pytest.raises(StoreWriteError, match="reopen the store"):
            store.flush()
        assert (checkpoint.read_bytes() if checkpoint.exists() else b"") == before
        assert sorted(files._unsynced) == listed
    finally:
        with contextlib.suppress(StoreWriteError):  # the close's flush fails as well
            store.close()
    with MessageStore.open(tmp_path / "s", low_config(flush="os")) as again:
        for i in range(20):
            got = [m.body for m in again.pull(f"t{i}", 0, 0, 10).messages]
            assert got == [body(f"t{i}", 0, r) for r in range(2)]


@pytest.mark.usefixtures("code_path")
def test_a_send_from_a_callback_inside_a_send_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A send and a send_batch made by code that runs inside a send, under its write lock
    (here the clock it reads), raise ReentrantSendError and write nothing; the outer send
    goes on (the code before let them write at the outer send's position and offset)."""
    with MessageStore.open(tmp_path / "s", StoreConfig(flush="async")) as store:
        store.create_topic("t", 1)
        store.send("t", b"first")
        real = time.time_ns
        inner: list[object] = []

        def clock() -> int:
            if not inner:
                inner.append(None)
                for call in (
                    lambda: store.send("t", b"inner"),
                    lambda: store.send_batch("t", [b"inner batch"]),
                ):
                    try:
                        inner.append(call())
                    except ReentrantSendError as exc:
                        inner.append(exc)
            return real()

        monkeypatch.setattr(time, "time_ns", clock)
        outer = store.send("t", b"outer")
        monkeypatch.setattr(time, "time_ns", real)
        assert [type(e) for e in inner[1:]] == [ReentrantSendError] * 2, inner
        assert "nothing was written" in str(inner[1])
        assert outer.queue_offset == 1
        assert [m.body for m in store.pull("t", 0, 0, 10).messages] == [b"first", b"outer"]
    assert verify_store(tmp_path / "s") == []


@pytest.mark.usefixtures("code_path")
@pytest.mark.parametrize(("flush", "sends"), [("async", 3000), ("sync", 300)])
def test_a_signal_handler_sending_during_sends_leaves_the_store_consistent(
    tmp_path: Path, flush: str, sends: int
) -> None:
    """A SIGALRM handler sends (every 0.4 ms) while the main thread sends 3,000 messages
    (300 under flush="sync") over queue chunks of 400 entries: each handler send is
    stored or refused with ReentrantSendError, every acknowledged offset is unique and
    reads back its own body, and verify finds nothing (the code before acknowledged
    offsets twice, or failed with an AssertionError or "chunk file exists already", or
    hung: re-entered in Chunk._flush_lock, or under "sync" in the group commit's flush)."""
    path = tmp_path / "s"
    store = MessageStore.open(path, low_config(queue_chunk_records=400, flush=flush))
    acks: list[tuple[int, bytes]] = []
    refused: list[ReentrantSendError] = []
    busy = [False]

    def handler(signum: int, frame: Any) -> None:
        if busy[0]:
            return
        busy[0] = True
        try:
            data = b"sig%d" % len(acks)
            acks.append((store.send("t", data, queue_id=1).queue_offset, data))
        except ReentrantSendError as exc:
            refused.append(exc)
        finally:
            busy[0] = False

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        store.create_topic("t", 2)
        signal.setitimer(signal.ITIMER_REAL, 0.0004, 0.0004)
        for i in range(sends):
            data = b"main%d" % i
            acks.append((store.send("t", data, queue_id=1).queue_offset, data))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, previous)
        store.close()
    offsets = [offset for offset, _ in acks]
    assert len(set(offsets)) == len(offsets)
    with MessageStore.open(path, low_config(queue_chunk_records=400, flush=flush)) as again:
        assert again.queue_range("t", 1) == (0, len(acks))
        got = {m.queue_offset: m.body for m in again.pull("t", 1, 0, len(acks)).messages}
    assert got == dict(acks)
    assert verify_store(path) == []


def test_a_queue_closed_during_a_checkpoints_flush_is_synced_by_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint's flush of the queues that runs just after a queue's files were closed
    by the cache (here: inside the close, after ``release_files``) still fdatasyncs that
    queue's unflushed chunk (the code before listed the file for a later sync only after
    the close: that flush synced it neither way, and its checkpoint vouched for it)."""
    store = MessageStore.open(tmp_path / "s", low_config(flush="os"))
    try:
        store.send("t0", b"unflushed", queue_id=0)
        queue = store._queues["t0"][0]
        manager = queue._manager
        assert manager is not None and manager.last_chunk is not None
        path = str(manager.last_chunk.path)
        real_sync, real_release = os.fdatasync, ChunkManager.release_files
        synced: list[str] = []
        in_window: list[bool] = []

        def sync(fd: int) -> None:
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
            real_sync(fd)

        def release(self: ChunkManager) -> None:
            real_release(self)
            if self is manager:  # the window: closed, and (before the fix) not yet listed
                store._flush_queues()
                in_window.append(path in synced)

        monkeypatch.setattr(os, "fdatasync", sync)
        monkeypatch.setattr(ChunkManager, "release_files", release)
        for i in range(1, 20):  # more queues than stay open: t0 is closed
            store.send(f"t{i}", b"x", queue_id=0)
        monkeypatch.setattr(ChunkManager, "release_files", real_release)
        assert not queue.is_open
        assert in_window == [True]
    finally:
        store.close()


@pytest.mark.usefixtures("code_path")
def test_the_bound_send_keeps_the_signature_and_doc_of_message_store_send(
    tmp_path: Path,
) -> None:
    """``store.send`` (on the C path the accelerator's bound ``Sender.call``) has
    MessageStore.send's parameters, kinds and defaults, and a docstring, for
    ``inspect.signature`` and ``help()`` (the C-bound one had neither before)."""

    def shape(signature: inspect.Signature) -> list[tuple[str, Any, Any]]:
        return [(p.name, p.kind, p.default) for p in signature.parameters.values()]

    with MessageStore.open(tmp_path / "s") as store:
        expected = shape(inspect.signature(MessageStore.send))[1:]  # without self
        assert shape(inspect.signature(store.send)) == expected
        assert store.send.__doc__ is not None
        assert store.send.__doc__.startswith("Append one message to ``topic``")
