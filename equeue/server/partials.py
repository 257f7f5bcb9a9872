"""Which frames begun give way when ``max_partial_frame_bytes`` is passed: the one that has
made no progress longest first (reviewg F16).

A frame begun is buffered whole before it is served, so the bytes of every connection's
unfinished frame are counted broker-wide against ``max_partial_frame_bytes``. Closing the
connection whose read passes the cap would keep the budget first come, first kept: peers
that begin large frames and stall would hold it for ever, and a good client's next large
request would be the one closed. Instead the connections whose frames have waited longest
since their last byte are closed, oldest first, until the total is under the cap again;
the connection reading now has just made progress and is closed only if no other holds a
frame begun (it cannot pass the cap alone: the cap is at least max_frame_bytes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from equeue.errors import LimitExceededError
from equeue.protocol.frames import FrameReader

if TYPE_CHECKING:
    from equeue.server.connection import Connection


def make_room(reading: Connection) -> None:
    """Bring the broker's partial-frame bytes under the cap by closing the stalest frames
    begun on other connections; LimitExceededError (the caller closes ``reading``) if that
    is not enough. Called only once the cap is passed, so the scan over the broker's
    connections is not on the common path."""
    broker = reading.broker
    cap = broker.config.max_partial_frame_bytes
    now = broker.loop.time()
    stalled = sorted(
        (c for c in broker.connections if c._partial and c is not reading and not c.closed),
        key=lambda c: c._partial_moved,
    )
    for victim in stalled:
        if broker.partial_bytes <= cap:
            return
        held = victim._partial
        total = broker.partial_bytes
        victim._fatal(
            LimitExceededError(
                f"{victim.where}: {total} bytes of frames begun are buffered over every "
                f"connection (max_partial_frame_bytes={cap}; equeue serve "
                f"--max-partial-frame-bytes); this connection's frame ({held} bytes of it) "
                f"has had no byte for {now - victim._partial_moved:.1f} s, the longest: closed "
                "to make room"
            )
        )
        release(victim)
    if broker.partial_bytes > cap:
        raise LimitExceededError(
            f"{reading.where}: {broker.partial_bytes} bytes of frames begun are buffered over "
            f"every connection, {reading._partial} of them this one's "
            f"(max_partial_frame_bytes={cap}; equeue serve --max-partial-frame-bytes); "
            "closing this connection"
        )


def release(victim: Connection) -> None:
    """Give a closed connection's frame begun back at once (its socket may take a while to
    close): the count, and the bytes, with a fresh reader (a closed connection reads no more)."""
    victim.broker.partial_bytes -= victim._partial
    victim._partial = 0
    victim._reader = FrameReader(victim.broker.config.max_frame_bytes, victim.where)
