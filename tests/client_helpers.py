"""Helpers of the client tests (not a test module): a fake broker speaking a script over
a real Unix socket, to hand the clients what a real broker never sends."""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from equeue.protocol.frames import DEFAULT_MAX_FRAME_BYTES, FrameReader, decode_body, encode

WELCOME: dict[str, Any] = {
    "version": 1,
    "server": "fake",
    "limits": {"max_frame_bytes": DEFAULT_MAX_FRAME_BYTES, "max_in_flight": 64,
               "max_connections": 8},
}  # fmt: skip


class Peer:
    """The fake broker's side of one connection."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = FrameReader(1 << 26, "fake")
        self.bodies: list[Any] = []

    def recv(self) -> Any:
        """The next frame body from the client; EOFError when it closed."""
        while not self.bodies:
            data = self.sock.recv(1 << 16)
            if not data:
                raise EOFError
            self.bodies += [decode_body(b, "fake") for b in self.reader.feed(data)]
        return self.bodies.pop(0)

    def send(self, body: object) -> None:
        self.sock.sendall(encode(body))

    def raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def welcome(self) -> Any:
        """Take the hello, send the welcome; the hello."""
        hello = self.recv()
        self.send(WELCOME)
        return hello


Script = Callable[[Peer], None]


class FakeBroker:
    """Accepts connections on a Unix socket and runs ``script`` on each, in turn, in a
    thread; ``connections`` counts them."""

    def __init__(self, script: Script) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="eq", dir="/tmp"))
        self.path = self.dir / "fake.sock"
        self.url = f"unix:{self.path}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.path))
        self.listener.listen(8)
        self.listener.settimeout(0.1)
        self.script = script
        self.connections = 0
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            sock.settimeout(10)
            try:
                self.script(Peer(sock))
            except (EOFError, OSError):
                pass
            except BaseException as exc:  # a defect of the script: the test reports it
                self.errors.append(exc)
            finally:
                sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.listener.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> FakeBroker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        assert not self.errors, self.errors
