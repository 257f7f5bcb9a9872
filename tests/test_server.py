"""The broker answers every op of equeue/protocol/ops.py over a real Unix socket, as the
store would; errors come back as the store's class names and the connection stays."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_helpers import Raw, raw, short_dir

from equeue import MessageStore
from equeue.protocol.frames import encode
from equeue.protocol.ops import OPS
from equeue.protocol.records import unpack_message, unpack_pull_result, unpack_send_result
from equeue.server import BrokerThread


@pytest.fixture
def home() -> Iterator[Path]:
    directory = short_dir()
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def broker(home: Path) -> Iterator[BrokerThread]:
    with BrokerThread(home / "store") as running:
        yield running


def test_every_op_round_trips(broker: BrokerThread) -> None:
    url = broker.urls[0]
    assert url == f"unix:{broker.store.path / 'broker.sock'}"
    seen: set[str] = set()
    with raw(url) as c:
        assert c.welcome["version"] == 1
        assert c.welcome["limits"]["max_in_flight"] == 1024

        def call(op: str, **args: object) -> Any:
            seen.add(op)
            return c.call(op, **args)

        assert call("ping") is None
        assert call("create_topic", topic="t", queue_count=2) is None
        assert call("topics") == ["t"]
        assert call("queue_ids", topic="t") == [0, 1]
        first = unpack_send_result(
            call("send", topic="t", body=b"one", tag="a", key="k", properties={"p": "v"}, code=7,
                 queue_id=1),
            "test",
        )  # fmt: skip
        assert (first.topic, first.queue_id, first.queue_offset) == ("t", 1, 0)
        batch = call("send_batch", topic="t", messages=[
            {"body": b"two", "queue_id": 1, "tag": "b"}, {"body": b"three", "queue_id": 1}
        ])  # fmt: skip
        assert [unpack_send_result(r, "test").queue_offset for r in batch] == [1, 2]
        assert call("queue_range", topic="t", queue_id=1) == [0, 3]
        pulled = unpack_pull_result(call("pull", topic="t", queue_id=1, offset=0), "test")
        assert [m.body for m in pulled.messages] == [b"one", b"two", b"three"]
        assert pulled.next_offset == 3
        tagged = unpack_pull_result(
            call("pull", topic="t", queue_id=1, offset=0, tags=["b"], max_count=5), "test"
        )
        assert [m.body for m in tagged.messages] == [b"two"]
        message = unpack_message(call("get", message_id=first.message_id), "test")
        assert (message.body, message.key, message.properties, message.code) == (
            b"one", "k", {"p": "v"}, 7,
        )  # fmt: skip
        keyed = call("query_by_key", topic="t", key="k")
        assert [unpack_message(m, "test").body for m in keyed] == [b"one"]
        assert call("offset_for_time", topic="t", queue_id=1, timestamp=0) == 0
        assert call("offset_for_time", topic="t", queue_id=1, timestamp=time.time() + 60) == 3
        assert call("committed_offset", group="g", topic="t", queue_id=1) is None
        assert call("commit_offset", group="g", topic="t", queue_id=1, offset=2) is None
        assert call("committed_offset", group="g", topic="t", queue_id=1) == 2
        stats = call("stats")
        assert isinstance(stats, dict)
        assert stats["connections"] == 1 and stats["sends"] == 3
        assert stats["groups"]["g"]["topics"]["t"]["queues"]["1"] == {
            "committed": 2, "end": 3, "lag": 1,
        }  # fmt: skip
    group_ops = {"join", "heartbeat", "leave", "nack"}  # test_server_groups.py
    assert seen | group_ops == set(OPS)
    store = broker.store
    assert store.queue_range("t", 1) == (0, 3)


def test_store_errors_come_back_by_class_and_the_connection_stays(broker: BrokerThread) -> None:
    with raw(broker.urls[0]) as c:
        c.call("create_topic", topic="t", queue_count=1)
        assert c.error("queue_range", topic="nope", queue_id=0)["code"] == "TopicNotFoundError"
        assert c.error("pull", topic="t", queue_id=5, offset=0)["code"] == "QueueNotFoundError"
        assert c.error("get", message_id="0" * 24)["code"] == "MessageNotFoundError"
        assert c.error("send", topic="bad/name", body=b"x")["code"] == "InvalidMessageError"
        assert c.error("send", topic="t", body=b"x", properties={"a": 1})["code"] in (
            "InvalidTypeError", "InvalidMessageError",
        )  # fmt: skip
        big = b"x" * (4 * 1024 * 1024 + 1)
        assert c.error("send", topic="t", body=big)["code"] == "MessageTooLargeError"
        assert c.error("pull", topic="t", queue_id=0, offset=0, tags=[])["code"] == (
            "InvalidMessageError"
        )
        assert c.error("commit_offset", group="g", topic="t", queue_id=0, offset=9)["code"] == (
            "InvalidMessageError"
        )
        assert c.error("pull", topic="t", queue_id=0, offset=0, wait_ms=10**12)["code"] == (
            "InvalidMessageError"
        )
        assert c.call("ping") is None
    assert broker.store.queue_range("t", 0) == (0, 0)


def test_protocol_errors_close_only_that_connection(broker: BrokerThread) -> None:
    url = broker.urls[0]
    with raw(url) as good:
        for bad in (
            [[1, "nope", {}]],
            [[1, "ping", {"extra": 1}]],
            [[1, "send", {"topic": "t"}]],
            [[1, "send", {"topic": "t", "body": "not bytes"}]],
            [[0, "ping", {}]],
            [{"not": "a request"}],
            [[1, "send_batch", {"topic": "t", "messages": [{"body": b"x", "topic": "u"}]}]],
            [[1, "send_batch", {"topic": "t", "messages": [b"x"]}]],
        ):
            with raw(url) as c:
                assert c.call("ping") is None
                c.send_raw(encode(bad[0]))
                assert c.closed_with()["code"] == "ProtocolError"
            assert good.call("ping") is None
    assert "t" not in broker.store.topics()  # nothing the bad requests carried was stored


def test_long_poll_is_held_and_answered_by_a_later_send(broker: BrokerThread) -> None:
    url = broker.urls[0]
    with raw(url) as waiter, raw(url) as sender:
        sender.call("create_topic", topic="t", queue_count=1)
        held = waiter.request("pull", topic="t", queue_id=0, offset=0, wait_ms=20_000, tags="b")
        waiter.sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            waiter.recv()  # held: nothing there
        waiter.sock.settimeout(20)
        sender.call("send", topic="t", body=b"skip", tag="a")  # another tag: still held
        assert sender.call("stats")["held_pulls"] == 1
        sender.call("send", topic="t", body=b"take", tag="b")
        rid, status, payload = waiter.recv()
        assert (rid, status) == (held, 0)
        result = unpack_pull_result(payload, "test")
        assert [m.body for m in result.messages] == [b"take"] and result.next_offset == 2
        expired = waiter.request("pull", topic="t", queue_id=0, offset=2, wait_ms=200)
        rid, status, payload = waiter.recv()  # the deadline: answered empty
        assert (rid, status, payload) == (expired, 0, [[], 2])
        assert sender.call("stats")["held_pulls"] == 0


def test_socket_file_rules(home: Path) -> None:
    store_path = home / "store"
    MessageStore.open(store_path).close()
    sock = store_path / "broker.sock"
    sock.write_text("not a socket")
    with pytest.raises(Exception, match="not a socket"):
        BrokerThread(store_path).start()
    sock.unlink()
    sock.symlink_to(home / "elsewhere")
    with pytest.raises(Exception, match="symlink"):
        BrokerThread(store_path).start()
    sock.unlink()
    import socket as socket_module

    stale = socket_module.socket(socket_module.AF_UNIX)
    stale.bind(str(sock))  # a socket nobody listens on: a dead broker's
    stale.close()
    with BrokerThread(store_path) as running:
        assert (sock.stat().st_mode & 0o777) == 0o600
        with raw(running.urls[0]) as c:
            assert c.call("ping") is None
        with pytest.raises(Exception, match="another process is listening"):
            BrokerThread(home / "other", listen=[running.urls[0]]).start()
    assert not sock.exists()


def test_pipelined_answers_keep_coming(broker: BrokerThread) -> None:
    with raw(broker.urls[0]) as c:
        count = 2000
        c.send_raw(b"".join(encode([i + 1, "send", {"topic": "p", "body": b"%d" % i}])
                            for i in range(count)))  # fmt: skip
        answers = c.answers(count)
        assert all(status == 0 for status, _ in answers.values())
    store = broker.store
    assert sum(store.queue_range("p", q)[1] for q in store.queue_ids("p")) == count


def test_thread_runner_stops_cleanly(home: Path) -> None:
    running = BrokerThread(home / "s").start()
    url = running.urls[0]
    c = Raw(url)
    stopper = threading.Thread(target=running.stop)
    stopper.start()
    stopper.join(30)
    assert not stopper.is_alive()
    c.close()
    assert not (home / "s" / "broker.sock").exists()
