"""The broker's limits, each a setting with a clear error to the client, and
backpressure: a client that never reads holds up neither the others nor the broker's
memory."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from server_helpers import Raw, raw, short_home

from equeue.errors import ConfigError
from equeue.protocol.frames import FRAME_HEADER, HELLO_MAX_FRAME_BYTES, encode
from equeue.server import BrokerThread, ServerConfig

home = pytest.fixture(short_home, name="home")


def test_settings_are_checked() -> None:
    for bad, name in (
        ({"max_in_flight": 0}, "max_in_flight"),
        ({"max_connections": -1}, "max_connections"),
        ({"max_frame_bytes": 10}, "max_frame_bytes"),
        ({"flush": "never"}, "flush"),
        ({"listen": ["http://x"]}, "unix:PATH"),
        ({"listen": "unix:/tmp/x"}, "sequence"),
        ({"listen": ["tls://127.0.0.1:0"]}, "certificate"),
    ):
        with pytest.raises(ConfigError, match=name):
            ServerConfig(**bad)


def test_in_flight_limit_answers_the_request_and_keeps_the_connection(home: Path) -> None:
    with BrokerThread(home / "s", max_in_flight=2) as running, raw(running.urls[0]) as c:
        c.call("create_topic", topic="t", queue_count=1)
        held = [
            c.request("pull", topic="t", queue_id=0, offset=0, wait_ms=30_000) for _ in range(2)
        ]
        error = c.error("pull", topic="t", queue_id=0, offset=0, wait_ms=30_000)
        assert error["code"] == "LimitExceededError"
        assert "max_in_flight=2" in error["message"]
        with raw(running.urls[0]) as other:
            other.call("send", topic="t", body=b"wake")  # answers both held pulls
        assert sorted(c.answers(2)) == held
        assert c.call("ping") is None


def test_connection_limit(home: Path) -> None:
    with BrokerThread(home / "s", max_connections=2) as running:
        url = running.urls[0]
        with raw(url) as first, raw(url) as second:
            third = Raw(url, hello=False)
            error = third.closed_with()
            third.close()
            assert error["code"] == "LimitExceededError"
            assert "max_connections=2" in error["message"]
            assert first.call("ping") is None and second.call("ping") is None
        for _ in range(100):  # the broker sees the two go at its own pace
            with raw(url) as again:
                if again.call("stats")["connections"] == 1:
                    break
        with raw(url) as again, raw(url) as also:
            assert again.call("ping") is None and also.call("ping") is None


def test_frame_limits_close_that_connection_only(home: Path) -> None:
    limit = HELLO_MAX_FRAME_BYTES * 2
    with BrokerThread(home / "s", max_frame_bytes=limit) as running:
        url = running.urls[0]
        with raw(url) as good:
            good.call("create_topic", topic="t", queue_count=1)
            before = running.store.queue_range("t", 0)
            with raw(url, hello=False) as c:  # a hello past the pre-handshake limit
                c.send_raw(FRAME_HEADER.pack(HELLO_MAX_FRAME_BYTES + 1) + b"\x90" * 100)
                error = c.closed_with()
                assert error["code"] == "FrameTooLargeError"
                assert str(HELLO_MAX_FRAME_BYTES) in error["message"]
            with raw(url) as c:  # after it, a request over max_frame_bytes
                c.send_raw(encode([1, "send", {"topic": "t", "body": b"x" * limit}]))
                error = c.closed_with()
                assert error["code"] == "FrameTooLargeError"
                assert f"max_frame_bytes={limit}" in error["message"]
            with raw(url) as c:  # a frame just inside it is served (a message of the
                # frame's size would pass the store's max_message_size: the broker set it so
                # that one message and its properties fit in a pull's answer)
                body = b"y" * ((limit - 200) // 4)
                assert len(c.call("send_batch", topic="t", messages=[{"body": body}] * 4)) == 4
            assert good.call("ping") is None
        assert running.store.queue_range("t", 0) == (before[0], before[1] + 4)


def test_a_stalled_client_blocks_nobody_and_its_answers_stay_bounded(home: Path) -> None:
    high = 64 * 1024
    with BrokerThread(home / "s", write_buffer_high=high) as running:
        url = running.urls[0]
        with raw(url) as producer:
            producer.call("create_topic", topic="t", queue_count=1)
            producer.call("send_batch", topic="t", messages=[{"body": b"z" * 1024}] * 32)
            stalled = Raw(url)
            stalled.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            try:
                # 3000 pulls of 32 KiB answers each (~100 MB), never read
                request = encode([1, "pull", {"topic": "t", "queue_id": 0, "offset": 0}])
                stalled.sock.setblocking(False)
                sent = 0
                data = request * 3000
                while sent < len(data):
                    try:
                        sent += stalled.sock.send(data[sent:])
                    except BlockingIOError:
                        break  # the broker stopped reading it: backpressure reached the client
                stalled.sock.setblocking(True)
                for number in range(300):  # the others go on
                    assert producer.call("send", topic="u", body=b"%d" % number)[3] == number // 4
                stats = producer.call("stats")
                assert stats["connections"] == 2
                # about write_buffer_high of answers, one answer (33 KiB), and the
                # requests read and not yet served, whatever the client piles up
                assert stats["buffered_bytes"] <= high + 64 * 1024 + 256 * 1024, stats
            finally:
                stalled.close()
