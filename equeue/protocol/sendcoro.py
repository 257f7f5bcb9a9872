"""AsyncClient.send's plain case as a coroutine in C (equeue/cext/sendcoro.c), bound once.

``send_method(py_send, answered, marker)``: the callable that replaces ``py_send`` (the
``async def``) on the class: ``send(topic, body)`` gives a C coroutine doing the direct
send, any other call py_send's coroutine. None without the accelerator.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from equeue import speedups

_fast = speedups.SPEEDUPS

send_method: Final[Callable[[Any, Any, Any], Any] | None] = (
    None if _fast is None else _fast.client_send_method
)
coro_type: Final[type | None] = None if _fast is None else _fast.client_send_coro_type()
