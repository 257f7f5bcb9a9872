"""Edges of the broker (issue 23), through a real broker on a Unix socket: a held pull of
a member that lost its queue while held, dead letters that cannot fit, paths in error
texts, offsets retention passed, the retry mover's flush off the loop."""

from __future__ import annotations

import datetime as dt
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import Raw, keepalive_of, raw, short_dir

from equeue import MessageStore, StoreConfig
from equeue.format.chunk import MIN_CHUNK_DATA_SIZE
from equeue.protocol.records import unpack_message
from equeue.protocol.retries import DELAY_TOPIC, MOVER_GROUP, retry_topic
from equeue.server import BrokerThread
from equeue.server.status import render_stats

TOPIC = "one"
BOUND_S = 10.0  # every wait below ends by then


@pytest.fixture
def store_dir() -> Iterator[Path]:
    directory = short_dir()
    try:
        with MessageStore.open(directory / "s") as store:
            store.create_topic(TOPIC, 1)
        yield directory / "s"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def url(store_dir: Path) -> Iterator[str]:
    thread = BrokerThread(store_dir).start()
    try:
        yield thread.urls[0]
    finally:
        thread.stop()


def _holds(member: Raw, consumer: str, queue: list[object]) -> bool:
    answer = member.call("heartbeat", group="g", consumer=consumer)
    return queue in answer["assignment"]


def test_a_held_pull_of_a_member_that_lost_its_queue_gets_no_messages(url: str) -> None:
    """Member a's pull is held; a's session expires and b gets the queue; a send then
    must not answer a's pull with b's messages (two consumers on one queue)."""
    with raw(url) as a, raw(url) as b:
        joined = a.call("join", group="g", consumer="a", topics=[TOPIC], session_timeout_ms=200)
        assert [TOPIC, 0] in joined["assignment"]
        held = a.request(
            "pull", topic=TOPIC, queue_id=0, offset=0, wait_ms=15_000, group="g", consumer="a"
        )
        b.call("join", group="g", consumer="b", topics=[TOPIC], session_timeout_ms=5000)
        deadline = time.monotonic() + BOUND_S
        while not _holds(b, "b", [TOPIC, 0]):  # a stops heartbeating: it expires
            assert time.monotonic() < deadline, "b never got the queue"
            time.sleep(0.05)
        b.call("send", topic=TOPIC, body=b"for b")
        answer = a.answers(1)[held]
        assert answer[0] == 1, f"a (no longer the holder) was answered {answer[1]!r}"
        assert answer[1]["code"] == "GroupError"
        assert "consumer 'a'" in answer[1]["message"]
        # control: b, the holder, pulls it
        pulled = b.call("pull", topic=TOPIC, queue_id=0, offset=0, group="g", consumer="b")
        assert [unpack_message(m, "test").body for m in pulled[0]] == [b"for b"]


def test_a_held_pull_of_the_holder_is_answered_with_the_message(url: str) -> None:
    """Control: the member still holds the queue; its held pull gets the send."""
    with raw(url) as a, raw(url) as producer:
        a.call("join", group="g", consumer="a", topics=[TOPIC], session_timeout_ms=5000)
        held = a.request(
            "pull", topic=TOPIC, queue_id=0, offset=0, wait_ms=15_000, group="g", consumer="a"
        )
        producer.call("send", topic=TOPIC, body=b"m")
        status, result = a.answers(1)[held]
        assert status == 0 and len(result[0]) == 1


def test_error_texts_sent_to_clients_name_files_relative_to_the_store(
    store_dir: Path, url: str, caplog: pytest.LogCaptureFixture
) -> None:
    root = str(store_dir)
    with raw(url) as client:
        sent = client.call("send", topic=TOPIC, body=b"x")
        past_end = sent[0][:-2] + "ff"  # a message id whose position lies past the data
        errors = [
            client.error("get", message_id=past_end),
            client.error("pull", topic="nope", queue_id=0, offset=0),
        ]
        (store_dir / "consumers").mkdir(exist_ok=True)
        (store_dir / "consumers" / "g.json").write_text("junk")
        # A commit sets a damaged group file aside: a file in the way makes it fail.
        (store_dir / "consumers" / "recovered").write_text("in the way")
        with caplog.at_level("INFO", logger="equeue.server"):
            errors.append(client.error("commit_offset", group="g", topic=TOPIC, queue_id=0,
                                       offset=1))  # fmt: skip
    texts = [e["message"] for e in errors]
    assert [e["code"] for e in errors] == [
        "MessageNotFoundError", "TopicNotFoundError", "CorruptionError"
    ]  # fmt: skip
    assert not [t for t in texts if root in t or "/tmp/" in t], texts
    assert "in messages/chunk-000000000000.0000" in texts[0]
    assert texts[1] == "no topic 'nope' in the store"
    assert "in consumers/g.json at offset 0" in texts[2]
    # the broker's own log keeps the absolute path
    assert f"{root}/consumers/g.json" in caplog.text


def test_the_retry_movers_fdatasync_runs_off_the_event_loop(store_dir: Path) -> None:
    """A delayed retry due: the mover appends it on the loop, fdatasyncs the log and
    writes its cursor on the committer thread (before: both on the loop)."""
    threads: list[str] = []
    with MessageStore.open(store_dir) as store:
        real = store.flush_log

        def flush_log() -> None:
            threads.append(threading.current_thread().name)
            real()

        store.flush_log = flush_log  # type: ignore[method-assign]
        broker = BrokerThread(store).start()
        try:
            with raw(broker.urls[0]) as a:
                a.call("join", group="g", consumer="a", topics=[TOPIC], session_timeout_ms=5000)
                sent = a.call("send", topic=TOPIC, body=b"m")
                a.call("nack", group="g", consumer="a", message_id=sent[0], delay_ms=1)
                deadline = time.monotonic() + BOUND_S
                while store.committed_offset(MOVER_GROUP, DELAY_TOPIC, 0) != 1:
                    assert time.monotonic() < deadline, "the copy was never moved"
                    time.sleep(0.05)
                moved = a.call("pull", topic=retry_topic("g"), queue_id=0, offset=0)
                assert len(moved[0]) == 1
        finally:
            broker.stop()
    assert threads and set(threads) == {"equeue-broker-commit_0"}, threads


def _retained_store(path: Path) -> int:
    """A store whose queue one/0 lost its first offsets to retention, group g committed
    at 1 below them; the queue's first retained offset."""
    config = StoreConfig(chunk_data_size=MIN_CHUNK_DATA_SIZE, retention=dt.timedelta(seconds=1))
    with MessageStore.open(path, config) as store:
        store.create_topic(TOPIC, 1)
        store.send_batch(TOPIC, [b"m" * 200] * 400)  # several log chunks
        store.commit_offset("g", TOPIC, 0, 1)
        store.apply_retention(time.time() + 3600)
        first = store.queue_range(TOPIC, 0)[0]
    assert first > 1
    return first


def test_offsets_retention_removed_before_a_group_read_them_are_counted_and_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    directory = short_dir()
    try:
        first = _retained_store(directory / "s")
        broker = BrokerThread(directory / "s").start()
        try:
            with raw(broker.urls[0]) as a, caplog.at_level("WARNING", logger="equeue.groups"):
                a.call("join", group="g", consumer="a", topics=[TOPIC], session_timeout_ms=5000)
                # the member starts at the first retained; a pull from below it (a member
                # that fell behind) counts nothing twice
                a.call("pull", topic=TOPIC, queue_id=0, offset=1, group="g", consumer="a")
                # a member of another group, far behind (no commit): counted at its pull
                a.call("join", group="h", consumer="a", topics=[TOPIC], session_timeout_ms=5000)
                a.call("pull", topic=TOPIC, queue_id=0, offset=0, group="h", consumer="a")
                a.call("pull", topic=TOPIC, queue_id=0, offset=first)  # control: no group
                stats = a.call("stats", group="g")
                other = a.call("stats", group="h")
                summary = a.call("stats")["groups"]
        finally:
            broker.stop()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert stats["groups"]["g"]["skipped"] == {
        f"{TOPIC}/0": {"count": first - 1, "ranges": [[1, first]]}
    }
    assert other["groups"]["h"]["skipped"] == {
        f"{TOPIC}/0": {"count": first, "ranges": [[0, first]]}
    }
    assert (summary["g"]["skipped_count"], summary["h"]["skipped_count"]) == (first - 1, first)
    assert f"offsets 1 to {first - 1} of one/0 were removed by retention" in caplog.text
    assert caplog.text.count("removed by retention") == 2
    text = render_stats(stats)
    assert (
        f"one/0: {first - 1} removed by retention before consumed (offsets 1..{first - 1})" in text
    )


def test_a_group_within_retention_reports_no_skip(url: str) -> None:
    """Control: committed offsets inside the retained range, nothing is reported."""
    with raw(url) as a:
        a.call("send", topic=TOPIC, body=b"m")
        a.call("join", group="g", consumer="a", topics=[TOPIC], session_timeout_ms=5000)
        a.call("pull", topic=TOPIC, queue_id=0, offset=0, group="g", consumer="a")
        stats = a.call("stats", group="g")
        summary = a.call("stats")["groups"]
    assert stats["groups"] == {} and summary == {}  # (no commit, no skip: not listed)


@pytest.mark.parametrize("damaged", [False, True])
def test_a_broker_starts_on_a_store_with_junk_offsets_and_no_topics_file(
    store_dir: Path, damaged: bool
) -> None:
    """Junk in consumers/*.json (the groups' and the mover's) and topics.json gone: the
    broker starts, serves the messages, the group reads again from what is left of its
    offsets (at least once). Control: the same store undamaged."""
    broker = BrokerThread(store_dir).start()
    try:
        with raw(broker.urls[0]) as a:
            for body in (b"m0", b"m1", b"m2"):
                a.call("send", topic=TOPIC, body=body)
            a.call("join", group="g", consumer="a", topics=[TOPIC], session_timeout_ms=5000)
            a.call("commit_offset", group="g", consumer="a", topic=TOPIC, queue_id=0, offset=2)
    finally:
        broker.stop()
    if damaged:
        (store_dir / "consumers" / "g.json").write_bytes(b"\xff{junk")
        (store_dir / "consumers" / "equeue.mover.json").write_text('{"xxh64": 1}')
        (store_dir / "topics.json").unlink()
    broker = BrokerThread(store_dir).start()
    try:
        problems = broker.store.recovery.problems
        with raw(broker.urls[0]) as a:
            topics = a.call("topics")
            committed = a.call("committed_offset", group="g", topic=TOPIC, queue_id=0)
            pulled = a.call("pull", topic=TOPIC, queue_id=0, offset=0)
    finally:
        broker.stop()
    assert [unpack_message(m, "t").body for m in pulled[0]] == [b"m0", b"m1", b"m2"]
    if damaged:
        # rebuilt from the queue directories: the empty retry topic had none (a join
        # makes it again)
        assert topics == [TOPIC]
        assert committed is None  # set aside: the group reads from the start again
        assert any("consumers/g.json" in p for p in problems)
        assert any("topics.json is missing" in p for p in problems)
    else:
        assert (topics, committed, problems) == ([retry_topic("g"), TOPIC], 2, [])


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
def test_tcp_connections_have_keepalive_and_unix_ones_need_none(
    store_dir: Path, event_loop: str
) -> None:
    # reviewg F8: a TCP peer that vanished without a FIN or RST (a network cut, a paused
    # VM) must not hold its max_connections place and held pulls until a restart.
    pytest.importorskip(event_loop)
    listen = ["tcp://127.0.0.1:0", f"unix:{store_dir / 'b.sock'}"]
    with BrokerThread(store_dir, listen=listen, event_loop=event_loop) as running:
        tcp_url = next(u for u in running.urls if u.startswith("tcp://"))
        with raw(tcp_url) as tcp, raw(f"unix:{store_dir / 'b.sock'}") as unix:
            tcp.call("ping")
            unix.call("ping")
            sockets = [
                conn.transport.get_extra_info("socket")
                for conn in running.broker.connections
                if conn.transport is not None
            ]
            assert sorted(sock.family for sock in sockets) == [socket.AF_UNIX, socket.AF_INET]
            assert keepalive_of(running) == [(1, 60, 10, 6)]  # the TCP one
            (unix_sock,) = (sock for sock in sockets if sock.family == socket.AF_UNIX)
            assert unix_sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0


def test_a_nack_after_the_group_moved_its_offset_back_is_retried_again(url: str) -> None:
    # fb07320 made a repeat nack of one message no second copy; review5 F3: a group that
    # resets its offset to reprocess, and fails the message again, must get its retry
    with raw(url) as a:
        a.call("join", group="g", consumer="a", topics=[TOPIC], session_timeout_ms=5000)
        sent = a.call("send", topic=TOPIC, body=b"m")
        nack = {"group": "g", "consumer": "a", "message_id": sent[0], "delay_ms": 0}

        def copies() -> int:
            return len(a.call("pull", topic=retry_topic("g"), queue_id=0, offset=0)[0])

        a.call("nack", **nack)
        a.call("nack", **nack)  # a repeat (the control): no second copy
        assert copies() == 1
        commit = {"group": "g", "consumer": "a", "topic": TOPIC, "queue_id": 0}
        a.call("commit_offset", **commit, offset=1)  # processed
        a.call("nack", **nack)
        assert copies() == 1  # still a repeat: nothing moved back
        a.call("commit_offset", **commit, offset=0)  # the group resets to reprocess it
        a.call("nack", **nack)
        assert copies() == 2
        assert a.call("stats")["retry"]["nacked_again"] == 2
