"""A client of the shared rings by hand (equeue/protocol/shmrings.py), for tests that
play a hostile or killed peer: its own socket, hello and ring, no equeue client."""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
from collections.abc import Callable
from typing import Any

from equeue.protocol import shmrings
from equeue.protocol.frames import FRAME_HEADER, FRAME_HEADER_SIZE, SUPPORTED_VERSIONS, encode

TIMEOUT_S = 20.0
# The answer ring's tail (the client's index): ring 1's indices at 256, its tail 64 on,
# its reader_sleeps (the client's: the broker wakes it when set) 128 on
ANSWERS_TAIL = 256 + 64
ANSWERS_READER_SLEEPS = 256 + 128


class RawShm:
    """One connection on rings: ``ring`` is the client's side (ShmRing), ``wake()``
    wakes the broker's reader."""

    def __init__(self, path: str, group: str | None = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(TIMEOUT_S)
        self.sock.connect(path)
        hello = {"versions": list(SUPPORTED_VERSIONS), "token": None, "client": "raw",
                 "shm": group or secrets.token_hex(8)}  # fmt: skip
        self.sock.sendall(encode(hello))
        data, fds = shmrings.recv_with_fds(self.sock, 1 << 16)
        # (3: round 15's eventfds, to broker, to client; 1: a group's later connection,
        # the wake-up end sent with its first: -1 here)
        assert len(fds) in ((1, 2, 3) if group else (2, 3)), fds
        (length,) = FRAME_HEADER.unpack_from(data, 0)
        assert len(data) == FRAME_HEADER_SIZE + length  # the welcome alone
        self.fds = fds
        self.memfd = fds[0]
        self.wake_fd = fds[1] if len(fds) > 1 else -1  # (the group's wake-up socket's end)
        self.client_wake_fd = fds[-1] if len(fds) > 1 else -1  # (what the broker wakes)
        self.size = os.fstat(self.memfd).st_size
        self.ring: Any = shmrings.ShmRing(self.memfd, self.size, shmrings.CLIENT)
        self.ring_bytes = (self.size - shmrings.HEADER_BYTES) // 2
        now: Callable[[Callable[[], None]], None] = lambda fire: fire()  # noqa: E731
        self.ring.waker = shmrings.ShmWaker(self.wake_fd, now)

    def write(self, data: bytes) -> int:
        """Bytes into the request ring (the broker woken if it sleeps): how many fit."""
        taken: int = self.ring.put(data)
        return taken

    def wake(self) -> None:
        # (the ring's own waker may have woken the broker already, and it closed the
        # connection and its group's end: nothing left to wake)
        with contextlib.suppress(BrokenPipeError):
            os.write(self.wake_fd, b"w" if len(self.fds) == 2 else (1).to_bytes(8, "little"))

    def read_all(self, limit: int = 1 << 20) -> bytes:
        buffer = bytearray(limit)
        n = self.ring.read_into(buffer)
        return bytes(buffer[:n])

    def socket_ended(self) -> bool:
        """Whether the broker closed the socket (waits up to TIMEOUT_S)."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()
        for fd in self.fds:
            os.close(fd)
