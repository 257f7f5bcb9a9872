"""The group commit's C flusher (equeue/server/flushers.py CSync, equeue/cext/flusher.c) on a
real store: every answer leaves only after an fdatasync whose target (the log chunk and its
end) was taken after the send's append and which succeeded, also across chunk rollovers;
a failed fdatasync (a real one: of a pipe, which fdatasync refuses with EINVAL, handed to
the C thread in place of the chunk's descriptor) answers its batch with the error and the
store refuses every later send with nothing written; and the broker uses the Python
flusher thread where the C one would bypass a replaced flush_log or os.fdatasync."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
from groupcommit_helpers import pipe_fdatasync
from server_helpers import short_home
from store_helpers import settle_chunk_maker

import equeue
from equeue import MessageStore, StoreConfig
from equeue.errors import StoreWriteError
from equeue.server import BrokerThread, flushers
from equeue.server.groupcommit import CrossClientCommit, finish_each
from equeue.store.flush import log_sync_target, log_synced

LIMIT_S = 20.0
SMALL = {"chunk_data_size": 64 * 1024, "queue_chunk_records": 1024}
BODY = b"b" * 900  # 8 connections x 40 sends: about five 64 KiB chunks


base = pytest.fixture(short_home, name="base")  # a short path: Unix sockets in it


class Spy:
    """Wraps flushers.log_sync_target and log_synced: notes, in loop order, each flush's
    target (the global log position it makes durable) and each outcome; ``fail_with`` a
    descriptor makes the next target's fdatasync go to it instead (the chunk stays)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, store: MessageStore) -> None:
        self.store = store
        self.events: list[tuple[Any, ...]] = []
        self.fail_with: int | None = None
        self.real_target, self.real_synced = log_sync_target, log_synced
        monkeypatch.setattr(flushers, "log_sync_target", self.target)
        monkeypatch.setattr(flushers, "log_synced", self.synced)

    def target(self, host: Any, own: Any) -> Any:
        got = self.real_target(host, own)
        if got is None:  # nothing unsynced: everything committed is durable already
            self.events.append(("target", self.store._messages.committed_position, False))
            return None
        chunk, fd, end = got
        self.events.append(("target", chunk.base + end, True))
        if self.fail_with is not None:
            fd, self.fail_with = self.fail_with, None
        return chunk, fd, end

    def synced(self, host: Any, chunk: Any, end: int, error: int) -> None:
        self.events.append(("synced", error))
        self.real_synced(host, chunk, end, error)


class Connection:
    """Sends ``total`` times, one in flight: each answer sends again (on the loop)."""

    def __init__(self, number: int, store: MessageStore, spy: Spy, total: int) -> None:
        self.number, self.store, self.spy, self.total = number, store, spy, total
        self.commit: CrossClientCommit | None = None
        self.answers: list[object] = []
        self.done = asyncio.Event()

    def send(self) -> None:
        assert self.commit is not None
        try:
            sent = self.store.send("t", BODY, queue_id=self.number % 4)
        except StoreWriteError as exc:  # refused: answered at once, as the broker does
            self.finish(-1, exc)
            return
        request_id = len(self.answers)
        end = self.store._messages.committed_position
        self.spy.events.append(("add", self.number, request_id, end, sent.position))
        self.commit.add(self, request_id, sent)

    def finish(self, request_id: int, outcome: object) -> None:
        self.spy.events.append(("answer", self.number, request_id, outcome))
        self.answers.append(outcome)
        if len(self.answers) == self.total:
            self.done.set()
        else:
            self.send()


async def _run(store: MessageStore, spy: Spy, connections: int, total: int) -> list[Connection]:
    def release(batch: list[Any], error: BaseException | None) -> None:
        spy.events.append(("release", len(batch)))
        finish_each(batch, error)

    commit = CrossClientCommit(
        asyncio.get_running_loop(), store.flush_log, release, wait_us=500, store=store
    )
    try:
        assert isinstance(commit._sync, flushers.CSync)
        conns = [Connection(n, store, spy, total) for n in range(connections)]
        for conn in conns:
            conn.commit = commit
            conn.send()
        await asyncio.wait_for(asyncio.gather(*(c.done.wait() for c in conns)), LIMIT_S)
    finally:
        commit.close()
    return conns


def _check_order(events: list[tuple[Any, ...]]) -> int:
    """Every answer after a flush target taken after its add and covering its append,
    whose fdatasync (if it needed one) then succeeded; returns the answers checked. One
    flush at a time: the k-th release answers the k-th target, the j-th outcome is the
    j-th target's that needed an fdatasync (the next target may be taken before the
    last one's answers go: that is the overlap)."""
    added: dict[tuple[int, int], tuple[int, int]] = {}  # (conn, rid) -> (event index, end)
    targets: list[list[Any]] = []  # [event index, durable-to, needed an fdatasync, ok]
    outcomes = releases = checked = 0
    current: list[Any] | None = None
    for index, event in enumerate(events):
        kind = event[0]
        if kind == "add":
            added[event[1], event[2]] = (index, event[3])
        elif kind == "target":
            targets.append([index, event[1], event[2], False])
        elif kind == "synced":
            needing = [t for t in targets if t[2]]
            needing[outcomes][3] = event[1] == 0
            outcomes += 1
        elif kind == "release":
            current = targets[releases]
            releases += 1
        elif kind == "answer" and not isinstance(event[3], Exception):
            add_index, end = added[event[1], event[2]]
            assert current is not None, event
            target_index, durable_to, needed, ok = current
            assert target_index > add_index, f"{event}: flush target taken before its append"
            assert durable_to >= end, f"{event}: flushed to {durable_to}, appended to {end}"
            assert ok or not needed, f"{event}: answered before its fdatasync ended well"
            checked += 1
    return checked


def test_every_answer_follows_an_fdatasync_taken_after_its_append_across_rollovers(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = MessageStore.open(base / "s", StoreConfig(**SMALL))  # type: ignore[arg-type]
    try:
        spy = Spy(monkeypatch, store)
        conns = asyncio.run(_run(store, spy, 8, 40))
        assert all(len(c.answers) == 40 for c in conns)
        assert not any(isinstance(a, Exception) for c in conns for a in c.answers)
        assert _check_order(spy.events) == 320
        settle_chunk_maker(store)  # (a file it removes would vanish under the walk)
        chunks = {p.name for p in (base / "s").rglob("*") if p.is_file()}
        assert len(chunks) > 5  # the log rolled over to new chunks during the run
        synced = [e for e in spy.events if e[0] == "synced"]
        assert len(synced) >= 40 and all(e[1] == 0 for e in synced)  # real fdatasyncs
    finally:
        store.close()
    with MessageStore.open(base / "s", read_only=True) as reader:  # what was answered is there
        for conn in conns:
            for sent in conn.answers:
                assert reader.read(sent.position).body == BODY  # type: ignore[attr-defined]


def test_a_failed_c_fdatasync_answers_its_batch_and_refuses_later_sends(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = MessageStore.open(base / "s", StoreConfig(**SMALL))  # type: ignore[arg-type]
    read_end, write_end = os.pipe()
    try:
        spy = Spy(monkeypatch, store)
        asyncio.run(_run(store, spy, 4, 5))  # the control: every answer a result
        assert not any(e[0] == "synced" and e[1] for e in spy.events)
        before = store.queue_range("t", 0)
        spy.fail_with = read_end  # the next fdatasync fails (EINVAL), as a failing disk's
        conns = asyncio.run(_run(store, spy, 4, 5))
        errors = [a for c in conns for a in c.answers if isinstance(a, Exception)]
        results = [a for c in conns for a in c.answers if not isinstance(a, Exception)]
        assert results == []  # the failed flush's batch, then every send refused
        failed = [a for a in errors if "may be lost" in str(a)]
        assert failed and all(isinstance(a, StoreWriteError) for a in errors)
        assert all("refused until the store is reopened" in str(a) for a in failed)
        refused = [a for a in errors if "may be lost" not in str(a)]
        assert len(failed) + len(refused) == 4 * 5 and len(refused) >= 4
        assert all("refusing the send" in str(a) for a in refused)
        # nothing written by the refused sends: the queue ends where the failed batch left it
        after = store.queue_range("t", 0)
        assert after[1] - before[1] <= 1  # at most queue 0's one send of the failed batch
        with pytest.raises(StoreWriteError, match="refusing the send"):
            store.send("t", b"later", queue_id=0)
        assert store.queue_range("t", 0) == after
    finally:
        os.close(read_end)
        os.close(write_end)
        with pytest.raises(StoreWriteError):
            store.close()
    with MessageStore.open(base / "s") as reopened:  # recovery; sending resumes
        reopened.send("t", b"after the reopen", queue_id=0)


def test_the_c_flusher_is_used_only_where_it_does_what_flush_log_would(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = MessageStore.open(base / "s", StoreConfig(**SMALL))  # type: ignore[arg-type]

    async def kind(flush_log: Any) -> type:
        commit = CrossClientCommit(asyncio.get_running_loop(), flush_log, store=store)
        commit.close()
        return type(commit._sync)

    try:
        assert asyncio.run(kind(store.flush_log)) is flushers.CSync
        assert asyncio.run(kind(lambda: None)) is flushers.ThreadSync  # not the store's
        monkeypatch.setattr(os, "fdatasync", lambda fd: None)  # a fault injector's
        assert asyncio.run(kind(store.flush_log)) is flushers.ThreadSync
    finally:
        monkeypatch.undo()
        store.close()


def test_close_with_a_c_fdatasync_in_progress_answers_its_batch_after_it(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = MessageStore.open(base / "s", StoreConfig(**SMALL))  # type: ignore[arg-type]
    try:
        spy = Spy(monkeypatch, store)

        async def scenario() -> Connection:
            commit = CrossClientCommit(asyncio.get_running_loop(), store.flush_log, store=store)
            conn = Connection(0, store, spy, 1)
            conn.commit = commit
            conn.send()  # nothing in progress, nothing expected: its fdatasync starts now
            assert commit._flushing is not None and not conn.answers
            commit.close()  # on the loop, as the broker does: waits for that fdatasync
            assert commit.pending == 0
            return conn

        conn = asyncio.run(scenario())
        assert len(conn.answers) == 1 and not isinstance(conn.answers[0], Exception)
        assert [e[0] for e in spy.events] == ["add", "target", "synced", "answer"]
        assert spy.events[2][1] == 0
    finally:
        store.close()


def test_a_broker_whose_c_fdatasync_fails_answers_the_error_and_refuses_later_sends(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a real broker and client: the C flusher's failed fdatasync (of a pipe,
    EINVAL) answers the send it covered "may be lost", and every later send is refused
    with nothing stored (test_durable_flush_failure.py does the same on the Python
    flusher thread, which its os.fdatasync injector selects)."""
    opened: list[int] = []
    arm = pipe_fdatasync(monkeypatch, opened)
    try:
        with (
            BrokerThread(base / "s", flush="sync", listen=[f"unix:{base}/b.sock"]) as broker,
            equeue.connect(broker.urls[0]) as client,
        ):
            client.create_topic("t", 1)
            assert client.send("t", b"one").queue_offset == 0  # the control: answered
            arm()
            with pytest.raises(StoreWriteError, match=r"may be lost.*refused until the store"):
                client.send("t", b"two")
            end = client.queue_range("t", 0)
            for body in (b"three", b"four"):
                with pytest.raises(StoreWriteError, match="refusing the send"):
                    client.send("t", body)
            assert client.queue_range("t", 0) == end  # nothing stored by the refused sends
    finally:
        for fd in opened:
            os.close(fd)
    with MessageStore.open(base / "s") as store:  # reopened: sending resumes
        assert store.pull("t", 0, 0, max_count=10).messages[0].body == b"one"
        store.send("t", b"after the reopen", queue_id=0)
