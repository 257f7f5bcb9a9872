"""A connection of the blocking client (equeue.client.sync) and its requests in flight:
the state the reader's turn, the sleepers and the closing of a connection work on."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from typing import Any

from equeue.client.calls import Given
from equeue.client.connect import RECV_BYTES
from equeue.client.core import AnswerReader, RequestEncoder
from equeue.errors import EQueueError
from equeue.protocol.frames import STATUS_OK
from equeue.protocol.handshake import Welcome


class _Slot:
    """One request in flight: filled by the reader with the answer or the failure."""

    __slots__ = ("deadline", "done", "error", "op", "payload", "status", "unanswered")

    def __init__(self, op: str, unanswered: Given, deadline: float) -> None:
        self.op = op
        self.unanswered = unanswered
        self.deadline = deadline
        self.done = False
        self.status = STATUS_OK
        self.payload: Any = None
        self.error: EQueueError | None = None


def _deadline(slot: _Slot) -> float:
    return slot.deadline


class _Connection:
    __slots__ = (
        "broken", "encoder", "inbuf", "inbufs", "io_lock", "pending", "plain", "quiet_at",
        "reader", "sock", "welcome",
    )  # fmt: skip

    def __init__(self, sock: socket.socket, welcome: Welcome, reader: AnswerReader) -> None:
        self.sock = sock
        self.welcome = welcome
        self.reader = reader
        self.encoder = RequestEncoder.for_welcome(welcome, reader.where)
        self.pending: dict[int, _Slot] = {}
        self.broken = False
        self.inbuf = memoryview(bytearray(RECV_BYTES))  # read into, by the reader only
        self.inbufs = (self.inbuf,)  # (for map: _read_some)
        # One SSL object must not read and write in two threads at once.
        tls = isinstance(sock, ssl.SSLSocket)
        self.io_lock: Any = threading.Lock() if tls else contextlib.nullcontext()
        self.plain = not tls  # read with a blocking recv (the kernel's timeout), no poll
        self.quiet_at = time.monotonic()  # when the last answer was read
