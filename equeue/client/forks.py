"""What a forked child does with the asyncio clients its parent made.

An asyncio client's socket, and the epoll sets of the loop that reads it (the loop's
selector, rawconn's read mux), are shared with the parent after a fork: a child that
runs the inherited loop would read answers meant for the parent and hand them to its
own requests of the same id (reviewk F1: a SendResult naming the other process's
message). The child cannot connect anew on that loop either (its epoll set is the
parent's), so the client is closed in the child, and its socket's descriptor number is
pointed at a socket whose peer is gone (``dup2``). Not closed: the transport still holds
the number, and a close would let the child's next descriptor take it. Whatever the
child's copy of the transport then does, reading (end of file), writing (EPIPE) or
removing the number from an epoll set (the set looks the number up in the child's table:
not found), reaches the dead socket and never the parent's connection. A connection on
shared rings has a hook of its own (shmconn.py): the child unmaps every ring, then points
each group's wake-up socket at a dead socket as above.

A group member (GroupConsumer, AsyncGroupConsumer) made before a fork is closed in the
child too (reviewk F2: both processes pulled as the one member, same consumer id and
join_id, and every message was handled in each). Closed, not rejoined: a member of its
own in the child is a second consumer the application did not ask for, and the child
must not commit or leave for the parent, whose membership goes on. Its calls raise
ClosedError naming the fork; its close() does nothing.
"""

from __future__ import annotations

import contextlib
import os
import socket
import weakref
from typing import Protocol


class Forkable(Protocol):
    def after_fork(self, parent: int) -> None: ...


_LIVE: weakref.WeakSet[Forkable] = weakref.WeakSet()
_pid = os.getpid()


def track(client: Forkable) -> None:
    _LIVE.add(client)


def made_before_fork(parent: int) -> str:
    """The words of a ClosedError in the child: "<the object> " + this."""
    return f"was made in process {parent}, before this process forked from it"


def point_at_a_dead_socket(fd: int) -> None:
    """``fd`` refers to a socket whose peer has closed from now on (this process only)."""
    ours, theirs = socket.socketpair()
    theirs.close()
    try:
        os.dup2(ours.fileno(), fd, inheritable=False)
    finally:
        ours.close()


def _forked() -> None:
    global _pid
    parent, _pid = _pid, os.getpid()
    for client in list(_LIVE):
        with contextlib.suppress(OSError):  # (no descriptor left: nothing to point away)
            client.after_fork(parent)


os.register_at_fork(after_in_child=_forked)
