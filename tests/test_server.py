"""The broker answers every op of equeue/protocol/ops.py over a real Unix socket, as the
store would; errors come back as the store's class names and the connection stays."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_helpers import Raw, raw, short_home

from equeue import MessageStore
from equeue.errors import EQueueError
from equeue.protocol import pullcols
from equeue.protocol.frames import PROTOCOL_VERSION, encode
from equeue.protocol.ops import OPS
from equeue.protocol.records import (
    unpack_message,
    unpack_pull_result,
    unpack_send_columns,
    unpack_send_result,
)
from equeue.server import BrokerThread

home = pytest.fixture(short_home, name="home")


@pytest.fixture
def broker(home: Path) -> Iterator[BrokerThread]:
    with BrokerThread(home / "store") as running:
        yield running


def test_every_op_round_trips(broker: BrokerThread) -> None:
    url = broker.urls[0]
    assert url == f"unix:{broker.store.path / 'broker.sock'}"
    seen: set[str] = set()
    with raw(url) as c:
        assert c.welcome["version"] == PROTOCOL_VERSION
        assert c.welcome["limits"]["max_in_flight"] == 1024

        def call(op: str, **args: object) -> Any:
            seen.add(op)
            return c.call(op, **args)

        assert call("ping") is None
        assert call("create_topic", topic="t", queue_count=2) is None
        assert call("topics") == ["t"]
        assert call("deleted_topics") == {}  # protocol version 5
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
        columns = pullcols.unpack(call("pull_columns", topic="t", queue_id=1, offset=0), "test")
        assert columns == pulled  # protocol version 3: the same pull, in columns
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
        # protocol version 4's page of it: the messages, and nil (all there is)
        keyed, rest = call("query_by_key_page", topic="t", key="k", before=None)
        assert [unpack_message(m, "test").body for m in keyed] == [b"one"] and rest is None
        assert call("offset_for_time", topic="t", queue_id=1, timestamp=0) == 0
        assert call("offset_for_time", topic="t", queue_id=1, timestamp=time.time() + 60) == 3
        assert call("committed_offset", group="g", topic="t", queue_id=1) is None
        assert call("commit_offset", group="g", topic="t", queue_id=1, offset=2) is None
        assert call("committed_offset", group="g", topic="t", queue_id=1) == 2
        stats = call("stats")
        assert isinstance(stats, dict)
        assert stats["connections"] == 1 and stats["sends"] == 3
        assert [x["client"] for x in stats["clients"]] == ["test"]
        assert stats["groups"]["g"] == {"lag": 1, "queue_count": 1, "skipped_count": 0}
        assert stats["groups_omitted"] == 0 and stats["coordinator_omitted"] == 0
        # protocol version 5: one group's detail
        assert call("stats", group="g")["groups"]["g"]["queues"]["t/1"] == {
            "committed": 2, "end": 3, "lag": 1,
        }  # fmt: skip
        # protocol version 2's batch of bodies, answered in columns
        columns = call("send_bodies", topic="u", bodies=[b"a", b"b", b"c"])
        sent = unpack_send_columns(columns, "test")
        assert [(r.topic, r.queue_offset) for r in sent] == [("u", 0), ("u", 0), ("u", 0)]
        assert [call("get", message_id=r.message_id)[9] for r in sent] == [b"a", b"b", b"c"]
        broker.store.delete_topic("u")  # (the broker's store: on the loop's thread's lock)
        assert call("deleted_topics") == broker.store.deleted_topics() != {}
        # protocol version 5: a group deleted (docs/protocol.md, "Deleting a group")
        assert call("commit_offset", group="d", topic="t", queue_id=1, offset=1) is None
        assert call("delete_group", group="d") == {"group": "d", "offsets": 1, "topics": []}
        assert call("committed_offset", group="d", topic="t", queue_id=1) is None
        # protocol version 6: a held pull cancelled (tests/test_cancel_pull.py)
        assert call("cancel_pull", request_id=10**6) is False
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


def test_stopping_answers_held_pulls_then_closes_and_removes_the_socket(home: Path) -> None:
    running = BrokerThread(home / "s").start()
    c = Raw(running.urls[0])
    try:
        c.call("create_topic", topic="t", queue_count=1)
        held = c.request("pull", topic="t", queue_id=0, offset=0, wait_ms=600_000)
        c.call("ping")  # the pull is held by now
        stopper = threading.Thread(target=running.stop)
        stopper.start()
        assert c.recv() == [held, 0, [[], 0]]  # answered with what there is
        # protocol version 6: the last frame says that nothing unanswered was read
        rid, status, error = c.recv()
        assert (rid, status, error["code"]) == (0, 1, "BrokerStoppingError")
        with pytest.raises(ConnectionError):
            c.recv()
        stopper.join(30)
        assert not stopper.is_alive()
    finally:
        c.close()
    assert not (home / "s" / "broker.sock").exists()
    with MessageStore.open(home / "s") as again:  # closed: the lock is free
        assert again.topics() == ["t"]


def test_a_store_handle_the_broker_cannot_serve_is_refused(home: Path) -> None:
    from equeue import StoreConfig
    from equeue.errors import ConfigError

    with (
        MessageStore.open(home / "s", StoreConfig(flush="sync")) as store,
        pytest.raises(ConfigError, match="flush='sync'"),
    ):
        BrokerThread(store)
    with MessageStore.open(home / "s") as store:
        with (
            MessageStore.open(home / "s", read_only=True) as reader,
            pytest.raises(ConfigError, match="read-only"),
        ):
            BrokerThread(reader)
        with BrokerThread(store, flush="sync") as running, raw(running.urls[0]) as c:
            c.call("send", topic="t", body=b"x")
        assert store.queue_range("t", 0)[1] + store.queue_range("t", 1)[1] >= 1
        store.send("t", b"still mine")  # the caller's handle stays open after the broker


def test_group_ops_reach_the_coordinator_and_guard_pulls_and_commits(broker: BrokerThread) -> None:
    with raw(broker.urls[0]) as a, raw(broker.urls[0]) as b:
        a.call("create_topic", topic="g", queue_count=2)
        sent = a.call("send", topic="g", body=b"m", queue_id=0)
        first = a.call("join", group="grp", consumer="a", topics=["g"])
        assert sorted(map(tuple, first["assignment"])) == [
            ("equeue.retry.grp", 0),
            ("g", 0),
            ("g", 1),
        ]
        b.call("join", group="grp", consumer="b", topics=["g"])
        # a still holds every queue until it applies the new generation
        refused = b.error("pull", topic="g", queue_id=0, offset=0, group="grp", consumer="b")
        assert refused["code"] == "GroupError"
        assert b.error("commit_offset", group="grp", topic="g", queue_id=0, offset=1,
                       consumer="b")["code"] == "GroupError"  # fmt: skip
        pulled = a.call("pull", topic="g", queue_id=0, offset=0, group="grp", consumer="a")
        assert [m[9] for m in pulled[0]] == [b"m"]
        assert a.call("nack", group="grp", consumer="a", message_id=sent[0], delay_ms=0) is None
        assert a.call("commit_offset", group="grp", topic="g", queue_id=0, offset=1,
                      consumer="a") is None  # fmt: skip
        beat = a.call("heartbeat", group="grp", consumer="a")
        a.call("heartbeat", group="grp", consumer="a", generation=beat["generation"])
        assigned = b.call("heartbeat", group="grp", consumer="b")["assignment"]
        assert assigned and all(tuple(q) not in map(tuple, beat["assignment"]) for q in assigned)
        stats = a.call("stats", group="grp")
        assert set(stats["coordinator"]["grp"]["members"]) == {"a", "b"}
        assert stats["groups"]["grp"]["queues"]["g/0"]["committed"] == 1
        assert a.call("leave", group="grp", consumer="a") is None
        assert a.error("heartbeat", group="grp", consumer="a")["code"] == "GroupError"
    assert (
        broker.store.queue_range("equeue.retry.grp", 0)[1]
        + sum(
            broker.store.queue_range(t, 0)[1]
            for t in broker.store.topics()
            if t.startswith("equeue.delay")
        )
        >= 1
    )  # the nacked message went to a retry or delay queue


def test_status_command_prints_the_stats(broker: BrokerThread) -> None:
    import json
    import subprocess
    import sys

    with raw(broker.urls[0]) as c:
        c.call("send", topic="st", body=b"x", queue_id=0)
        c.call("commit_offset", group="sg", topic="st", queue_id=0, offset=0)
    command = [sys.executable, "-m", "equeue", "serve", str(broker.store.path), "--status"]
    shown = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert "connections: 1" in shown.stdout and "group sg: lag 1 over 1 queues" in shown.stdout
    one = subprocess.run([*command, "--status-group", "sg"], capture_output=True, text=True)
    assert "  st/0: committed 0 end 1 lag 1" in one.stdout, one.stderr
    as_json = subprocess.run([*command, "--json"], capture_output=True, text=True, timeout=60)
    stats = json.loads(as_json.stdout)
    assert stats["groups"]["sg"] == {"lag": 1, "queue_count": 1, "skipped_count": 0}
    assert stats["sends"] >= 1 and "sends_per_s" in stats["rates"]
    missing = subprocess.run(
        [*command[:-2], str(broker.store.path.parent / "none"), "--status"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    # a usage error (exit 2, as the inspector's), not a socket that refused to connect
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "no store or broker socket at" in missing.stderr
    assert "cannot connect" not in missing.stderr


READER = """
import sys
from equeue import MessageStore
store = MessageStore.open(sys.argv[1], read_only=True)
got = [m.body for m in store.pull("ro", 0, 0, 100).messages]
print("READY", len(got), flush=True)
offset = len(got)
while len(got) < 10:
    result = store.pull("ro", 0, offset, 100, wait=20.0)
    if not result.messages:
        break
    got += [m.body for m in result.messages]
    offset = result.next_offset
print(b",".join(got).decode(), flush=True)
"""


def test_a_read_only_handle_in_another_process_follows_the_broker(broker: BrokerThread) -> None:
    import subprocess
    import sys

    with raw(broker.urls[0]) as c:
        c.call("create_topic", topic="ro", queue_count=1)
        for n in range(5):
            c.call("send", topic="ro", body=b"m%d" % n)
        reader = subprocess.Popen(
            [sys.executable, "-c", READER, str(broker.store.path)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert reader.stdout is not None
            assert reader.stdout.readline().split() == ["READY", "5"]
            c.call("send_batch", topic="ro", messages=[{"body": b"m%d" % n} for n in range(5, 10)])
            out, _ = reader.communicate(timeout=60)
        finally:
            if reader.poll() is None:
                reader.kill()
                reader.wait()
    assert out.strip() == ",".join(f"m{n}" for n in range(10))


def test_a_half_closed_client_still_gets_its_deferred_answers(home: Path) -> None:
    import socket as socket_module

    with BrokerThread(home / "s", flush="sync") as running:
        c = Raw(running.urls[0])
        try:
            c.call("create_topic", topic="t", queue_count=1)
            held = c.request("pull", topic="t", queue_id=0, offset=0, wait_ms=300)
            sends = [c.request("send", topic="u", body=b"%d" % n) for n in range(50)]
            c.sock.shutdown(socket_module.SHUT_WR)  # all sent: now only reading
            answers = c.answers(51)
            assert all(answers[rid][0] == 0 for rid in sends)
            assert answers[held] == (0, [[], 0])  # at the half-close (its wait_ms: 300 ms)
            with pytest.raises(ConnectionError):
                c.recv()  # then the broker closes
        finally:
            c.close()


@pytest.mark.parametrize("what", ["file", "directory"])
def test_status_names_a_broker_sock_that_is_no_socket(tmp_path: Path, what: str) -> None:
    from equeue.errors import BrokerError
    from equeue.server.status import fetch_stats

    MessageStore.open(tmp_path / "s").close()
    sock = tmp_path / "s" / "broker.sock"
    if what == "file":
        sock.write_bytes(b"")
    else:
        sock.mkdir()
    with pytest.raises(BrokerError, match=r"broker\.sock is not a socket"):
        fetch_stats(str(tmp_path / "s"), [], None)


def test_status_of_a_killed_brokers_store_says_no_broker_serves_it(tmp_path: Path) -> None:
    """Review 37a L1: a SIGKILLed broker leaves its socket; --status said only "cannot
    connect ... Connection refused" after 6 attempts. The store's LOCK, held by no one,
    says there is no broker; a running broker (the control) is asked as before."""
    import signal
    import subprocess
    import sys

    from equeue.errors import BrokerError
    from equeue.server.status import fetch_stats

    home = Path(tempfile.mkdtemp(dir="/tmp", prefix="eq-status-"))  # a short socket path
    try:
        store = home / "s"
        broker = subprocess.Popen(
            [sys.executable, "-m", "equeue", "serve", str(store), "--quiet"],
            stdout=subprocess.PIPE,
        )
        assert broker.stdout is not None
        assert broker.stdout.readline().decode().startswith("listening on ")
        assert fetch_stats(str(store), [], None)["connections"] == 1  # the control
        broker.send_signal(signal.SIGKILL)
        broker.wait(30)
        broker.stdout.close()
        assert (store / "broker.sock").exists()  # left behind
        with pytest.raises(BrokerError, match=r"no broker is serving .*LOCK is not held"):
            fetch_stats(str(store), [], None)
        with MessageStore.open(store):  # held by a writer: asked, and refused to connect
            with pytest.raises(EQueueError) as info:
                fetch_stats(str(store), [], None)
            assert "no broker is serving" not in str(info.value)
    finally:
        shutil.rmtree(home, ignore_errors=True)
