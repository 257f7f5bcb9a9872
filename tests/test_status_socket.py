"""STORE/status.sock: ``equeue serve STORE --status`` of a full broker (reviewg F7), and
what the socket does not allow: other ops, more than 2 at a time, staying open, and a
way past max_connections for anyone else."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from server_helpers import Raw, raw, short_home

from equeue.server import BrokerThread
from equeue.server.statussock import STATUS_CONNECTIONS

home = pytest.fixture(short_home, name="home")


def _status(store: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "equeue", "serve", str(store), "--status", *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def _status_url(store: Path) -> str:
    return f"unix:{store / 'status.sock'}"


def test_status_of_a_full_cli_broker(home: Path) -> None:
    """The probe's shape: --max-connections 5, 5 idle clients welcomed, then --status."""
    store = home / "s"
    broker = subprocess.Popen(
        [sys.executable, "-m", "equeue", "serve", str(store), "--max-connections", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    idle: list[Raw] = []
    try:
        assert broker.stdout is not None
        url = broker.stdout.readline().split("listening on", 1)[1].strip()
        idle = [Raw(url) for _ in range(5)]
        assert idle[0].call("ping") is None
        shown = _status(store)
        assert shown.returncode == 0, shown.stderr
        assert "connections: 6" in shown.stdout  # the 5 and --status's own
        assert "(status socket)" in shown.stdout
        refused = Raw(url, hello=False)  # an ordinary client: refused as before
        error = refused.closed_with()
        refused.close()
        assert error["code"] == "LimitExceededError" and "max_connections=5" in error["message"]
        assert stat.S_IMODE(os.stat(store / "status.sock").st_mode) == 0o600
    finally:
        for c in idle:
            c.close()
        broker.terminate()
        broker.communicate(timeout=60)
    assert not (store / "status.sock").exists()  # removed at the stop, as broker.sock


def test_the_status_socket_serves_stats_and_ping_only_and_closes_after_stats(
    home: Path,
) -> None:
    with BrokerThread(home / "s", max_connections=1) as running:
        store = running.store.path
        running.store.create_topic("t", 1)
        with raw(running.urls[0]) as client:  # the broker is full
            with raw(_status_url(store)) as status:
                assert status.call("ping") is None
                stats = status.call("stats")
                assert stats["connections"] == 2
                with pytest.raises(ConnectionError):
                    status.recv()  # closed after its stats answer
            with raw(_status_url(store)) as status:
                status.request("send", topic="t", body=b"x")
                error = status.closed_with()
            assert error["code"] == "ProtocolError"
            assert "serves ping and stats only" in error["message"]
            assert running.store.queue_range("t", 0) == (0, 0)  # nothing stored
            with raw(_status_url(store)) as status:  # a send_batch, the C readers' too
                status.request("send_batch", topic="t", messages=[{"body": b"x"}])
                assert status.closed_with()["code"] == "ProtocolError"
            assert running.store.queue_range("t", 0) == (0, 0)
            assert client.call("ping") is None


def test_at_most_two_status_connections_and_none_counted_against_max_connections(
    home: Path,
) -> None:
    with BrokerThread(home / "s", max_connections=2) as running:
        url, status_url = running.urls[0], _status_url(running.store.path)
        held = [Raw(status_url) for _ in range(STATUS_CONNECTIONS)]
        try:
            third = Raw(status_url, hello=False)
            error = third.closed_with()
            third.close()
            assert error["code"] == "LimitExceededError"
            assert f"{STATUS_CONNECTIONS} status connections are open already" in error["message"]
            # the two ordinary places are free: welcomed beside the status connections
            with raw(url) as first, raw(url) as second:
                assert first.call("ping") is None and second.call("ping") is None
                assert first.call("stats")["connections"] == 4
        finally:
            for c in held:
                c.close()


def test_a_status_connection_is_closed_after_the_hello_timeout(home: Path) -> None:
    with BrokerThread(home / "s", hello_timeout_ms=300) as running:
        with raw(_status_url(running.store.path)) as status:
            assert status.call("ping") is None
            started = time.monotonic()
            error = status.closed_with()
        assert error["code"] == "LimitExceededError"
        assert "hello_timeout_ms=300" in error["message"]
        assert time.monotonic() - started < 20  # (closed by the broker, not the test)


def test_a_tcp_client_gets_no_place_past_max_connections(home: Path) -> None:
    with BrokerThread(home / "s", listen=["tcp://127.0.0.1:0"], max_connections=1) as running:
        url = running.urls[0]
        with raw(url):
            refused = Raw(url, hello=False)
            error = refused.closed_with()
            refused.close()
            assert error["code"] == "LimitExceededError"
            # --listen URL: that listener, refused; STORE: the status socket, answered
            by_url = _status(running.store.path, "--listen", url)
            assert by_url.returncode != 0 and "max_connections=1" in by_url.stderr
            by_store = _status(running.store.path)
            assert by_store.returncode == 0 and "connections: 2" in by_store.stdout


def test_the_status_socket_quotes_no_unknown_op_and_bounds_a_frame_read_whole(
    home: Path,
) -> None:
    """review6 R6-1: a token sent where the op goes was echoed in the answer and the log;
    R6-2: a frame past 64 KiB in one read was decoded (the whole-frame read checked the
    broker's max_frame_bytes, not the status socket's)."""
    import msgpack

    with BrokerThread(home / "s") as running:
        store = running.store.path
        with raw(_status_url(store)) as status:
            status.request("sekrit-token-123")
            error = status.closed_with()
        assert error["code"] == "ProtocolError"
        assert "sekrit" not in error["message"] and "16 characters" in error["message"]
        with raw(_status_url(store)) as status:  # a known op is still named
            status.request("send", topic="t", body=b"x")
            assert "'send'" in status.closed_with()["message"]
        payload = msgpack.packb([1, "ping", {"pad": b"x" * 200_000}], use_bin_type=True)
        with raw(_status_url(store)) as status:
            # The broker answers from the length alone and closes, maybe before this
            # side has written the rest (200 KB, more than a socket buffer takes): the
            # write then fails with EPIPE, and the error frame is still there to read
            # (seen in a clean-clone run of round 20 under load).
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                status.send_raw(len(payload).to_bytes(4, "big") + payload)
            error = status.closed_with()
        assert error["code"] == "FrameTooLargeError", error
        with raw(_status_url(store)) as status:  # control: a small frame is served
            assert status.call("ping") is None
