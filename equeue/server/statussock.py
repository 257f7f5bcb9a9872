"""The status socket, ``STORE/status.sock``: ``stats`` and ``ping`` for the store's owner
past ``max_connections`` (reviewg F7: ``equeue serve STORE --status`` was refused by a
full broker, the moment an operator needs it).

A Unix socket of its own, mode 0600 as every listener the broker makes (only the
broker's user, or root, can connect), rather than a reserve on the clients' listeners:
an ordinary client is refused at its connect as before, whichever socket it uses, and
nothing is checked per request on the clients' paths. Its connections are not counted
against ``max_connections``; at most ``STATUS_CONNECTIONS`` are open at a time (more
are refused), each serves ``stats`` and ``ping`` only (any other op closes it), frames
of at most 64 KiB, and is closed after its ``stats`` answer or ``hello_timeout_ms``
after it opened. So it is never a way in for ordinary work, nor for a TCP client.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from equeue.errors import LimitExceededError, ProtocolError
from equeue.protocol.bounded import Refused, decode_request
from equeue.protocol.frames import HELLO_MAX_FRAME_BYTES, FrameReader, check_request
from equeue.protocol.ops import OPS
from equeue.server.connection import Connection

if TYPE_CHECKING:
    from equeue.server.serve import Broker

log = logging.getLogger("equeue.server")

STATUS_CONNECTIONS = 2  # open at a time: an operator's --status and one more
STATUS_OPS = frozenset({"stats", "ping"})


class StatusConnection(Connection):
    """A connection of the status socket. Its own ``_request`` means the C readers of
    sends never take its reads (connection.py ``_reads_own``, cext/sendlane.c)."""

    def __init__(self, broker: Broker, listener: str, number: int) -> None:
        super().__init__(broker, listener, number)
        self.where += " (status socket)"
        self._reader = FrameReader(HELLO_MAX_FRAME_BYTES, self.where)  # a stats is small
        # (and the whole-frame read's own bound: data_received checks it, not the reader's;
        # review6 R6-2: a 200,000-byte frame in one read was decoded)
        self._max_frame_bytes = HELLO_MAX_FRAME_BYTES
        self._lifetime: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        broker = self.broker
        open_before = len(broker.status_connections)
        broker.status_connections.add(self)  # (not counted against max_connections)
        super().connection_made(transport)
        if self.closed:  # a draining broker's refusal
            return
        if open_before >= STATUS_CONNECTIONS:
            self._fatal(
                LimitExceededError(
                    f"{self.where}: {open_before} status connections are open already (at "
                    f"most {STATUS_CONNECTIONS}, each closed after its stats answer or "
                    f"hello_timeout_ms={broker.config.hello_timeout_ms})"
                )
            )
            return
        self._lifetime = broker.loop.call_later(
            broker.config.hello_timeout_ms / 1000, self._expired
        )

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.broker.status_connections.discard(self)
        if self._lifetime is not None:
            self._lifetime.cancel()

    def _expired(self) -> None:
        self._lifetime = None
        limit = self.broker.config.hello_timeout_ms
        self._fatal(
            LimitExceededError(
                f"{self.where}: open for {limit} ms without a stats request (a status "
                f"connection lives at most hello_timeout_ms={limit}; equeue serve "
                "--hello-timeout-ms)"
            )
        )

    def _request(self, body: bytes) -> None:
        try:
            decoded = decode_request(
                body, self.where, self._max_items, self._items_setting,
                self._max_objects, self._objects_setting,
            )  # fmt: skip
        except Refused as refused:
            raise ProtocolError(f"{refused.error} (on the status socket)") from None
        _, op, _ = check_request(decoded, self.where)
        if op not in STATUS_OPS:
            # a known op by name; anything else by its length, not the string (a client
            # that put its token there gets no echo: review6 R6-1, as ops.check_args)
            what = repr(op) if op in OPS else f"(a string of {len(op)} characters)"
            raise ProtocolError(  # (the connection closes: data_received's _fatal)
                f"{self.where}: op {what} on the status socket: it serves "
                f"{' and '.join(sorted(STATUS_OPS))} only; other ops go to the broker's "
                "listeners"
            )
        super()._request(body)
        if op == "stats" and not self.closed:
            self.close()  # after its answer (close writes what is queued first)
