"""Who reads the asyncio client's own transports (rawconn.RawTransport) on a loop.

The first one open on a loop is the loop's reader itself (``loop.add_reader(fd,
transport.read_ready)``, as before). From the second on, all of the loop's are read
through one ReadMux (equeue/cext/readmux.c): an epoll set of their sockets whose
descriptor is the loop's one reader, its ``ready`` calling each ready transport's
``read_ready`` in C. It stays until its last transport stops reading; then the loop has
no reader of ours left. Where there is no epoll (``read_mux_type`` None) every transport
is a reader of its own.

Why: asyncio runs Python for every ready descriptor of a loop turn (the selector's
``_key_from_fd`` and its (key, events) pair, ``_process_events``, ``_add_callback``, the
Handle popped and run through its context). With a connection per task that was most of
what the client spent a send outside the read itself (docs/benchmarks.md, "perfclient").
With the ReadMux the loop sees one descriptor a turn, for one ``epoll_wait`` more a turn;
with one connection there is nothing to share, so it is not used.

The loop still decides when to read: ``ready`` runs as a reader callback in the loop's
turn, reads each ready socket once (a socket left ready is read in the next turn, as
asyncio's own reader would be), and an exception out of a read (SystemExit,
KeyboardInterrupt, or one of the transport's ``_fatal``) reaches the loop as one out of a
reader of the transport's own would."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any, Protocol

from equeue.protocol.plainsend import read_mux_type


class Readable(Protocol):
    fd: int

    def read_ready(self) -> None: ...


class _Readers:
    __slots__ = ("alone", "mux")

    def __init__(self) -> None:
        self.alone: Readable | None = None  # the loop's reader of its own
        self.mux: Any = None  # ReadMux, once a second transport reads


# The state is an attribute of the loop, not a value of a dict keyed by it: the transports
# it holds hold their loop, so a WeakKeyDictionary's entry would keep the loop (and every
# unclosed client's socket and the epoll descriptor) alive for ever; as an attribute it is
# an ordinary cycle that the collector frees with the loop (review 36-2 H1).
_ATTRIBUTE = "_equeue_readers"


def _readers_of(loop: asyncio.AbstractEventLoop, *, make: bool) -> _Readers | None:
    readers = getattr(loop, _ATTRIBUTE, None)
    if type(readers) is _Readers or not make:
        return readers if type(readers) is _Readers else None
    readers = _Readers()
    try:
        setattr(loop, _ATTRIBUTE, readers)
    except (AttributeError, TypeError):  # a loop that takes no attribute: no sharing
        return None
    return readers


def start(loop: asyncio.AbstractEventLoop, transport: Readable) -> None:
    """``transport``'s reads start on ``loop``."""
    mux_type = read_mux_type
    readers = None if mux_type is None else _readers_of(loop, make=True)
    if readers is None or mux_type is None:
        loop.add_reader(transport.fd, transport.read_ready)
        return
    if readers.mux is not None:
        readers.mux.add(transport)
    elif readers.alone is None:
        loop.add_reader(transport.fd, transport.read_ready)
        readers.alone = transport
    else:
        alone, mux = readers.alone, mux_type()
        try:
            mux.add(alone)
            mux.add(transport)
            # in a context of its own: the reads of every transport run in it, not in
            # the context of the task that happened to open the second connection
            contextvars.Context().run(loop.add_reader, mux.fileno(), mux.ready)
        except BaseException:
            mux.close()  # (the first is still the loop's reader: nothing changed)
            raise
        # No loop turn between: the first's socket is read by one reader at a time (its
        # Handle, were it queued in this turn, is cancelled by remove_reader).
        loop.remove_reader(alone.fd)
        readers.alone, readers.mux = None, mux


def stop(loop: asyncio.AbstractEventLoop, transport: Readable) -> None:
    """``transport``'s reads end on ``loop`` (before its socket is closed)."""
    readers = None if read_mux_type is None else _readers_of(loop, make=False)
    if readers is not None and readers.mux is not None and readers.mux.remove(transport):
        if not len(readers.mux):
            mux, readers.mux = readers.mux, None
            loop.remove_reader(mux.fileno())
            mux.close()
        return
    if readers is not None and readers.alone is transport:
        readers.alone = None
    loop.remove_reader(transport.fd)
