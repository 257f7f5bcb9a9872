"""The asyncio client's loop check: a client serves the tasks of the loop its connection
was made on. A call from another loop would write on a transport of a loop that is not
running (its answer then never read: a hang) or await a future of another loop (asyncio's
RuntimeError); it is refused before anything is written, with WrongLoopError."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from asyncio.events import _get_running_loop as running_loop  # (C; None outside a loop)
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from equeue.errors import WrongLoopError
from equeue.protocol.plainsend import conn_type

if TYPE_CHECKING:
    from equeue.client.aio import _Protocol

__all__ = ["close_from_here", "future_of", "running_loop", "wrong_loop"]


def _future_of(protocol: _Protocol) -> asyncio.Future[Any] | None:
    """A Future of the running loop if it is the connection's, else None (a caller on
    another loop); in C (ClientConn.future_of) with the accelerator."""
    return asyncio.Future() if protocol.loop is running_loop() else None


future_of: Callable[[_Protocol], asyncio.Future[Any] | None] = (
    _future_of if conn_type is None else conn_type.future_of  # type: ignore[attr-defined]
)


def _name(loop: asyncio.AbstractEventLoop | None) -> str:
    if loop is None:
        return "no running event loop"
    state = "closed" if loop.is_closed() else "running" if loop.is_running() else "not running"
    return f"{type(loop).__name__} at {id(loop):#x} ({state})"


def wrong_loop(own: asyncio.AbstractEventLoop, url: str) -> WrongLoopError:
    """The error of a call made on the running loop to a client of ``own``."""
    return WrongLoopError(
        f"the asyncio client of {url} is called from a task on a different loop "
        f"({_name(running_loop())}) than the one its connection was made on "
        f"({_name(own)}); nothing was sent. A client serves the tasks of its own loop "
        "only: connect one on each loop (equeue.aio.connect)"
    )


def close_from_here(protocol: _Protocol, reason: str) -> None:
    """Close ``protocol`` from the running loop, which may not be its own (``close()`` is
    allowed from anywhere): on its own loop, or one idle on this thread, at once; on a
    loop running on another thread, there; on a closed loop (whose callbacks, a future's
    or the transport's, can no longer run: asyncio would raise RuntimeError) the socket
    is shut, so the broker sees the end, closed, and the connection marked closed."""
    loop = protocol.loop
    if loop is running_loop() or not (loop.is_running() or loop.is_closed()):
        protocol.fail(reason, None)
    elif loop.is_closed():
        protocol.closed = True
        transport = protocol.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            # Closed too: no callback of the dead loop will ever close it, and left to the
            # garbage collector it was an unclosed socket (reviewk F10, a client made in
            # one asyncio.run() closed in a later one). asyncio's TransportSocket wraps
            # the socket and has no close; uvloop's has neither (its own, left alone).
            close = getattr(getattr(sock, "_sock", sock), "close", None)
            if close is not None:
                with contextlib.suppress(OSError):
                    close()
    else:
        with contextlib.suppress(RuntimeError):  # (it closed meanwhile: nothing to run)
            loop.call_soon_threadsafe(protocol.fail, reason, None)
