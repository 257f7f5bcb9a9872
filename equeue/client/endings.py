"""How a request of the blocking client (equeue.client.sync) ends early: a long poll
whose caller was interrupted is given up (cancel_pull, protocol version 6: reviewk F4),
and a write that finds the broker gone reads what the broker wrote before it closed (a
stopping broker's last frame says which requests it never served: reviewk F9).

Both run in an exception's path (an interrupt, a broken pipe) and must neither block
nor leave a lock or the reader's turn taken wherever another interrupt lands: the
acquire's result is stored by C code, the turn taken inline under the lock, as in
turns.py."""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING

from equeue.client.inflight import _Connection, _Slot
from equeue.protocol.frames import CANCEL_PULL_VERSION

if TYPE_CHECKING:
    from equeue.client.sync import Client


def give_up(client: Client, conn: _Connection, slot: _Slot, *, lock_wait: float = 0.0) -> None:
    """A long poll whose caller was interrupted (a KeyboardInterrupt) before its
    answer, or whose group consumer is closing: the broker (protocol version 6) is asked
    to answer it now (cancel_pull), so that its place under max_in_flight comes back
    within a round trip, not at its wait's end; both answers are dropped. Best effort,
    never blocking the interrupt: not when another thread holds the write lock
    (send_many waiting for places; a close waits up to ``lock_wait`` seconds for it) or
    the socket takes the frame only in part or not at once (a frame cut short breaks
    the connection, which ends the pull too), nor under TLS or to an older broker
    (the pull runs out, as before)."""
    if slot.done or conn.broken or not conn.plain or conn.encoder.version < CANCEL_PULL_VERSION:
        return
    taken: list[bool] = []
    cancel_id = 0
    try:
        # (stored by C code: an interrupt as acquire returns leaves it known)
        lock = client._write_lock
        taken.extend(map(lock.acquire, (lock_wait > 0,), (lock_wait if lock_wait > 0 else -1,)))
        if not taken[0]:
            return
        with client._cond:
            request_id = next((i for i, s in conn.pending.items() if s is slot), 0)
            if not request_id or conn.broken:
                return
            cancel_id = client._next_id
            client._next_id += 1
            frame = conn.encoder.frame(cancel_id, "cancel_pull", {"request_id": request_id})
            conn.pending[cancel_id] = _Slot("cancel_pull", None, slot.deadline)
        try:
            written = conn.sock.send(frame, socket.MSG_DONTWAIT)
        except OSError:  # (EAGAIN: the socket's buffer is full; nothing written)
            written = 0
        if written == len(frame):
            cancel_id = 0  # its answer is handed in and dropped, as the pull's
        elif written:
            client._break(
                conn, f"the connection to {client.url} broke: a cancel_pull cut short", None
            )
    finally:
        if cancel_id and not conn.broken:  # (not written: no answer comes)
            with client._cond:
                conn.pending.pop(cancel_id, None)
        if taken and taken[0]:
            client._write_lock.release()


def peer_gone(client: Client, exc: BaseException, conn: _Connection) -> bool:
    """A write on ``conn`` failed with ``exc``: whether the broker is gone (EPIPE,
    ECONNRESET on a plain socket) and the rest of what it wrote is being read, so the
    writer leaves the connection to that read rather than breaking it (a break would
    make every request in flight unanswered, the ones answered before it and the ones a
    stopping broker never served alike). The rest is read here if no other thread has
    the reader's turn; else that thread reads it: the stream has ended, so its read
    returns the rest, then the end, which breaks the connection."""
    if not conn.plain or not isinstance(exc, BrokenPipeError | ConnectionResetError):
        return False
    read_rest(client, conn)
    return True


def read_rest(client: Client, conn: _Connection) -> None:
    """A write found the broker gone (EPIPE, ECONNRESET): what it wrote before it
    closed may still wait in the socket, a stopping broker's last frame among it
    (BrokerStoppingError: which requests it never served, so unsent, not unanswered).
    Read without blocking, unless another thread has the reader's turn (it reads them
    then); whatever does not end the connection here, the caller's break does."""
    if not conn.plain:  # (TLS: no read without blocking here)
        return
    turn = False
    try:
        with client._cond:
            if client._reading or conn.broken:
                return
            client._reading = turn = True  # (no call between: no interrupt lands there)
        while not conn.broken:
            try:
                count = conn.sock.recv_into(conn.inbuf, 0, socket.MSG_DONTWAIT)
            except OSError:  # nothing more (EAGAIN), or the reset after the last byte
                return
            client._received(conn, conn.inbuf[:count])  # (0: the end, which breaks it)
    finally:
        if turn:  # (given up inline: no function's entry before, no interrupt lands)
            client._reading = False
            client._end_turn()
