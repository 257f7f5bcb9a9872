"""Which event loop the broker runs on: uvloop (libuv, its transports in C) where it is
installed and chosen, else asyncio's own. ``ServerConfig.event_loop`` / ``equeue serve
--event-loop``: ``auto`` (uvloop if importable), ``uvloop`` (refused if missing),
``asyncio``."""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from equeue.errors import ConfigError

T = TypeVar("T")
LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def loop_factory(choice: str) -> tuple[str, LoopFactory]:
    """The loop's name and its factory for ``choice`` (``auto``, ``uvloop``, ``asyncio``)."""
    if choice != "asyncio":
        try:
            uvloop = importlib.import_module("uvloop")
        except ImportError as exc:
            if choice == "uvloop":
                raise ConfigError(
                    f"event_loop='uvloop' but uvloop cannot be imported ({exc}): "
                    "pip install uvloop, or --event-loop asyncio"
                ) from None
        else:
            factory: LoopFactory = uvloop.new_event_loop
            return "uvloop", factory
    return "asyncio", asyncio.new_event_loop


def run(main: Coroutine[Any, Any, T], choice: str) -> T:
    """``asyncio.run(main)`` on the loop ``choice`` names."""
    _, factory = loop_factory(choice)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
