"""Held long-poll pulls against their connection's backpressure and its end (reviewg F1,
F2): the answers one connection buffers stay near write_buffer_high however many pulls
it holds; a paused connection's held pulls are answered once it drains, or empty at their
wait_ms; a client gone with pulls held frees its place at once, and one that half-closed
still gets their answers."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
from server_helpers import Raw, raw, short_home

from equeue.protocol.frames import encode
from equeue.protocol.pullcols import unpack_any
from equeue.server import BrokerThread
from equeue.server.connection import READ_BUFFER_BYTES

home = pytest.fixture(short_home, name="home")

HIGH = 512 * 1024  # write_buffer_high
BODY = 256 * 1024  # the one message every held pull may be answered with
HELD = 300
ANSWER = BODY + 1024  # a pull's answer of it: the body and its fields
BOUND = HIGH + ANSWER + READ_BUFFER_BYTES  # docs/broker.md, "Limits and backpressure"
DAY_MS = 86_400_000


def _stalled_holder(url: str, count: int, wait_ms: int, op: str = "pull") -> Raw:
    """A client that pipelines ``count`` long polls on the empty t/0 and reads nothing."""
    stalled = Raw(url)
    stalled.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    pull = {"topic": "t", "queue_id": 0, "offset": 0, "max_count": 65536, "wait_ms": wait_ms}
    stalled.send_raw(b"".join(encode([n + 1, op, pull]) for n in range(count)))
    return stalled


def _wait_for(producer: Raw, field: str, value: int) -> dict[str, object]:
    stats: dict[str, object] = {}
    for _ in range(500):  # at most ~10 s
        stats = producer.call("stats")
        if stats[field] == value:
            return stats
        time.sleep(0.02)
    raise AssertionError(f"{field} never became {value}: {stats}")


def _buffered(stats: dict[str, object], stalled_number: int) -> int:
    clients = stats["clients"]
    assert isinstance(clients, list)
    (client,) = [c for c in clients if c["where"].startswith(f"connection #{stalled_number} ")]
    return int(client["buffered_bytes"])


def test_held_pulls_answered_past_backpressure_stay_bounded_and_drain(home: Path) -> None:
    """reviewg F1 scaled down: 300 held pulls of a client that reads nothing, then one
    256 KiB send. Before the fix every pull was answered at once: ~77 MB buffered."""
    with BrokerThread(home / "s", write_buffer_high=HIGH) as running:
        url = running.urls[0]
        with raw(url) as producer:
            producer.call("create_topic", topic="t", queue_count=1)
            stalled = _stalled_holder(url, HELD, DAY_MS)  # connection #2
            try:
                _wait_for(producer, "held_pulls", HELD)
                assert producer.call("send", topic="t", body=b"x" * BODY)[3] == 0
                stats = producer.call("stats")
                assert _buffered(stats, 2) <= BOUND, stats
                assert stats["buffered_bytes"] <= BOUND + 4096, stats
                # the rest wait for room, still held, and other clients are served
                assert 0 < int(stats["held_pulls"]) < HELD
                assert producer.call("ping") is None
                # the client reads: every pull is answered once, with the message
                answers = stalled.answers(HELD)
                assert sorted(answers) == list(range(1, HELD + 1))
                for status, (messages, next_offset) in answers.values():
                    assert status == 0 and len(messages) == 1 and next_offset == 1
                    assert messages[0][9] == b"x" * BODY  # (the body)
                assert producer.call("stats")["held_pulls"] == 0
                assert stalled.call("ping") is None  # nothing more came
            finally:
                stalled.close()


@pytest.mark.parametrize("op", ["pull", "pull_columns"])
def test_held_pulls_of_a_paused_connection_are_answered_empty_at_their_wait_ms(
    home: Path, op: str
) -> None:
    """A paused connection's pulls whose wait_ms ends before it drains are answered empty
    (next_offset their offset: nothing skipped), not with the message: still bounded."""
    with BrokerThread(home / "s", write_buffer_high=HIGH) as running:
        url = running.urls[0]
        with raw(url) as producer:
            producer.call("create_topic", topic="t", queue_count=1)
            stalled = _stalled_holder(url, HELD, 3000, op)
            try:
                _wait_for(producer, "held_pulls", HELD)
                producer.call("send", topic="t", body=b"x" * BODY)
                stats = _wait_for(producer, "held_pulls", 0)  # their wait_ms went by
                assert _buffered(stats, 2) <= BOUND, stats
                answers = stalled.answers(HELD)
                assert sorted(answers) == list(range(1, HELD + 1))
                assert all(status == 0 for status, _ in answers.values())
                found = [unpack_any(p, "test") for _, p in answers.values()]
                full = [r for r in found if r.messages]
                assert 0 < len(full) <= HIGH // BODY + 2, len(full)
                assert all(r.next_offset == 1 and r[0].body == b"x" * BODY for r in full)
                empty = [(list(r.messages), r.next_offset) for r in found if not r.messages]
                assert empty == [([], 0)] * (HELD - len(full))
                assert stalled.call("ping") is None
            finally:
                stalled.close()


def test_clients_gone_with_pulls_held_free_their_places(home: Path) -> None:
    """reviewg F2 scaled down: clients that close with a day-long poll held kept their
    connection and their max_connections place for the day; a new client was refused."""
    with BrokerThread(home / "s", max_connections=5) as running:
        url = running.urls[0]
        with raw(url) as watcher:
            watcher.call("create_topic", topic="t", queue_count=1)
            for _ in range(4):
                gone = Raw(url)
                gone.request("pull", topic="t", queue_id=0, offset=0, wait_ms=DAY_MS)
                _wait_for(watcher, "held_pulls", 1)
                gone.close()  # FIN, nothing unread: only the broker can tell it is gone
                _wait_for(watcher, "connections", 1)
            stats = watcher.call("stats")
            assert (stats["held_pulls"], stats["in_flight"]) == (0, 0)
            newcomers = [Raw(url) for _ in range(4)]  # the places are free: welcomed
            try:
                assert all(c.call("ping") is None for c in newcomers)
            finally:
                for c in newcomers:
                    c.close()


def test_a_half_closed_client_gets_its_held_pulls_answered_at_once(home: Path) -> None:
    """A half-close (SHUT_WR, reading on) with pulls held: they are answered with what
    there is now, not a day later, then the broker closes. (A half-close with sends
    awaiting their fdatasync still gets them: test_server.py.)"""
    with BrokerThread(home / "s") as running:
        url = running.urls[0]
        with raw(url) as producer:
            producer.call("create_topic", topic="t", queue_count=1)
            producer.call("create_topic", topic="u", queue_count=1)
            producer.call("send", topic="u", body=b"there")
            c = Raw(url)
            try:
                empty = c.request("pull", topic="t", queue_id=0, offset=0, wait_ms=DAY_MS)
                full = c.request("pull", topic="u", queue_id=0, offset=1, wait_ms=DAY_MS)
                _wait_for(producer, "held_pulls", 2)
                producer.call("send", topic="u", body=b"late")
                assert c.answers(1)[full][1][0][0][9] == b"late"
                c.sock.shutdown(socket.SHUT_WR)
                assert c.answers(1) == {empty: (0, [[], 0])}
                with pytest.raises(ConnectionError):
                    c.recv()  # then the broker closes
                assert _wait_for(producer, "connections", 1)["held_pulls"] == 0
            finally:
                c.close()
