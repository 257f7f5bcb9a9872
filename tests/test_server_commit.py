"""--flush sync across clients: sends of many connections share each fdatasync of the
message log, and no send is answered before an fdatasync that started after its append
has ended (equeue/server/groupcommit.py)."""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

import pytest
from server_helpers import raw, short_home

from equeue import MessageStore
from equeue.errors import EQueueError, StoreWriteError
from equeue.protocol.records import unpack_send_result
from equeue.server import BrokerThread

CLIENTS = 16
SENDS = 40  # per client
WINDOW = 4  # sends in flight per client


home = pytest.fixture(short_home, name="home")


class FlushSpy:
    """Wraps the store's flush_log: counts fdatasyncs, and after each one publishes the
    log position every append before it had reached (what it made durable at least)."""

    def __init__(self, running: BrokerThread) -> None:
        store = running.store
        self.real = store.flush_log
        self.messages = store._messages
        self.calls = 0
        self.durable = 0  # log position below which everything is known flushed
        self.lock = threading.Lock()
        store.flush_log = self  # type: ignore[method-assign]

    def __call__(self) -> None:
        start = self.messages.committed_position  # everything appended before this flush
        time.sleep(0.002)  # a slow disk: an answer sent before its flush would show
        self.real()
        with self.lock:
            self.calls += 1
            self.durable = max(self.durable, start)


def test_many_clients_share_fdatasyncs_and_none_is_answered_early(home: Path) -> None:
    running = BrokerThread(home / "s", flush="sync")
    spy = FlushSpy(running)
    early: list[tuple[int, int]] = []
    positions: list[int] = []
    failures: list[BaseException] = []

    def client(number: int) -> None:
        try:
            with raw(running.urls[0]) as c:
                sent = answered = 0
                while answered < SENDS:
                    while sent < SENDS and sent - answered < WINDOW:
                        c.request("send", topic="t", body=b"%d:%d" % (number, sent))
                        sent += 1
                    _, status, payload = c.recv()
                    assert status == 0, payload
                    answered += 1
                    position = unpack_send_result(payload, "test").position
                    with spy.lock:
                        durable = spy.durable
                    if position >= durable:
                        early.append((position, durable))
                    positions.append(position)
        except BaseException as exc:
            failures.append(exc)

    with running:
        threads = [threading.Thread(target=client, args=(n,)) for n in range(CLIENTS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        with raw(running.urls[0]) as c:
            stats = c.call("stats")
    assert not failures, failures[0]
    total = CLIENTS * SENDS
    assert len(positions) == total
    assert early == []  # every answer came after an fdatasync covering its append
    assert spy.calls >= 1
    assert spy.calls * 4 <= total, f"{spy.calls} fdatasyncs for {total} sends"
    assert stats["flushes"] == spy.calls
    assert stats["sends_per_flush"] == pytest.approx(total / spy.calls, rel=0.01)


def test_sends_per_flush_counts_messages_not_requests(home: Path) -> None:
    """A send_bodies of 40 and a send_batch of 7 count 40 and 7, a plain send and a send
    with a tag 1 each: sends_per_flush is messages per fdatasync (it counted the requests
    before, 4 here)."""
    running = BrokerThread(home / "s", flush="sync")
    spy = FlushSpy(running)
    with running, raw(running.urls[0]) as c:
        c.call("send_bodies", topic="t", bodies=[b"b%d" % i for i in range(40)])
        c.call("send_batch", topic="t", messages=[{"body": b"m"}] * 7)
        c.call("send", topic="t", body=b"p")
        c.call("send", topic="t", body=b"q", tag="x")
        stats = c.call("stats")
    assert stats["sends"] == 49
    assert stats["flushes"] == spy.calls >= 1
    assert stats["sends_per_flush"] == pytest.approx(49 / spy.calls, abs=0.01)


def test_an_empty_batch_counts_no_message_in_sends_per_flush(home: Path) -> None:
    """An empty send_bodies and an empty send_batch append nothing: 0 messages each (they
    counted 1 each before), so only the plain send's 1 is in sends_flushed."""
    running = BrokerThread(home / "s", flush="sync")
    spy = FlushSpy(running)
    with running, raw(running.urls[0]) as c:
        assert c.call("send_bodies", topic="t", bodies=[])[0] == "t"
        assert c.call("send_batch", topic="t", messages=[]) == []
        c.call("send", topic="t", body=b"p")
        stats = c.call("stats")
        commit = running.broker.handlers.commit
        assert commit is not None
        flushed = commit.sends_flushed
    assert (stats["sends"], flushed) == (1, 1)
    assert stats["flushes"] == spy.calls >= 1
    assert stats["sends_per_flush"] == pytest.approx(1 / spy.calls, abs=0.01)


def test_a_failed_flush_answers_its_sends_with_the_error(home: Path) -> None:
    running = BrokerThread(home / "s", flush="sync")
    store = running.store

    def failing() -> None:
        raise StoreWriteError(5, "fdatasync of the test's log failed (EIO)")

    store.flush_log = failing  # type: ignore[method-assign]
    with running, raw(running.urls[0]) as c:
        error = c.error("send", topic="t", body=b"x")
        assert error["code"] == "StoreWriteError"
        assert "may be lost" in error["message"] and "EIO" in error["message"]
        assert c.call("ping") is None


def test_a_power_cut_under_flush_sync_loses_no_acknowledged_send(home: Path) -> None:
    """A SIGKILL cannot show an answer given before its fdatasync (the page cache
    survives it); a power cut can. The broker runs under the power-loss model
    (tests/power_loss_model.py: fsync/fdatasync/msync of the store's files recorded, not
    done), clients note each answer while the power is on, the power fails mid-stream,
    and the disk it leaves (every byte not flushed zeroed, directories as last fsynced)
    must hold every acknowledged send. Control: the undamaged disk holds them too."""
    from power_loss_model import Damage, materialize, recording

    from equeue.store.config import StoreConfig

    root = home / "s"
    root.mkdir()
    acked: dict[str, bytes] = {}
    stop = threading.Event()
    failures: list[BaseException] = []
    with recording(root) as recorder:
        store = MessageStore.open(root, StoreConfig(chunk_data_size=1 << 20))
        running = BrokerThread(store, flush="sync", listen=[f"unix:{home / 'b.sock'}"])

        def note(message_id: str, body: bytes) -> None:
            acked[message_id] = body

        def client(number: int) -> None:
            try:
                with raw(running.urls[0]) as c:
                    for sent in range(2000):  # bounded; stopped by the power cut long before
                        if stop.is_set():
                            break
                        body = b"%d:%d" % (number, sent)
                        message_id = c.call("send", topic="t", body=body)[0]
                        recorder.while_powered(functools.partial(note, message_id, body))
            except BaseException as exc:
                failures.append(exc)

        try:
            with running:
                threads = [threading.Thread(target=client, args=(n,)) for n in range(4)]
                for thread in threads:
                    thread.start()
                for _ in range(2000):  # until enough answers came, then the power fails
                    if len(acked) >= 300 or failures:
                        break
                    time.sleep(0.005)
                image = recorder.cut()
                stop.set()
                for thread in threads:
                    thread.join(60)
        finally:
            store.close()
    assert not failures, failures[0]
    assert len(acked) >= 300
    for damage in (Damage(pages="none", entries="keep"), Damage(pages="zeros", entries="revert")):
        after = home / f"after-{damage.pages}"
        materialize(image, after, damage)
        with MessageStore.open(after) as reopened:
            lost = [i for i, body in acked.items() if _body(reopened, i) != body]
        assert lost == [], f"{damage}: {len(lost)} of {len(acked)} acknowledged sends lost"


def _body(store: MessageStore, message_id: str) -> bytes | None:
    try:
        return store.get(message_id).body
    except EQueueError:
        return None
