"""What one request may cost the broker: decoding bounded per container, a send_batch's
message count and answer bounded, every pull answer within max_frame_bytes, a pull's
count capped, held pulls with a tag filter not pulled for messages they cannot match,
commits persisted off the event loop, silent peers closed after hello_timeout_ms, and
bytes of partial frames bounded broker-wide (review23 findings 1-5, 8)."""

from __future__ import annotations

import contextlib
import os
import struct
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from server_helpers import Raw, raw, short_home

from equeue import MessageStore
from equeue.errors import ConfigError
from equeue.protocol.frames import (
    FRAME_HEADER,
    PROTOCOL_VERSION,
    check_answer,
    check_request,
    encode,
)
from equeue.server import BrokerThread
from equeue.store.config import StoreConfig

MiB = 1 << 20


home = pytest.fixture(short_home, name="home")


class Counted:
    reprs = 0

    def __repr__(self) -> str:
        Counted.reprs += 1
        return "counted"


def test_a_refused_body_is_described_without_a_repr_of_the_whole() -> None:
    Counted.reprs = 0
    body = [Counted() for _ in range(10_000)]
    with pytest.raises(Exception, match="list of 10000 items") as caught:
        check_request(body, "test")
    assert Counted.reprs <= 8  # the first few items only
    assert len(str(caught.value)) < 200


def test_a_container_past_max_batch_messages_is_not_decoded(home: Path) -> None:
    running = BrokerThread(home / "s", max_batch_messages=1000)
    with running, raw(running.urls[0]) as good, raw(running.urls[0]) as bomb:
        # a request whose args hold an array32 of 2,000,000 nils (2 MB, within the frame)
        nils = b"\xdd" + struct.pack(">I", 2_000_000) + b"\xc0" * 2_000_000
        body = b"\x93\x01\xa4ping\x81\xa1x" + nils
        bomb.send_raw(FRAME_HEADER.pack(len(body)) + body)
        error = bomb.closed_with()
        assert error["code"] == "ProtocolError"
        assert "max_batch_messages=1000" in error["message"], error
        assert len(error["message"]) < 400, len(error["message"])
        assert good.call("ping") is None


def test_a_frame_of_nested_tiny_objects_is_refused_by_their_count(home: Path) -> None:
    # each array within max_items, but 40 x 4,000 empty arrays is 160,000 objects: past
    # the 32 per message of max_batch_messages=1000 a request may hold. A request (its id
    # leads the body) is answered LimitExceededError and its connection stays (the frame
    # was read whole); a body with no request id to answer closes the connection.
    running = BrokerThread(home / "s", max_batch_messages=1000)
    inner = b"\xdd" + struct.pack(">I", 1999) + b"\x90" * 1999
    arrays = b"\xdd" + struct.pack(">I", 80) + inner * 80
    with running, raw(running.urls[0]) as good, raw(running.urls[0]) as bomb:
        body = b"\x93\x07\xa4ping\x81\xa1x" + arrays
        bomb.send_raw(FRAME_HEADER.pack(len(body)) + body)
        request_id, status, error = check_answer(bomb.recv(), "test")
        assert (request_id, status, error["code"]) == (7, 1, "LimitExceededError"), error
        assert "more than 32000 msgpack objects" in error["message"], error
        assert "per request" in error["message"], error
        assert "--max-batch-messages" in error["message"], error
        assert bomb.call("ping") is None  # the same connection
        # id 0, an id not an int, not [id, op, args]
        for head in (b"\x93\x00\xa4ping\x81\xa1x", b"\x93\xa1x\xa4ping\x81\xa1x", b"\x92\x01"):
            with raw(running.urls[0]) as no_id:
                body = head + arrays
                no_id.send_raw(FRAME_HEADER.pack(len(body)) + body)
                error = no_id.closed_with()
                assert error["code"] == "ProtocolError", error
                assert "more than 32000 msgpack objects" in error["message"], error
        assert good.call("ping") is None


def test_send_batch_is_bounded_by_max_batch_messages(home: Path) -> None:
    with BrokerThread(home / "s", max_batch_messages=100) as running, raw(running.urls[0]) as c:
        c.call("create_topic", topic="t", queue_count=1)
        error = c.error("send_batch", topic="t", messages=[{"body": b"x"}] * 101)
        assert error["code"] == "LimitExceededError"
        assert "max_batch_messages=100" in error["message"]
        assert running.store.queue_range("t", 0) == (0, 0)  # nothing appended
        assert len(c.call("send_batch", topic="t", messages=[{"body": b"x"}] * 100)) == 100


def test_a_send_batch_whose_answer_would_pass_the_frame_is_refused(home: Path) -> None:
    topic = "t" * 200  # each SendResult carries the topic: ~265 bytes an answer
    limit = 64 * 1024
    store = MessageStore.open(home / "s", StoreConfig(max_message_size=16 * 1024))
    try:
        with BrokerThread(store, max_frame_bytes=limit) as running, raw(running.urls[0]) as c:
            c.call("create_topic", topic=topic, queue_count=1)
            messages = [{"body": b"x"}] * 1000  # an 8 KB request, a 265 KB answer
            error = c.error("send_batch", topic=topic, messages=messages)
            assert error["code"] == "LimitExceededError"
            assert f"max_frame_bytes={limit}" in error["message"], error
            assert running.store.queue_range(topic, 0) == (0, 0)
            results = c.call("send_batch", topic=topic, messages=messages[:200])
            assert len(results) == 200
            assert len(encode([2, 0, results])) <= limit
    finally:
        store.close()


def test_pull_answers_stay_within_max_frame_bytes(home: Path) -> None:
    limit = 8 * MiB
    body = b"m" * (3 * MiB)  # within the store's 4 MiB; three do not fit one frame
    with BrokerThread(home / "s", max_frame_bytes=limit) as running, raw(running.urls[0]) as c:
        c.call("create_topic", topic="t", queue_count=1)
        for _ in range(5):
            c.call("send", topic="t", body=body)
        offset, got = 0, 0
        for _ in range(10):
            result = c.call("pull", topic="t", queue_id=0, offset=offset, max_count=32)
            assert len(encode([1, 0, result])) <= limit
            messages, offset = result
            if not messages:
                break
            got += len(messages)
        assert got == 5 and offset == 5


def test_pull_count_is_capped_by_max_pull_count(home: Path) -> None:
    with BrokerThread(home / "s", max_pull_count=10) as running, raw(running.urls[0]) as c:
        c.call("create_topic", topic="t", queue_count=1)
        c.call("send_batch", topic="t", messages=[{"body": b"x"}] * 50)
        messages, next_offset = c.call("pull", topic="t", queue_id=0, offset=0, max_count=10**9)
        assert len(messages) == 10 and next_offset == 10
        assert c.welcome["limits"]["max_pull_count"] == 10


def test_a_frame_limit_that_cannot_carry_one_message(home: Path) -> None:
    store = MessageStore.open(home / "s")  # the default max_message_size, 4 MiB
    try:
        with pytest.raises(ConfigError, match=r"max_frame_bytes=1048576.*max_message_size"):
            BrokerThread(store, max_frame_bytes=MiB)
    finally:
        store.close()
    # a store the broker opens itself takes the messages one frame can carry
    with BrokerThread(home / "s", max_frame_bytes=MiB) as running, raw(running.urls[0]) as c:
        error = c.error("send", topic="t", body=b"x" * (MiB - 1024))
        assert error["code"] == "MessageTooLargeError"
        assert c.call("send", topic="t", body=b"x" * (MiB // 2))[3] == 0


def test_held_pulls_with_another_tag_are_not_pulled_for_each_send(home: Path) -> None:
    with BrokerThread(home / "s") as running, raw(running.urls[0]) as idle:
        store = running.store
        idle.call("create_topic", topic="t", queue_count=1)
        held = [
            idle.request("pull", topic="t", queue_id=0, offset=0, tags="never", wait_ms=60_000)
            for _ in range(50)
        ]
        with raw(running.urls[0]) as producer:
            for _ in range(1000):  # the broker reads the 50 pulls at its pace
                if producer.call("stats")["held_pulls"] == 50:
                    break
            assert producer.call("stats")["held_pulls"] == 50
            pulls = 0
            real = store.pull

            def counting(*args: object, **kwargs: object) -> object:
                nonlocal pulls
                pulls += 1
                return real(*args, **kwargs)  # type: ignore[arg-type]

            store.pull = counting  # type: ignore[method-assign,assignment]
            try:
                for number in range(20):
                    producer.call("send", topic="t", body=b"%d" % number, tag="other")
                assert pulls == 0, f"{pulls} store pulls for 20 sends nobody waits for"
                producer.call("send", topic="t", body=b"wanted", tag="never")
                answers = idle.answers(50)
            finally:
                store.pull = real  # type: ignore[method-assign]
        assert sorted(answers) == held
        for status, (messages, _) in answers.values():
            assert status == 0 and [m[9] for m in messages] == [b"wanted"]


def test_commit_offset_is_persisted_off_the_event_loop(home: Path) -> None:
    threads: set[str] = set()
    real = os.fsync

    def spy(fd: Any) -> None:
        threads.add(threading.current_thread().name)
        real(fd)

    with BrokerThread(home / "s") as running, raw(running.urls[0]) as c:
        c.call("create_topic", topic="t", queue_count=1)
        c.call("send_batch", topic="t", messages=[{"body": b"x"}] * 10)
        os.fsync = spy
        try:
            for offset in (3, 7, 10):
                args = {"group": "g", "topic": "t", "queue_id": 0, "offset": offset}
                assert c.call("commit_offset", **args) is None
                # durable when answered: another handle reads it at once
                with MessageStore.open(home / "s", read_only=True) as reader:
                    assert reader.committed_offset("g", "t", 0) == offset
        finally:
            os.fsync = real
        assert threads and "equeue-broker" not in threads, threads
        # a lower offset is a reset, as in-process
        assert c.call("commit_offset", group="g", topic="t", queue_id=0, offset=2) is None
        assert c.call("committed_offset", group="g", topic="t", queue_id=0) == 2
        error = c.error("commit_offset", group="g", topic="t", queue_id=0, offset=11)
        assert error["code"] == "InvalidMessageError"
        assert c.call("committed_offset", group="g", topic="t", queue_id=0) == 2


def test_a_silent_peer_is_closed_after_the_hello_timeout(home: Path) -> None:
    with BrokerThread(home / "s", hello_timeout_ms=200, max_connections=2) as running:
        url = running.urls[0]
        silent = [Raw(url, hello=False) for _ in range(2)]
        try:
            for peer in silent:
                error = peer.closed_with()  # within TIMEOUT_S, not for ever
                assert error["code"] == "ProtocolError"
                assert "hello_timeout_ms=200" in error["message"]
        finally:
            for peer in silent:
                peer.close()
        for _ in range(100):  # the broker sees them go at its own pace
            with raw(url) as c:
                if c.call("stats")["connections"] == 1:
                    break
        with raw(url) as c, raw(url) as d:
            assert c.call("ping") is None and d.call("ping") is None


def test_partial_frames_are_bounded_across_connections(home: Path) -> None:
    cap = 2 * MiB
    with pytest.raises(ConfigError, match="max_partial_frame_bytes"):
        BrokerThread(home / "s", max_partial_frame_bytes=cap, max_frame_bytes=cap + 1)
    running = BrokerThread(home / "s", max_partial_frame_bytes=cap, max_frame_bytes=cap)
    with running:
        url = running.urls[0]
        with raw(url) as first, raw(url) as second, raw(url) as good:
            header = FRAME_HEADER.pack(2 * MiB)
            first.send_raw(header + b"\x00" * (MiB + MiB // 2))  # 1.5 MiB of a 2 MiB frame
            for _ in range(1000):  # until the broker has read all of it
                if good.call("stats")["buffered_bytes"] >= MiB + MiB // 2:
                    break
            assert good.call("stats")["buffered_bytes"] >= MiB + MiB // 2
            # past the cap once the broker holds 0.5 MiB of it: the frame stalled longest
            # (the first) gives way, not the one still arriving (partials.py, reviewg F16)
            with contextlib.suppress(OSError):
                second.send_raw(header + b"\x00" * MiB)
            error = first.closed_with()
            assert error["code"] == "LimitExceededError"
            assert f"max_partial_frame_bytes={cap}" in error["message"]
            assert good.call("ping") is None
            second.send_raw(b"\x00" * MiB)  # the second one's frame completes: nil...
            assert second.closed_with()["code"] == "ProtocolError"  # ...is not a request
            assert good.call("stats")["buffered_bytes"] < MiB


def test_a_held_pull_wakes_for_appends_the_broker_did_not_make(home: Path) -> None:
    """A message appended past the broker's handlers (as the retry mover appends) with the
    held pull's tag, followed by a broker send of another tag: the pull is answered."""
    with BrokerThread(home / "s") as running, raw(running.urls[0]) as idle:
        idle.call("create_topic", topic="t", queue_count=1)
        rid = idle.request("pull", topic="t", queue_id=0, offset=0, tags="want", wait_ms=60_000)
        with raw(running.urls[0]) as producer:
            for _ in range(100):
                if producer.call("stats")["held_pulls"] == 1:
                    break
            running.store.send("t", b"moved", tag="want", queue_id=0)
            producer.call("send", topic="t", body=b"other", tag="other")
            answers = idle.answers(1)
        status, (messages, next_offset) = answers[rid]
        assert status == 0 and [m[9] for m in messages] == [b"moved"]
        assert next_offset in (1, 2)  # 2: woken after the other send, which it passed over


def test_a_full_broker_makes_room_by_closing_a_silent_peer(home: Path) -> None:
    running = BrokerThread(home / "s", max_connections=2, hello_timeout_ms=60_000)
    with running:
        url = running.urls[0]
        silent = [Raw(url, hello=False) for _ in range(2)]
        try:
            time.sleep(1.2)  # the peers have said nothing for longer than EVICT_AFTER_S
            with raw(url) as c:  # before: LimitExceededError until the peers went away
                assert c.welcome["version"] == PROTOCOL_VERSION and c.call("ping") is None
            error = silent[0].closed_with()  # the oldest silent one made room
            assert error["code"] == "LimitExceededError" and "no hello" in error["message"]
        finally:
            for peer in silent:
                peer.close()
