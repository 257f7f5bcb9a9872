"""Hostile input: random bytes, truncated frames, oversized headers and valid frames with
hostile bodies, from several connections at once. The broker stays up, a well-behaved
client on another connection keeps working throughout, and nothing a rejected request
carried reaches the store."""

from __future__ import annotations

import random
import shutil
import socket
import threading
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import raw, short_dir

from equeue.protocol.frames import FRAME_HEADER, FrameReader, check_answer, decode_body, encode
from equeue.server import BrokerThread

MAX_FRAME = 128 * 1024
FIXTURE = [HealthCheck.function_scoped_fixture]  # the module's broker serves every example
CASES = 300
THREADS = 3
HELLO = encode({"versions": [1], "token": None, "client": "fuzz"})
BIG = (1 << 64) - 1
# Write requests whose every variant here is refused: a bad value for the store, or a
# wrong type for the protocol (the topics they name never exist).
REFUSED_WRITES: list[list[Any]] = [
    ["send", {"topic": "", "body": b"x"}],
    ["send", {"topic": "a/b", "body": b"x"}],
    ["send", {"topic": "x" * 300, "body": b"x"}],
    ["send", {"topic": "fz", "body": "text"}],
    ["send", {"topic": "fz", "body": b"x", "queue_id": BIG}],
    ["send", {"topic": "fz", "body": b"x", "queue_id": -1}],
    ["send", {"topic": "fz", "body": b"x", "code": 1 << 40}],
    ["send", {"topic": "fz", "body": b"x", "code": -(1 << 63)}],
    ["send", {"topic": "fz", "body": b"x", "properties": {"a": 1}}],
    ["send", {"topic": "fz", "body": b"x", "properties": {"a": ["b"]}}],
    ["send", {"topic": "fz", "body": b"x", "tag": "t" * 100_000}],
    ["send", {"topic": "fz", "body": b"x", "key": 5}],
    ["send", {"topic": "fz", "body": b"x", "tag": None}],
    ["send", {"topic": b"fz", "body": b"x"}],
    ["send", {"topic": "fz", "body": b"x", 7: 8}],
    ["send", {"topic": "fz", "body": b"x", b"tag": "a"}],
    ["send", {"topic": "fz", "body": True}],
    ["send_batch", {"topic": "fz", "messages": [{"body": b"ok"}, {"body": b"x", "code": 1 << 33}]}],
    ["send_batch", {"topic": "fz", "messages": [{"body": b"ok"}, "x"]}],
    ["send_batch", {"topic": "fz", "messages": [{"body": b"ok"}, {"body": b"x", "queue_id": BIG}]}],
    ["send_batch", {"topic": "fz", "messages": {"body": b"x"}}],
    ["send_batch", {"topic": "fz", "messages": [[[[[]]]]]}],
    ["create_topic", {"topic": "fz", "queue_count": BIG}],
    ["create_topic", {"topic": "fz", "queue_count": 0}],
    ["create_topic", {"topic": "fz/x"}],
    ["create_topic", {"topic": "fz", "queue_count": "3"}],
    ["commit_offset", {"group": "g", "topic": "fz", "queue_id": 0, "offset": 1}],
    ["commit_offset", {"group": "", "topic": "good", "queue_id": 0, "offset": 0}],
    ["commit_offset", {"group": "g", "topic": "good", "queue_id": 0, "offset": BIG}],
    ["commit_offset", {"group": "g", "topic": "good", "queue_id": BIG, "offset": 0}],
]
HOSTILE_READS: list[list[Any]] = [
    ["pull", {"topic": "good", "queue_id": 0, "offset": BIG}],
    ["pull", {"topic": "good", "queue_id": 0, "offset": 0, "max_count": BIG}],
    ["pull", {"topic": "good", "queue_id": 0, "offset": 0, "max_count": 0}],
    ["pull", {"topic": "good", "queue_id": 0, "offset": 0, "max_bytes": BIG, "tags": ["", "x"]}],
    ["pull", {"topic": "good", "queue_id": 0, "offset": 0, "tags": [1, 2]}],
    ["pull", {"topic": "good", "queue_id": 0, "offset": 0, "wait_ms": BIG}],
    ["pull", {"topic": "good", "queue_id": 0, "offset": 0, "tags": {"a": "b"}}],
    ["get", {"message_id": "f" * 24}],
    ["get", {"message_id": "z" * 1000}],
    ["get", {"message_id": ""}],
    ["query_by_key", {"topic": "good", "key": "k" * 10_000, "limit": BIG}],
    ["query_by_key", {"topic": "good", "key": "", "limit": 0}],
    ["offset_for_time", {"topic": "good", "queue_id": 0, "timestamp": float("nan")}],
    ["offset_for_time", {"topic": "good", "queue_id": 0, "timestamp": float("inf")}],
    ["offset_for_time", {"topic": "good", "queue_id": 0, "timestamp": -(1 << 63)}],
    ["offset_for_time", {"topic": "good", "queue_id": 0, "timestamp": BIG}],
    ["committed_offset", {"group": "\x00", "topic": "good", "queue_id": 0}],
    ["queue_range", {"topic": "\udc80" if False else "\x00", "queue_id": 0}],
    ["queue_ids", {"topic": "nope"}],
    ["stats", {"x": 1}],
    ["nope", {}],
    ["", {}],
    ["ping", []],
    ["join", {"group": "g", "consumer": "c", "topics": [1]}],
    ["nack", {"group": "g", "consumer": "c", "message_id": "x", "delay_ms": BIG}],
]


def hostile_body(rng: random.Random) -> bytes:
    """One frame body (msgpack, or bytes that are not)."""
    kind = rng.randrange(8)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    if kind == 1:  # wrong request shapes
        shape = rng.choice([
            [], [1], [1, "ping"], [1, "ping", {}, 4], [-1, "ping", {}], [BIG, "ping", {}],
            [1.5, "ping", {}], [True, "ping", {}], [1, 2, {}], [1, b"ping", {}], "ping",
            {"versions": [1]}, None, 12, [1, "ping", None],
        ])  # fmt: skip
        return msgpack.packb(shape, use_bin_type=True)  # type: ignore[no-any-return]
    if kind == 2:  # deep nesting, by hand: msgpack's packer stops at 512 levels
        depth = rng.choice([100, 600, 5000, 100_000])
        return b"\x93\x01\xa4ping\x81\xa1x" + b"\x91" * depth + b"\x90"
    if kind == 3:  # non-str map keys
        return msgpack.packb([1, "ping", {rng.choice([1, 2.5, b"k", None]): 1}], use_bin_type=True)  # type: ignore[no-any-return]
    if kind == 4:  # reserved byte, truncated containers, a map claiming 2**32-1 items
        return rng.choice(
            [
                b"\xc1",
                b"\x93\x01",
                b"\xdf\xff\xff\xff\xff",
                b"\xdb\xff\xff\xff\xff",
                b"\x93\x01\xa4ping\x81",
            ]
        )
    op, args = rng.choice(REFUSED_WRITES + HOSTILE_READS)
    return msgpack.packb([rng.randrange(1, 1 << 31), op, args], use_bin_type=True)  # type: ignore[no-any-return]


def hostile_stream(rng: random.Random) -> bytes:
    kind = rng.randrange(6)
    if kind == 0:  # random bytes instead of a hello
        return bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
    if kind == 1:  # a truncated hello
        return HELLO[: rng.randrange(1, len(HELLO))]
    if kind == 2:  # random bytes after the hello
        return HELLO + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
    if kind == 3:  # an oversized header
        return HELLO + FRAME_HEADER.pack(rng.randrange(MAX_FRAME + 1, 1 << 32)) + b"\x00" * 8
    body = hostile_body(rng)
    frame = FRAME_HEADER.pack(len(body)) + body
    if kind == 4:  # a frame cut short
        return HELLO + frame[: rng.randrange(1, len(frame))]
    return HELLO + encode([1, "ping", {}]) + frame


def answers_to(url: str, data: bytes) -> list[Any]:
    """Send ``data``, half-close, and read every answer until the broker closes."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20)
    sock.connect(url[5:])
    got: list[Any] = []
    reader = FrameReader(1 << 30, "fuzz")
    try:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the broker refused it before it was all sent
        while True:
            try:
                chunk = sock.recv(1 << 16)
            except ConnectionResetError:
                break
            if not chunk:
                break
            got += [decode_body(b, "fuzz") for b in reader.feed(chunk)]
    finally:
        sock.close()
    assert reader.pending == 0, "the broker sent a partial frame"
    return got


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerThread]:
    home = short_dir()
    try:
        with BrokerThread(home / "s", max_frame_bytes=MAX_FRAME) as running:
            with raw(running.urls[0]) as c:
                c.call("create_topic", topic="good", queue_count=1)
                c.call("send", topic="good", body=b"seed", key="k")
            yield running
    finally:
        shutil.rmtree(home, ignore_errors=True)


def store_state(running: BrokerThread) -> tuple[Any, ...]:
    store = running.store
    topics = [t for t in store.topics() if t != "good"]
    ranges = {t: [store.queue_range(t, q) for q in store.queue_ids(t)] for t in topics}
    return topics, ranges, store.consumer_groups()


class GoodClient(threading.Thread):
    """Sends to "good" and checks every answer, until told to stop."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.sent = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with raw(self.url) as c:
                while not self.stop.is_set() and self.sent < 100_000:
                    result = c.call("send", topic="good", body=b"%d" % self.sent, queue_id=0)
                    assert result[1:3] == ["good", 0]
                    self.sent += 1
                    assert c.call("ping") is None
        except BaseException as exc:
            self.error = exc


def check_answers(answers: list[Any]) -> None:
    for answer in answers:
        if isinstance(answer, dict):  # the welcome
            continue
        _, status, payload = check_answer(answer, "fuzz")
        if status == 1:
            assert set(payload) == {"code", "message"} and payload["code"] != "BrokerError", payload


def test_seeded_hostile_connections(broker: BrokerThread) -> None:
    url = broker.urls[0]
    before = store_state(broker)
    first_good = broker.store.queue_range("good", 0)[1]
    good = GoodClient(url)
    good.start()
    failures: list[BaseException] = []

    def attack(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(CASES // THREADS):
                check_answers(answers_to(url, hostile_stream(rng)))
        except BaseException as exc:
            failures.append(exc)

    attackers = [threading.Thread(target=attack, args=(seed,)) for seed in range(THREADS)]
    for thread in attackers:
        thread.start()
    for thread in attackers:
        thread.join(120)
    good.stop.set()
    good.join(60)
    assert not failures, failures[0]
    assert good.error is None, good.error
    assert good.sent > 0
    assert store_state(broker) == before
    assert broker.store.queue_range("good", 0)[1] == first_good + good.sent
    with raw(url) as c:
        assert c.call("ping") is None


def test_every_refused_write_is_an_error_and_stores_nothing(broker: BrokerThread) -> None:
    url = broker.urls[0]
    before = store_state(broker)
    for op, args in REFUSED_WRITES:
        answers = answers_to(url, HELLO + encode([5, op, args]))
        assert len(answers) == 2, (op, args, answers)
        _, status, payload = check_answer(answers[1], "fuzz")
        assert status == 1 and payload["code"] != "BrokerError", (op, args, payload)
    for op, args in HOSTILE_READS:  # answered (an error or not) or refused, never a defect
        check_answers(answers_to(url, HELLO + encode([6, op, args])))
    assert store_state(broker) == before


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.binary(min_size=1, max_size=200))
def test_hypothesis_bytes_after_the_hello(broker: BrokerThread, data: bytes) -> None:
    check_answers(answers_to(broker.urls[0], HELLO + data))


MSGPACK = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), BIG) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)  # fmt: skip


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.sampled_from(sorted({op for op, _ in REFUSED_WRITES + HOSTILE_READS})), MSGPACK)
def test_hypothesis_requests_with_hostile_args(broker: BrokerThread, op: str, args: Any) -> None:
    before = store_state(broker)
    if op in ("send", "send_batch", "create_topic", "commit_offset") and isinstance(args, dict):
        args = {**args, "topic": "\x00bad"}  # a write must not succeed: its topic is invalid
    check_answers(answers_to(broker.urls[0], HELLO + encode([1, op, args])))
    assert store_state(broker) == before
    with raw(broker.urls[0]) as c:
        assert c.call("ping") is None
