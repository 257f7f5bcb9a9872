"""The asyncio client's loop check: a client serves the tasks of the loop its connection
was made on. A call from another loop would write on a transport of a loop that is not
running (its answer then never read: a hang) or await a future of another loop (asyncio's
RuntimeError); it is refused before anything is written, with WrongLoopError."""

from __future__ import annotations

import asyncio
from asyncio.events import _get_running_loop as running_loop  # (C; None outside a loop)

from equeue.errors import WrongLoopError

__all__ = ["running_loop", "wrong_loop"]


def _name(loop: asyncio.AbstractEventLoop | None) -> str:
    if loop is None:
        return "no running event loop"
    state = "closed" if loop.is_closed() else "running" if loop.is_running() else "not running"
    return f"{type(loop).__name__} at {id(loop):#x} ({state})"


def wrong_loop(own: asyncio.AbstractEventLoop, url: str) -> WrongLoopError:
    """The error of a call made on the running loop to a client of ``own``."""
    return WrongLoopError(
        f"the asyncio client of {url} was connected on event loop {_name(own)} and is "
        f"called from a task on {_name(running_loop())}; nothing was sent. A client "
        "serves the tasks of its own loop only: connect one on each loop "
        "(equeue.aio.connect)"
    )
