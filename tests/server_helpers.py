"""Raw-socket access to a broker for the server tests: frames from equeue/protocol only,
so these tests do not depend on the clients."""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from equeue.protocol.frames import (
    SUPPORTED_VERSIONS,
    FrameReader,
    check_answer,
    decode_body,
    encode,
)

TIMEOUT_S = 20.0


def short_dir() -> Path:
    """A directory whose socket paths fit in sun_path (tmp_path may be too long); removed
    when the test process ends, at the latest (pytest's tmp_path is not used, so nothing
    else would: a suite run used to leave ~40 stores of ~1.3 MB in /tmp)."""
    directory = Path(tempfile.mkdtemp(prefix="eq", dir="/tmp"))
    atexit.register(_remove_from, os.getpid(), directory)
    return directory


def _remove_from(pid: int, directory: Path) -> None:
    """At exit of the process that made ``directory`` only: a child forked from it (the
    fork tests, fork_child.py's) runs its atexit handlers too, and removed the stores of
    brokers the test process still ran (round 21's clean-clone run: every test after the
    first fork test that exits through Python's shutdown errored)."""
    if os.getpid() == pid:
        shutil.rmtree(directory, ignore_errors=True)


def short_home() -> Iterator[Path]:
    """A short_dir, removed afterwards: ``home = pytest.fixture(short_home, name="home")``."""
    directory = short_dir()
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def broker_with_topic_t() -> Iterator[Any]:
    """A BrokerThread whose store has topic t of 4 queues, in a short_dir removed
    afterwards: ``broker = pytest.fixture(broker_with_topic_t, scope="module", name=...)``."""
    from equeue.server import BrokerThread

    base = short_dir()
    try:
        with BrokerThread(base / "store") as thread:
            thread.store.create_topic("t", 4)
            yield thread
    finally:
        shutil.rmtree(base, ignore_errors=True)


class Raw:
    """One connection speaking the protocol by hand: every version the package speaks
    unless ``versions`` says (the broker refuses an op above the version it chose)."""

    def __init__(
        self,
        url: str,
        *,
        hello: bool = True,
        token: str | None = None,
        versions: tuple[int, ...] = SUPPORTED_VERSIONS,
    ) -> None:
        if url.startswith("unix:"):
            self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self.sock.settimeout(TIMEOUT_S)
            self.sock.connect(url[5:])
        else:
            host, port = url.split("://")[1].rsplit(":", 1)
            self.sock = socket.create_connection((host, int(port)), TIMEOUT_S)
        self.reader = FrameReader(1 << 30, "test")
        self.bodies: list[Any] = []
        self.next_id = 1
        self.welcome: Any = None
        if hello:
            hello_map = {"versions": list(versions), "token": token, "client": "test"}
            self.sock.sendall(encode(hello_map))
            self.welcome = self.recv()

    def recv(self) -> Any:
        """The next frame body; ConnectionError at EOF."""
        while not self.bodies:
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("the broker closed the connection")
            self.bodies += [decode_body(b, "test") for b in self.reader.feed(data)]
        return self.bodies.pop(0)

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request(self, op: str, **args: Any) -> int:
        rid = self.next_id
        self.next_id += 1
        self.sock.sendall(encode([rid, op, args]))
        return rid

    def answers(self, count: int) -> dict[int, tuple[int, Any]]:
        found: dict[int, tuple[int, Any]] = {}
        while len(found) < count:
            rid, status, payload = check_answer(self.recv(), "test")
            found[rid] = (status, payload)
        return found

    def call(self, op: str, **args: Any) -> Any:
        """The result; AssertionError carrying the error map if the answer is an error."""
        rid = self.request(op, **args)
        got_id, status, payload = check_answer(self.recv(), "test")
        assert got_id == rid, (got_id, rid)
        if status != 0:
            raise AssertionError(payload)
        return payload

    def error(self, op: str, **args: Any) -> dict[str, str]:
        rid = self.request(op, **args)
        got_id, status, payload = check_answer(self.recv(), "test")
        assert (got_id, status) == (rid, 1), (got_id, status, payload)
        return payload  # type: ignore[no-any-return]

    def closed_with(self) -> dict[str, str]:
        """The connection error (request id 0) the broker sent before closing."""
        rid, status, payload = check_answer(self.recv(), "test")
        assert (rid, status) == (0, 1), (rid, status, payload)
        try:
            extra = self.recv()
        except (ConnectionError, OSError):
            return payload  # type: ignore[no-any-return]
        raise AssertionError(f"the connection stayed open: {extra!r}")

    def close(self) -> None:
        self.sock.close()


@contextmanager
def raw(url: str, **kwargs: Any) -> Iterator[Raw]:
    connection = Raw(url, **kwargs)
    try:
        yield connection
    finally:
        connection.close()


def keepalive_of(running: Any) -> list[tuple[int, ...]]:
    """(SO_KEEPALIVE, TCP_KEEPIDLE, TCP_KEEPINTVL, TCP_KEEPCNT) of each of a
    BrokerThread's TCP connections, as the broker's side of the socket has them."""
    tcp = (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT)
    found = []
    for conn in list(running.broker.connections):
        sock = conn.transport.get_extra_info("socket")
        if sock.family == socket.AF_UNIX:
            continue
        on = sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        found.append((on, *(sock.getsockopt(socket.IPPROTO_TCP, option) for option in tcp)))
    return found
