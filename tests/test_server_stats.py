"""The stats request's counters against what the clients did, over real sockets to a real
``equeue serve``: requests, sends, send_requests, pulls, errors, and bytes in and out to
the byte (every byte the clients wrote and read, counted at their sockets). With the C
accelerator the send lane and release_frames add to C integers (cext/counters.c, stats.py's
Counters); without it (EQUEUE_PURE_PYTHON=1) the counters are Python ints; both must
report the same counts, under --flush sync (the group commit) and async."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_helpers import Raw, short_home
from test_server_kill import start_broker
from test_server_kill_cadd import loaded_speedups

from equeue import speedups
from equeue.protocol.frames import encode

home = pytest.fixture(short_home, name="home")

CONNECTIONS = 8
ROUNDS = 25  # sends a connection makes one at a time (each read one plain send: the lane)


class Counted:
    """A socket that counts the bytes written to and read from it."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.written = self.read = 0

    def sendall(self, data: bytes) -> None:
        self._sock.sendall(data)
        self.written += len(data)

    def recv(self, size: int) -> bytes:
        data = self._sock.recv(size)
        self.read += len(data)
        return data

    def close(self) -> None:
        self._sock.close()


def counted(url: str) -> Raw:
    connection = Raw(url, hello=False)
    connection.sock = Counted(connection.sock)  # type: ignore[assignment]
    connection.sock.sendall(encode({"versions": [1], "token": None, "client": "test"}))
    connection.welcome = connection.recv()
    return connection


@pytest.fixture(params=["c", "python"])
def accelerated(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "c" and speedups.SPEEDUPS is None:
        pytest.skip("needs the C accelerator")
    if request.param == "python":
        monkeypatch.setenv("EQUEUE_PURE_PYTHON", "1")
    yield request.param


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_stats_count_what_clients_did(home: Path, flush: str, accelerated: str) -> None:
    broker, url = start_broker(home / "s", "--flush", flush)
    connections: list[Raw] = []
    try:
        if accelerated == "c":  # this tree's (EQUEUE_PURE_PYTHON: loaded, not used)
            assert loaded_speedups(broker.pid) == {speedups.SPEEDUPS.__file__}  # type: ignore[union-attr]
        connections = [counted(url) for _ in range(CONNECTIONS)]
        requests = sends = send_requests = pulls = errors = 0
        for i in range(ROUNDS):  # one send in flight a connection, all connections at once
            rids = [c.request("send", topic="t", body=b"x" * (i % 7 + 1)) for c in connections]
            for c, rid in zip(connections, rids, strict=True):
                assert c.answers(1)[rid][0] == 0
            requests += CONNECTIONS
            sends += CONNECTIONS
            send_requests += CONNECTIONS
        first = connections[0]
        first.call("send_batch", topic="t", messages=[{"body": b} for b in (b"a", b"bb", b"ccc")])
        requests, sends, send_requests = requests + 1, sends + 3, send_requests + 1
        found = first.call("pull", topic="t", queue_id=0, offset=0, max_count=5)
        assert found
        requests, pulls = requests + 1, pulls + 1
        first.error("send", topic="", body=b"x")  # no such topic name: an error answer
        requests, errors = requests + 1, errors + 1
        first.call("ping")
        requests += 1
        # every answer above is read: what the clients wrote and read is what the broker
        # counted, the stats request itself in (bytes_in, requests) but not its answer
        read_before = sum(c.sock.read for c in connections)  # type: ignore[attr-defined]
        rid = first.request("stats")
        requests += 1
        got = first.answers(1)[rid]
        assert got[0] == 0, got
        stats: dict[str, Any] = got[1]
        expected = {
            "requests": requests,
            "sends": sends,
            "send_requests": send_requests,
            "pulls": pulls,
            "errors": errors,
            "bytes_in": sum(c.sock.written for c in connections),  # type: ignore[attr-defined]
        }
        assert {k: stats[k] for k in expected} == expected
        # every byte the broker wrote before the stats answer was read before its request
        assert stats["bytes_out"] == read_before
    finally:
        for c in connections:
            c.close()
        broker.terminate()
        try:
            broker.wait(timeout=30)
        except Exception:
            broker.kill()
            broker.wait()
            raise
        if broker.stdout is not None:
            broker.stdout.close()
    assert broker.returncode == 0


def test_counters_are_c_integers() -> None:
    """With the accelerator the broker's Counters keep C integers (a bump makes no int);
    they read and add as ints."""
    if speedups.SPEEDUPS is None:
        pytest.skip("needs the C accelerator")
    from equeue.server.stats import Counters

    counters = Counters()
    assert isinstance(counters, speedups.SPEEDUPS.CCounters)
    counters.sends += 3
    counters.bytes_out += 1 << 40
    assert (counters.sends, counters.bytes_out, counters.errors) == (3, 1 << 40, 0)
    assert counters.totals() == (0, 3, 0, 0, 0, 1 << 40, 0, 0)  # held_pulls_moved a Python int
    assert not hasattr(counters, "__dict__")
    counters.bytes_in = 5
    with pytest.raises(OverflowError):  # refused, nothing changed (a T_LONGLONG member wrote -1)
        counters.bytes_in = 1 << 63
    with pytest.raises(TypeError):
        counters.bytes_in = "6"
    with pytest.raises(TypeError):
        del counters.bytes_in
    assert counters.bytes_in == 5
