"""``AsyncClient.send`` in C when the accelerator is built (equeue/cext/sendcoro.c).

``fast(send)`` is the class's ``send``: without the accelerator the ``async def`` itself;
with it a callable whose plain call ``send(topic, body)`` returns a coroutine written in C
(what the async def's direct case does, without its Python frame) and whose every other
call is the async def's coroutine. Either is awaited, given to ``create_task``,
``gather`` or ``wait_for`` alike (docs/client.md, "send's coroutine in C").
"""

from __future__ import annotations

from asyncio import coroutines
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar, cast

from equeue.client.core import DECODERS, answer_error
from equeue.protocol.frames import STATUS_OK
from equeue.protocol.sendcoro import coro_type, send_method
from equeue.store.types import SendResult

_decode_send = DECODERS["send"]

F = TypeVar("F", bound=Callable[..., Coroutine[Any, Any, Any]])


def answered(client: Any, answer: tuple[int, Any]) -> SendResult:
    """A direct send's answer read the general way: as the async def decodes it."""
    status, payload = answer
    if status != STATUS_OK:
        raise answer_error(payload, client.url)
    return cast(SendResult, _decode_send(payload, client.url))


def fast(send: F) -> F:
    if send_method is None:
        return send
    return cast(F, send_method(send, answered, coroutines._is_coroutine))  # type: ignore[attr-defined]


if coro_type is not None:  # (asyncio.iscoroutine would find it by its methods; said once)
    Coroutine.register(coro_type)
