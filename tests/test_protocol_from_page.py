"""docs/protocol.md held to its claim that a client can be written from the page alone:
tests/pageclient.py (stdlib and msgpack, no equeue import) against a real ``equeue
serve`` process on its Unix socket, each promise of the page checked on the wire, and
what it sends read back by equeue's own client and a read-only MessageStore."""

from __future__ import annotations

import math
import re
import select
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from client_helpers import BrokerProcess, temporary_broker
from pageclient import (
    OP_VERSIONS,
    PARENTS,
    Closed,
    Message,
    PageClient,
    PageError,
    PageProtocolError,
    frame,
)

import equeue
from equeue import MessageStore

MAX_FRAME = 1 << 20
LIMIT_FLAGS = {
    "max_frame_bytes": MAX_FRAME,
    "max_in_flight": 4,
    "max_connections": 64,
    "max_batch_messages": 100,
    "max_pull_count": 50,
}
WAIT_S = 10.0  # a bound on every answer awaited, not a speed


@pytest.fixture(scope="module", name="broker")
def broker_fixture() -> Iterator[BrokerProcess]:
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in LIMIT_FLAGS.items()]
    with temporary_broker(*flags) as running:
        yield running


def page_client(broker: BrokerProcess, **kwargs: Any) -> PageClient:
    return PageClient(broker.url.removeprefix("unix:"), timeout_s=WAIT_S, **kwargs)


def held_pull(topic: str, offset: int = 0, **more: Any) -> dict[str, Any]:
    """A pull of queue 0 the broker holds (wait_ms 20 s: longer than any test waits)."""
    return {"topic": topic, "queue_id": 0, "offset": offset, "wait_ms": 20_000, **more}


def connection_error(client: PageClient, request_id: int) -> PageError:
    """The error the broker closed the connection with; fails if the connection stays."""
    with pytest.raises(PageError) as info:
        client.wait(request_id, WAIT_S)
    assert client.read_end(), "the connection stayed open"
    assert info.value.listed, info.value.code
    return info.value


def assert_same_message(ours: Message, theirs: Any) -> None:
    """A pageclient Message against an equeue Message, field for field."""
    for field in (
        "message_id",
        "topic",
        "queue_id",
        "queue_offset",
        "position",
        "tag",
        "key",
        "properties",
        "code",
        "body",
        "created_ns",
        "stored_ns",
    ):
        assert getattr(ours, field) == getattr(theirs, field), field


def test_the_welcome_chooses_the_highest_common_version_and_carries_the_limits(
    broker: BrokerProcess,
) -> None:
    with page_client(broker) as client:
        assert client.version == 6
        assert client.server.startswith("equeue ")
        for name, value in LIMIT_FLAGS.items():
            assert client.limits[name] == value, name
        # the store's own limits: a body fits a frame with room to spare (page: "no broker
        # of this package takes a body within 2 KiB of max_frame_bytes")
        assert 0 < client.limits["max_message_size"] <= MAX_FRAME - 2048
        assert client.limits["max_properties_size"] == 32 * 1024
    for offered, chosen in (([1, 2], 2), ([3], 3), ([1, 99], 1), ([6, 4, 5], 6)):
        with page_client(broker, versions=offered) as client:
            assert client.version == chosen
    # "Keys the broker does not know are ignored"; "absent and nil alike are 'no token'"
    with page_client(broker, hello=False) as client:
        client.hello({"versions": [3], "later_key": [1, 2], "token": None})
        assert client.version == 3
        client.ping()


def test_a_message_sent_by_the_page_client_reads_back_in_equeue_and_the_store(
    broker: BrokerProcess,
) -> None:
    properties = {"trace": "a-1", "é": "ü" * 10}
    with page_client(broker) as client:
        client.create_topic("from_page", 3)
        assert "from_page" in client.topics()
        assert client.queue_ids("from_page") == [0, 1, 2]
        one = client.send(
            "from_page", b"\x00body", tag="t1", key="k", properties=properties, code=-7, queue_id=2
        )
        batch = client.send_batch(
            "from_page",
            [{"body": b"b0", "key": "k"}, {"body": b"", "tag": "t2", "queue_id": 1}],
        )
        bodies = client.send_bodies("from_page", [b"c0", b"c1", b"c2"])
        sent = [one, *batch, *bodies]
        got = [client.get(result.message_id) for result in sent]
        ranges = [client.queue_range("from_page", queue_id) for queue_id in range(3)]
    assert (one.topic, one.queue_id, one.queue_offset) == ("from_page", 2, 0)
    assert [r.queue_id for r in batch][1] == 1
    assert [m.body for m in got] == [b"\x00body", b"b0", b"", b"c0", b"c1", b"c2"]
    assert (got[0].tag, got[0].key, got[0].properties, got[0].code) == ("t1", "k", properties, -7)
    # omitted arguments take the page's defaults: no tag, no key, no properties, code 0
    assert (got[3].tag, got[3].key, got[3].properties, got[3].code) == ("", None, {}, 0)
    for result, message in zip(sent, got, strict=True):
        assert (result.message_id, result.topic, result.queue_id) == (
            message.message_id,
            message.topic,
            message.queue_id,
        )
        assert (result.queue_offset, result.position) == (message.queue_offset, message.position)
        assert math.isclose(result.stored_at, message.stored_ns / 1e9, abs_tol=1e-6)
        # a message id is 24 hex digits, the last 16 its log position ("Pull columns")
        assert message.message_id[8:] == f"{message.position:016x}"
    with equeue.connect(broker.url) as theirs:
        for message in got:
            assert_same_message(message, theirs.get(message.message_id))
    with MessageStore.open(broker.store, read_only=True) as store:
        for message in got:
            assert_same_message(message, store.get(message.message_id))
        assert [store.queue_range("from_page", q) for q in range(3)] == ranges
    assert sum(end for _, end in ranges) == len(sent)


def test_a_message_sent_by_equeue_reads_back_through_the_page_client(
    broker: BrokerProcess,
) -> None:
    with equeue.connect(broker.url) as theirs:
        theirs.create_topic("from_equeue", 2)
        before = time.time() - 60
        sent = [
            theirs.send("from_equeue", b"m%d" % i, tag="even" if i % 2 == 0 else "odd",
                        key="same", properties={"i": str(i)} if i % 3 == 0 else None,
                        code=i, queue_id=0)
            for i in range(6)
        ]  # fmt: skip
        expected = [theirs.get(result.message_id) for result in sent]
    with page_client(broker) as client:
        pulled = client.pull("from_equeue", 0, 0)
        assert pulled.next_offset == 6
        for ours, message in zip(pulled.messages, expected, strict=True):
            assert_same_message(ours, message)
        assert client.pull_columns("from_equeue", 0, 0) == pulled
        odd = client.pull_columns("from_equeue", 0, 0, tags=["odd"], max_count=2)
        assert [m.queue_offset for m in odd.messages] == [1, 3]
        assert odd.next_offset == 4
        assert client.pull("from_equeue", 0, 0, tags="even").messages[1] == pulled.messages[2]
        assert client.pull("from_equeue", 0, 2, max_count=1).messages == [pulled.messages[2]]
        # max_bytes: "holds the first message whatever its size"
        assert len(client.pull("from_equeue", 0, 0, max_bytes=1).messages) == 1
        assert client.pull("from_equeue", 0, 99).messages == []
        assert client.pull("from_equeue", 0, 99).next_offset == 6
        assert client.get(sent[4].message_id) == pulled.messages[4]
        newest_first = client.query_by_key("from_equeue", "same", limit=4)
        assert newest_first == pulled.messages[:1:-1]
        paged: list[Message] = []
        before_position = None
        for _ in range(10):
            page, before_position = client.query_by_key_page(
                "from_equeue", "same", limit=6 - len(paged), before=before_position
            )
            paged += page
            if before_position is None:
                break
        assert paged == pulled.messages[::-1]
        assert client.queue_range("from_equeue", 0) == (0, 6)
        assert client.queue_range("from_equeue", 1) == (0, 0)
        assert client.offset_for_time("from_equeue", 0, before) == 0
        assert client.offset_for_time("from_equeue", 0, -5) == 0
        assert client.offset_for_time("from_equeue", 0, time.time() + 60) == 6
        stored_at = pulled.messages[3].stored_ns / 1e9
        assert client.offset_for_time("from_equeue", 0, stored_at) <= 3


def test_offsets_committed_on_either_side_are_read_on_the_other(broker: BrokerProcess) -> None:
    with page_client(broker) as client, equeue.connect(broker.url) as theirs:
        client.create_topic("offsets", 2)
        client.send_bodies("offsets", [b"x"] * 6)
        assert client.committed_offset("g1", "offsets", 0) is None
        client.commit_offset("g1", "offsets", 0, 2)
        assert client.committed_offset("g1", "offsets", 0) == 2
        assert theirs.committed_offset("g1", "offsets", 0) == 2
        theirs.commit_offset("g1", "offsets", 1, 3)
        assert client.committed_offset("g1", "offsets", 1) == 3
    with MessageStore.open(broker.store, read_only=True) as store:
        assert store.committed_offset("g1", "offsets", 0) == 2
        assert store.committed_offset("g1", "offsets", 1) == 3


def test_a_long_poll_is_held_and_later_requests_are_answered_before_it(
    broker: BrokerProcess,
) -> None:
    with page_client(broker) as client, equeue.connect(broker.url) as theirs:
        client.create_topic("held", 1)
        pull_id = client.request("pull", held_pull("held"))
        ping_id = client.request("ping")
        assert client.next_answer() == (ping_id, 0, None)  # the pull is not answered yet
        assert client.stats()["held_pulls"] >= 1
        result = theirs.send("held", b"wake", key="w")
        answer = client.wait(pull_id, WAIT_S)
        messages, next_offset = answer
        assert next_offset == 1
        assert messages[0][0] == result.message_id
        assert messages[0][9] == b"wake"


def test_cancel_pull_answers_the_held_pull_empty_first_then_true(broker: BrokerProcess) -> None:
    with page_client(broker) as client:
        client.create_topic("cancel", 1)
        client.send("cancel", b"one", tag="a", queue_id=0)
        args = held_pull("cancel", tags="b")
        pull_id = client.request("pull", args)
        client.ping()  # the pull was read and held before the cancel is sent
        cancel_id = client.request("cancel_pull", {"request_id": pull_id})
        # "Both answers leave in the same write, the pull's first"; next_offset past the
        # entry its tag filter skipped
        assert client.next_answer() == (pull_id, 0, [[], 1])
        assert client.next_answer() == (cancel_id, 0, True)
        assert client.cancel_pull(pull_id) is False  # answered already
        assert client.cancel_pull(10_000) is False  # never sent
        client.ping()


def test_past_max_in_flight_a_request_is_refused_with_its_id_and_the_connection_stays(
    broker: BrokerProcess,
) -> None:
    with page_client(broker) as client:
        client.create_topic("inflight", 1)
        args = held_pull("inflight")
        held = [client.request("pull", args) for _ in range(LIMIT_FLAGS["max_in_flight"])]
        ping_id = client.request("ping")
        with pytest.raises(PageError) as info:
            client.wait(ping_id, WAIT_S)
        assert (info.value.code, info.value.request_id) == ("LimitExceededError", ping_id)
        assert "max_in_flight" in info.value.message
        # cancel_pull is served past it
        assert [client.cancel_pull(pull_id) for pull_id in held] == [True] * len(held)
        assert [client.wait(pull_id, WAIT_S) for pull_id in held] == [[[], 0]] * len(held)
        client.ping()


STORE_REFUSALS: list[tuple[str, dict[str, Any], str]] = [
    ("pull", {"topic": "nowhere", "queue_id": 0, "offset": 0}, "TopicNotFoundError"),
    ("queue_range", {"topic": "nowhere", "queue_id": 0}, "TopicNotFoundError"),
    ("queue_range", {"topic": "refuse", "queue_id": 9}, "QueueNotFoundError"),
    ("send", {"topic": "a b", "body": b"x"}, "InvalidMessageError"),
    ("send", {"topic": "equeue.x", "body": b"x"}, "InvalidMessageError"),
    ("send_batch", {"topic": "refuse", "messages": [{"body": b"x"}] * 101}, "LimitExceededError"),
    ("create_topic", {"topic": "refuse", "queue_count": 1}, "ConfigError"),
    ("get", {"message_id": "ffffffff" + "0" * 16}, "MessageNotFoundError"),
    ("pull", {"topic": "refuse", "queue_id": 0, "offset": 0, "tags": []}, "InvalidMessageError"),
    ("offset_for_time", {"topic": "refuse", "queue_id": 0, "timestamp": math.nan},
     "InvalidMessageError"),
    ("commit_offset", {"group": "g", "topic": "refuse", "queue_id": 0, "offset": 9},
     "InvalidMessageError"),
    ("pull", {"topic": "refuse", "queue_id": 0, "offset": 0, "wait_ms": 86_400_001},
     "InvalidMessageError"),
    ("query_by_key", {"topic": "refuse", "key": "k", "limit": 0}, "InvalidMessageError"),
    ("create_topic", {"topic": "refuse2", "queue_count": 1025}, "InvalidMessageError"),
    ("send", {"topic": "refuse", "body": b"", "tag": "t" * 256}, "InvalidMessageError"),
    ("send", {"topic": "refuse", "body": b"", "code": 2**31}, "InvalidMessageError"),
    ("stats", {"group": ""}, "InvalidMessageError"),
    ("delete_group", {"group": "never-made"}, "GroupNotFoundError"),
]  # fmt: skip


def test_what_the_store_refuses_is_an_error_answer_and_the_connection_stays(
    broker: BrokerProcess,
) -> None:
    with page_client(broker) as client:
        client.create_topic("refuse", 2)
        too_large = client.limits["max_message_size"] + 1
        refusals = [
            *STORE_REFUSALS,
            ("send", {"topic": "refuse", "body": b"x" * too_large}, "MessageTooLargeError"),
        ]
        for op, args, code in refusals:
            request_id = client.request(op, args)
            with pytest.raises(PageError) as info:
                client.wait(request_id, WAIT_S)
            assert (info.value.code, info.value.request_id) == (code, request_id), op
            assert info.value.listed
        client.ping()
        assert client.queue_range("refuse", 0) == (0, 0)  # nothing stored
        assert "a b" not in client.topics() and "refuse2" not in client.topics()


PROTOCOL_ERRORS: list[tuple[str, bytes]] = [
    ("unknown op", frame([1, "no_such_op", {}])),
    ("missing argument", frame([1, "queue_range", {"topic": "t"}])),
    ("argument not taken", frame([1, "ping", {"x": 1}])),
    ("nil where not allowed", frame([1, "send", {"topic": "t", "body": b"x", "tag": None}])),
    ("negative uint", frame([1, "pull", {"topic": "t", "queue_id": -1, "offset": 0}])),
    ("str for bin", frame([1, "send", {"topic": "t", "body": "x"}])),
    ("args omitted", frame([1, "ping"])),
    ("request id 0", frame([0, "ping", {}])),
    ("not an array", frame({"ping": 1})),
    ("empty frame", struct.pack(">I", 0)),
    ("two objects", struct.pack(">I", 2) + b"\xc0\xc0"),
    ("bodies item not bin", frame([1, "send_bodies", {"topic": "t", "bodies": ["x"]}])),
    ("an extension type", frame([1, "send", {"topic": "t", "body": msgpack.ExtType(1, b"x")}])),
    ("a map key not str", frame([1, "send", {"topic": "t", "body": b"", "properties": {1: "a"}}])),
    ("a batch message not a map", frame([1, "send_batch", {"topic": "t", "messages": [b"x"]}])),
    ("a batch message with a topic",
     frame([1, "send_batch", {"topic": "t", "messages": [{"topic": "t", "body": b""}]}])),
    ("array past 2 x max_batch_messages",
     frame([1, "send_batch", {"topic": "t", "messages": [{"body": b""}] * 65537}])),
]  # fmt: skip


@pytest.mark.parametrize(("what", "data"), PROTOCOL_ERRORS, ids=[p[0] for p in PROTOCOL_ERRORS])
def test_a_protocol_error_is_sent_at_request_id_0_and_closes_the_connection(
    broker: BrokerProcess, what: str, data: bytes
) -> None:
    with page_client(broker) as client:
        client.send_raw(data)
        error = connection_error(client, 1)
        assert (error.code, error.request_id) == ("ProtocolError", 0), what


def test_a_frame_over_max_frame_bytes_is_refused_from_its_header(broker: BrokerProcess) -> None:
    with page_client(broker) as client:
        client.send_raw(struct.pack(">I", MAX_FRAME + 1))  # the body never sent
        error = connection_error(client, 1)
        assert (error.code, error.request_id) == ("FrameTooLargeError", 0)
        assert str(MAX_FRAME) in error.message
    with page_client(broker) as client:  # a frame of max_frame_bytes itself is read
        empty = len(msgpack.packb([1, "send", {"topic": "padded", "body": b""}]))
        body = b"x" * (MAX_FRAME - empty - 3)  # a bin32 head is 3 bytes longer than bin8's
        data = frame([1, "send", {"topic": "padded", "body": body}])
        assert len(data) == 4 + MAX_FRAME
        client.send_raw(data)
        with pytest.raises(PageError) as info:  # the store's own limit, an answer
            client.wait(1, WAIT_S)
        assert (info.value.code, info.value.request_id) == ("MessageTooLargeError", 1)
        client.next_id = 2
        with pytest.raises(PageProtocolError):  # the page client refuses to send more
            client.send("padded", body + b"x")
        client.ping()


@pytest.mark.parametrize("op", sorted(OP_VERSIONS))
def test_an_op_of_a_later_version_than_welcomed_closes_the_connection(
    broker: BrokerProcess, op: str
) -> None:
    args: dict[str, dict[str, Any]] = {
        "send_bodies": {"topic": "versions", "bodies": [b"x"]},
        "pull_columns": {"topic": "versions", "queue_id": 0, "offset": 0},
        "query_by_key_page": {"topic": "versions", "key": "k"},
        "deleted_topics": {},
        "delete_group": {"group": "never-made"},
        "cancel_pull": {"request_id": 1},
    }
    version = OP_VERSIONS[op]
    with page_client(broker, versions=[version]) as client:
        client.create_topic("versions", 1)
        request_id = client.request(op, args[op])
        try:
            client.wait(request_id, WAIT_S)
        except PageError as refusal:  # welcomed with its version: served (a store refusal)
            assert (refusal.code, refusal.request_id) == ("GroupNotFoundError", request_id)
        client.ping()
    with page_client(broker, versions=list(range(1, version))) as client:
        assert client.version == version - 1
        with pytest.raises(PageProtocolError):  # the page client refuses to send it
            client.request(op, args[op])
        error = connection_error(client, client.request_unchecked(op, args[op]))
        assert (error.code, error.request_id) == ("ProtocolError", 0)
        assert f"op '{op}' is of protocol version {version}" in error.message


BAD_HELLOS: list[tuple[str, Any]] = [
    ("not a map", [1, 2]),
    ("no versions", {"client": "c"}),
    ("empty versions", {"versions": []}),
    ("version 0", {"versions": [0]}),
    ("a str version", {"versions": [1, "2"]}),
    ("versions not an array", {"versions": 6}),
    ("a token not str", {"versions": [6], "token": 5}),
    ("a client name of 201", {"versions": [6], "client": "c" * 201}),
    ("a client name not str", {"versions": [6], "client": None}),
    ("no common version", {"versions": [7, 99]}),
]


@pytest.mark.parametrize(("what", "hello"), BAD_HELLOS, ids=[h[0] for h in BAD_HELLOS])
def test_a_bad_hello_is_answered_at_request_id_0_and_the_connection_closes(
    broker: BrokerProcess, what: str, hello: Any
) -> None:
    with page_client(broker, hello=False) as client:
        with pytest.raises(PageProtocolError):
            client.hello(hello)
        error = client.connection_error
        assert error is not None, what
        assert (error.code, error.request_id) == ("ProtocolError", 0), what
        assert client.read_end()


def test_a_hello_frame_over_64_kib_is_refused(broker: BrokerProcess) -> None:
    with page_client(broker, hello=False) as client:
        client.send_raw(struct.pack(">I", 64 * 1024 + 1))
        error = connection_error(client, 1)
        assert (error.code, error.request_id) == ("FrameTooLargeError", 0)
    with page_client(broker, hello=False) as client:  # 64 KiB itself is a hello
        hello = {"versions": [6], "client": "c", "padding": b""}
        empty = len(msgpack.packb(hello, use_bin_type=True))
        # a bin16 head is 1 byte longer than bin8's: the body is 64 KiB exactly
        hello["padding"] = b"\x00" * (64 * 1024 - empty - 1)
        assert len(frame(hello)) == 4 + 64 * 1024
        client.hello(hello)
        assert client.version == 6


def test_a_half_close_answers_the_held_pulls_and_then_the_broker_closes(
    broker: BrokerProcess,
) -> None:
    with page_client(broker) as client:
        client.create_topic("half", 1)
        client.send("half", b"there", queue_id=0)
        args = held_pull("half", offset=1)
        pull_id = client.request("pull", args)
        client.ping()
        client.sock.shutdown(socket.SHUT_WR)
        assert client.wait(pull_id, WAIT_S) == [[], 1]
        assert client.read_end()


def test_stats_has_the_keys_the_page_lists(broker: BrokerProcess) -> None:
    uints = (
        "connections",
        "in_flight",
        "buffered_bytes",
        "requests",
        "sends",
        "send_requests",
        "pulls",
        "errors",
        "held_pulls_moved",
        "bytes_in",
        "bytes_out",
        "held_pulls",
        "pulls_not_held",
        "held_filter_bytes",
        "flushes",
        "group_commit_waits",
        "group_commit_waits_full",
        "group_commit_overlapped",
        "group_commit_adds_in_c",
        "answers_written_directly",
        "busy_poll_starts",
        "busy_polls",
        "groups_omitted",
        "coordinator_omitted",
    )
    with page_client(broker) as client:
        stats = client.stats()
        for key in uints:
            assert type(stats[key]) is int and stats[key] >= 0, key
        assert stats["connections"] >= 1
        assert stats["flush"] in ("sync", "async", "os")
        assert type(stats["sends_per_flush"]) is float
        assert type(stats["uptime_s"]) is float
        assert all(type(u) is str for u in stats["listen"])
        assert all(type(name) is str for name in stats["rates"])
        assert all(name.endswith("_per_s") for name in stats["rates"])
        assert set(stats["retention"]) == {"retention_s", "max_store_bytes", "respects_consumers"}
        assert {"moved", "dead_lettered", "pending"} <= set(stats["retry"])
        assert {"where", "client", "in_flight", "buffered_bytes"} <= set(stats["clients"][0])
        assert "shm" not in stats  # without --shm
        # its own topic: this test ran only after the one that creates "offsets" (alone,
        # or on another xdist worker, TopicNotFoundError)
        client.create_topic("stats-topic", 1)
        client.send_bodies("stats-topic", [b"x"])
        client.commit_offset("stats-group", "stats-topic", 0, 1)
        detail = client.stats(group="stats-group")
        assert set(detail["groups"]) == {"stats-group"}
        assert detail["groups"]["stats-group"]["queues"]["stats-topic/0"]["committed"] == 1


def test_connection_fates_at_max_connections_and_at_the_hello_timeout() -> None:
    with temporary_broker("--max-connections=2", "--hello-timeout-ms=1000") as broker:
        path = broker.url.removeprefix("unix:")
        silent = PageClient(path, hello=False, timeout_s=WAIT_S)
        with pytest.raises(PageError) as info:  # "closed with a ProtocolError"
            silent.wait(1, WAIT_S)
        assert (info.value.code, info.value.request_id) == ("ProtocolError", 0)
        assert "hello" in info.value.message
        assert silent.read_end()
        silent.close()
        first = PageClient(path, timeout_s=WAIT_S)
        second = PageClient(path, timeout_s=WAIT_S)
        third = PageClient(path, hello=False, timeout_s=WAIT_S)
        # The broker answers and closes a connection past the limit without waiting for
        # its hello: wait for that close, so the hello's write fails (EPIPE) every time,
        # as it did under load (round 22's parallel run). The page: a client reads what
        # the broker wrote before it closed, also after its own write failed.
        closed = select.poll()
        closed.register(third.sock, select.POLLRDHUP)
        assert closed.poll(WAIT_S * 1000), "the broker kept a connection past the limit"
        with pytest.raises(PageProtocolError):
            third.hello({"versions": [6]})
        assert third.connection_error is not None
        assert (third.connection_error.code, third.connection_error.request_id) == (
            "LimitExceededError",
            0,
        )
        assert third.read_end()
        first.ping()
        second.ping()
        for client in (first, second, third):
            client.close()


def test_a_stopping_broker_ends_a_version_6_connection_with_broker_stopping_error() -> None:
    with temporary_broker() as broker:
        path = broker.url.removeprefix("unix:")
        six = PageClient(path, timeout_s=WAIT_S)
        five = PageClient(path, versions=[5], timeout_s=WAIT_S)
        six.create_topic("stop", 1)
        args = held_pull("stop")
        held = six.request("pull", args)
        six.ping()
        five.ping()
        broker.stop()  # SIGTERM: drain
        assert six.wait(held, WAIT_S) == [[], 0]  # answered with what there is
        with pytest.raises(PageError) as info:
            six.wait(10_000, WAIT_S)
        assert (info.value.code, info.value.request_id) == ("BrokerStoppingError", 0)
        assert six.read_end()
        with pytest.raises(Closed):  # version 5: closed without the frame
            five.read_body()
        six.close()
        five.close()


def test_the_pages_error_table_names_every_class_of_equeue_errors_with_its_parent() -> None:
    """The page's "Errors" table is what a client in another language has of
    equeue.errors: each code and the code it is a kind of (a FencedMemberError is a
    GroupError: "a GroupError on any call means its membership is gone")."""
    import inspect
    from pathlib import Path

    import equeue.errors

    page = (Path(__file__).parent.parent / "docs" / "protocol.md").read_text()
    section = page.split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| (?:`(\w+)`|\u2013) \|", section, re.MULTILINE)
    on_page = {code: parent or None for code, parent in rows}
    assert len(on_page) == len(rows), "a code listed twice"
    base = equeue.errors.EQueueError
    classes = {
        name: next(
            (b.__name__ for b in cls.__bases__ if issubclass(b, base) and b is not base), None
        )
        for name, cls in inspect.getmembers(equeue.errors, inspect.isclass)
        if issubclass(cls, base) and cls is not base
    }
    assert on_page == classes
    assert (
        set(PARENTS) == set(classes)
        and {code: parent or "" for code, parent in classes.items()} == PARENTS
    )  # the page client's transcription of the table


def test_requests_behind_the_hello_are_served_after_the_welcome_or_not_at_all(
    broker: BrokerProcess,
) -> None:
    with page_client(broker, hello=False) as client:
        client.send_raw(
            frame({"versions": [6]})
            + frame([1, "create_topic", {"topic": "behind"}])
            + frame([2**64 - 1, "send", {"topic": "behind", "body": b"b", "queue_id": 0}])
        )
        assert type(client.read_body()) is dict  # the welcome first
        assert client.next_answer() == (1, 0, None)
        request_id, status, result = client.next_answer()
        assert (request_id, status, result[1:4]) == (2**64 - 1, 0, ["behind", 0, 0])
    with page_client(broker, hello=False) as client:  # a refused hello: none served
        client.send_raw(
            frame({"versions": [99]})
            + frame([1, "send", {"topic": "behind", "body": b"c", "queue_id": 0}])
        )
        error = connection_error(client, 1)
        assert (error.code, error.request_id) == ("ProtocolError", 0)
    with page_client(broker) as client:
        assert client.queue_range("behind", 0) == (0, 1)
        where = client.stats()["clients"][0]["where"]
        assert type(where) is str and where.startswith("connection #")


def test_is_a_follows_the_tables_kinds() -> None:
    fenced = PageError(3, "FencedMemberError", "joined again")
    assert fenced.is_a("GroupError") and fenced.is_a("FencedMemberError")
    assert not fenced.is_a("ProtocolError")
    assert PageError(0, "FrameTooLargeError", "").is_a("ProtocolError")
    assert PageError(1, "SomeLaterError", "").is_a("BrokerError")


def test_a_second_pull_under_a_held_pulls_id_is_not_held_and_cancel_names_the_first(
    broker: BrokerProcess,
) -> None:
    with page_client(broker) as client:
        client.create_topic("same_id", 1)
        args = held_pull("same_id")
        client.send_raw(frame([7, "pull", args]) + frame([7, "pull", args]))
        assert client.next_answer() == (7, 0, [[], 0])  # the second, at the next tick
        client.next_id = 8
        assert client.stats()["held_pulls"] >= 1
        cancel_id = client.request("cancel_pull", {"request_id": 7})
        assert client.next_answer() == (7, 0, [[], 0])  # the first, held until now
        assert client.next_answer() == (cancel_id, 0, True)
