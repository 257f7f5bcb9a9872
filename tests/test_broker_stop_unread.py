"""A draining broker tells its clients what it never read (protocol version 6, reviewk
F9): once every request it read is answered, each connection's last frame is
BrokerStoppingError (request id 0), and the clients report the sends still unanswered
then as ``unsent`` (not stored), not ``unanswered`` (may be stored). Checked against the
store read after the stop: every acknowledged send stored once, every unsent one not
stored, nothing stored untold."""

from __future__ import annotations

import asyncio
import collections
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from server_helpers import Raw, raw, short_home
from test_server_kill import start_broker

import equeue
import equeue.aio
from equeue import MessageStore
from equeue.errors import ConnectionLostError, EQueueError
from equeue.protocol.frames import check_answer, encode
from equeue.server import BrokerThread
from equeue.store.types import OutgoingMessage

home = pytest.fixture(short_home, name="home")

HIGH = 512 * 1024  # write_buffer_high
BODY = 256 * 1024
PULLS = 40  # answers of BODY each: the broker pauses reading after about HIGH of them
SENDS = 30
LOAD_S = 1.5  # the clients send this long before the SIGTERM
GUARD_S = 60.0


def _stored(store: Path, topic: str) -> collections.Counter[bytes]:
    found: collections.Counter[bytes] = collections.Counter()
    with MessageStore.open(store, read_only=True) as reopened:
        if topic not in reopened.topics():
            return found
        for queue_id in reopened.queue_ids(topic):
            offset = reopened.queue_range(topic, queue_id)[0]
            while True:
                pulled = reopened.pull(topic, queue_id, offset, max_count=4096)
                if not pulled.messages:
                    break
                found.update(m.body for m in pulled.messages)
                offset = pulled.next_offset
    return found


def _client_buffered(watcher: Raw, client_name_number: int) -> int:
    stats = watcher.call("stats")
    (found,) = [
        c for c in stats["clients"] if c["where"].startswith(f"connection #{client_name_number} ")
    ]
    return int(found["buffered_bytes"])


def test_sends_the_broker_never_read_are_named_by_its_last_frame(home: Path) -> None:
    """A client that reads nothing until the broker paused reading it (its answers past
    write_buffer_high), then writes 30 sends, which wait unread in the socket; the broker
    is stopped. The client then reads: the answers of the pulls served, then
    BrokerStoppingError with request id 0, then the end; none of the 30 sends was
    answered and none is stored."""
    store = home / "s"
    running = BrokerThread(store, write_buffer_high=HIGH).start()
    stopper: threading.Thread | None = None
    try:
        running.store.send("t", b"x" * BODY, queue_id=0)
        url = running.urls[0]
        with raw(url) as watcher:
            stalled = Raw(url)  # connection #2
            stalled.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            pull = {"topic": "t", "queue_id": 0, "offset": 0}
            stalled.send_raw(b"".join(encode([n + 1, "pull", pull]) for n in range(PULLS)))
            deadline = time.monotonic() + GUARD_S
            while _client_buffered(watcher, 2) < HIGH:  # reading it is paused
                assert time.monotonic() < deadline, "the broker never paused the client"
                time.sleep(0.02)
            sends = range(PULLS + 1, PULLS + 1 + SENDS)
            stalled.send_raw(
                b"".join(encode([n, "send", {"topic": "u", "body": b"s%d" % n}]) for n in sends)
            )
            stopper = threading.Thread(target=running.stop)
            stopper.start()
            answered: dict[int, tuple[int, Any]] = {}
            stalled.sock.settimeout(GUARD_S)
            while True:
                rid, status, payload = check_answer(stalled.recv(), "t")
                if rid == 0:
                    break
                answered[rid] = (status, payload)
            assert (status, payload["code"]) == (1, "BrokerStoppingError")
            assert "served none of this connection's requests" in payload["message"]
            with pytest.raises(ConnectionError):
                stalled.recv()  # the end: nothing after it
            stalled.close()
        stopper.join(GUARD_S)
        assert not stopper.is_alive()
    finally:
        if stopper is None:
            running.stop()
    # the pulls served before the stop were answered; the rest were not served (read into
    # the backlog, or never read), nor any send
    assert answered and set(answered) <= set(range(1, PULLS + 1))
    assert all(status == 0 for status, _ in answered.values())
    assert _stored(store, "u") == collections.Counter()  # and no send was stored


def _body(message: Any) -> bytes:
    return message.body if isinstance(message, OutgoingMessage) else bytes(message)


class Outcomes:
    """What each client was told of each body: acknowledged, unsent or unanswered."""

    def __init__(self) -> None:
        self.told: dict[bytes, str] = {}
        self.causes: collections.Counter[str] = collections.Counter()

    def failed(self, error: EQueueError, bodies: list[bytes]) -> None:
        self.causes[type(error.__cause__).__name__] += 1
        unsent = {_body(m) for m in error.unsent}
        unanswered = {_body(m) for m in error.unanswered}
        sent = {r.message_id for r in error.sent}  # (send_many's)
        assert not unsent & unanswered
        for body in bodies:
            if body in unsent:
                self.told[body] = "unsent"
            elif body in unanswered:
                self.told[body] = "unanswered"
            else:
                self.told[body] = "acknowledged"  # send_many's sent
        assert len(sent) == sum(1 for b in bodies if self.told[b] == "acknowledged")


def _aio_load(url: str, outcomes: Outcomes, stop_at: float) -> None:
    async def run() -> None:
        client = await equeue.aio.connect(url, connect_timeout=1.0)
        ended = False

        async def producer(number: int) -> None:
            nonlocal ended
            sequence = 0
            while not ended and time.monotonic() < stop_at:
                body = b"aio-%d-%d" % (number, sequence)
                sequence += 1
                try:
                    await client.send("t", body)
                    outcomes.told[body] = "acknowledged"
                except ConnectionLostError as exc:
                    outcomes.failed(exc, [body])
                    ended = True  # (the broker is gone: no reconnect is tried)

        await asyncio.gather(*(producer(n) for n in range(64)))
        await client.close()

    asyncio.run(run())


def _many_load(url: str, outcomes: Outcomes, stop_at: float) -> None:
    with equeue.connect(url, connect_timeout=1.0) as client:
        batch = 0
        while time.monotonic() < stop_at:
            bodies = [b"many-%d-%d" % (batch, i) for i in range(2000)]
            batch += 1
            try:
                client.send_many("t", bodies, window=256)
                outcomes.told.update(dict.fromkeys(bodies, "acknowledged"))
            except EQueueError as exc:
                outcomes.failed(exc, bodies)
                return


def _threads_load(url: str, outcomes: Outcomes, stop_at: float) -> None:
    """4 threads sharing one sync client, a send at a time each (one of them finds the
    broker gone by a write, EPIPE, while another has the reader's turn: endings.py)."""
    with equeue.connect(url, connect_timeout=1.0) as client:

        def sender(number: int) -> None:
            sequence = 0
            while time.monotonic() < stop_at:
                body = b"thread-%d-%d" % (number, sequence)
                sequence += 1
                try:
                    client.send("t", body)
                    outcomes.told[body] = "acknowledged"
                except ConnectionLostError as exc:
                    outcomes.failed(exc, [body])
                    return

        senders = [threading.Thread(target=sender, args=(n,)) for n in range(4)]
        for thread in senders:
            thread.start()
        for thread in senders:
            thread.join()


def test_sigterm_under_load_reports_the_unread_sends_unsent(home: Path) -> None:
    """`equeue serve` in a subprocess, SIGTERM after LOAD_S of 64 asyncio producers on one
    connection, a sync send_many (windows of 256) on another and 4 threads sending one
    at a time on a third. Before (reviewk F9: 64, 208 and 4 sends unanswered, none of
    them stored) every send in flight was reported
    unanswered; now the broker's last frame makes them unsent: no send is unanswered,
    and the store after the stop agrees with every report."""
    store = home / "s"
    broker, url = start_broker(store, "--flush", "sync")
    outcomes = {"aio": Outcomes(), "many": Outcomes(), "threads": Outcomes()}
    stop_at = time.monotonic() + GUARD_S
    loads = [
        threading.Thread(target=_aio_load, args=(url, outcomes["aio"], stop_at)),
        threading.Thread(target=_many_load, args=(url, outcomes["many"], stop_at)),
        threading.Thread(target=_threads_load, args=(url, outcomes["threads"], stop_at)),
    ]
    try:
        for load in loads:
            load.start()
        time.sleep(LOAD_S)
        broker.send_signal(signal.SIGTERM)
        assert broker.wait(GUARD_S) == 0
        for load in loads:
            load.join(GUARD_S)
            assert not load.is_alive()
    finally:
        if broker.poll() is None:
            broker.kill()
            broker.wait()
    stored = _stored(store, "t")
    assert max(stored.values()) == 1  # nothing stored twice
    told = {body: said for seen in outcomes.values() for body, said in seen.told.items()}
    assert set(stored) <= set(told)  # nothing stored untold
    by_outcome = collections.Counter(told.values())
    for body, outcome in told.items():
        if outcome == "acknowledged":
            assert stored[body] == 1, body
        elif outcome == "unsent":
            assert stored[body] == 0, body
    assert by_outcome["acknowledged"] > 0 and by_outcome["unsent"] > 0, by_outcome
    # the broker said what it never read: no send is left in doubt
    causes = {name: dict(seen.causes) for name, seen in outcomes.items()}
    assert by_outcome["unanswered"] == 0, (by_outcome, causes)


def test_a_version_5_client_is_not_sent_the_last_frame(home: Path) -> None:
    """An older client never saw an id-0 frame at a drain (a raw version-1 producer of
    these tests failed on one): it gets its answers, then the end, as before."""
    running = BrokerThread(home / "s").start()
    stopper = threading.Thread(target=running.stop)
    try:
        with raw(running.urls[0], versions=(1, 2, 3, 4, 5)) as old:
            old.call("create_topic", topic="t", queue_count=1)
            held = old.request("pull", topic="t", queue_id=0, offset=0, wait_ms=600_000)
            old.call("ping")  # the pull is held by now
            stopper.start()
            assert old.recv() == [held, 0, [[], 0]]
            with pytest.raises(ConnectionError):
                old.recv()
    finally:
        if stopper.ident is None:  # (failed before the stop began)
            running.stop()
        else:
            stopper.join(GUARD_S)
