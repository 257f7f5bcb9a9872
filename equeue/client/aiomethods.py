"""``request`` and MessageStore's methods of the asyncio client (``equeue.aio.connect``'s
AsyncClient) but ``send``, each a coroutine of one request: its arguments checked and
encoded by equeue/client/calls.py, run by the client's ``_call`` (equeue/client/aio.py:
the connection, its protocol, the reconnect). ``send`` stays in aio.py: its plain case
takes the protocol's own paths (``direct``, the coalescer) and is a coroutine in C
(csend.py).

Functions bound into AsyncClient's class body (as store/storesend.py's into
MessageStore): the same function objects are the client's methods, looked up as before.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from equeue.client import calls
from equeue.client.calls import Call
from equeue.client.core import PULL_OPS, SEND_OPS, batch_results
from equeue.client.groupstate import (
    DEFAULT_AUTO_COMMIT_INTERVAL,
    DEFAULT_MAX_POLL_INTERVAL,
    DEFAULT_PREFETCH,
    DEFAULT_SESSION_TIMEOUT,
)
from equeue.errors import EQueueError, InvalidTypeError
from equeue.protocol.ops import check_args
from equeue.store.consumerargs import Start
from equeue.store.groupdeletion import DeletedGroup
from equeue.store.types import Message, OutgoingMessage, PullResult, SendResult

if TYPE_CHECKING:
    from equeue.client.aio import AsyncClient
    from equeue.client.consumer_aio import AsyncGroupConsumer


async def _made(self: AsyncClient, make: Callable[..., Call], *arguments: Any) -> Call:
    """``make(*arguments)``; an argument it refuses is reported after the broker
    reports the topic or queue missing, if it is (calls.Probe: the store's order)."""
    try:
        return make(*arguments)
    except calls.Probe as probe:
        try:
            found = await self._call(probe.call)
        except EQueueError:
            if probe.judge is None:
                raise  # the store's earlier error: the topic or queue is missing
            raise probe.error from None
        earlier = probe.judge(found) if probe.judge is not None else None
        raise (earlier or probe.error) from None


async def request(self: AsyncClient, op: str, arguments: dict[str, Any]) -> Any:
    """One request as the protocol has it (docs/protocol.md): its result as msgpack
    decodes it, or its error raised; arguments held to the op table first."""
    if not isinstance(op, str) or not isinstance(arguments, dict):
        raise InvalidTypeError("request takes an op (str) and its arguments (dict)")
    check_args(op, arguments, f"request to {self.url}")
    wait = arguments.get("wait_ms", 0) / 1000 if op in PULL_OPS else 0.0
    messages = [arguments] if op in SEND_OPS else None
    return await self._call(Call(op, arguments, messages, wait), decode=False)


async def send_batch(
    self: AsyncClient, topic: str, messages: Iterable[bytes | OutgoingMessage | dict[str, Any]]
) -> list[SendResult]:
    call = await self._made(calls.send_batch, topic, messages)
    return batch_results(await self._call(call), call.args, self.url)


async def pull(
    self: AsyncClient,
    topic: str,
    queue_id: int,
    offset: int,
    max_count: int = 32,
    tags: str | Iterable[str] | None = None,
    wait: float = 0.0,
    *,
    max_bytes: int | None = None,
) -> PullResult:
    result: PullResult = await self._call(
        await self._made(calls.pull, topic, queue_id, offset, max_count, tags, wait, max_bytes)
    )
    return result


async def get(self: AsyncClient, message_id: str) -> Message:
    result: Message = await self._call(calls.get(message_id))
    return result


async def query_by_key(self: AsyncClient, topic: str, key: str, limit: int = 32) -> list[Message]:
    """As MessageStore.query_by_key, an answer cut to the frame followed by requests
    for the rest (as the sync client's)."""
    found: list[Message] = []
    before: int | None = None
    while True:
        call = await self._made(calls.query_by_key, topic, key, limit - len(found), before)
        page, before = await self._call(call)
        found += page
        if before is None or len(found) >= limit:
            return found


async def offset_for_time(
    self: AsyncClient, topic: str, queue_id: int, timestamp: float | dt.datetime
) -> int:
    result: int = await self._call(
        await self._made(calls.offset_for_time, topic, queue_id, timestamp)
    )
    return result


async def commit_offset(
    self: AsyncClient, group: str, topic: str, queue_id: int, offset: int
) -> None:
    await self._call(await self._made(calls.commit_offset, group, topic, queue_id, offset))


async def committed_offset(self: AsyncClient, group: str, topic: str, queue_id: int) -> int | None:
    result: int | None = await self._call(
        await self._made(calls.committed_offset, group, topic, queue_id)
    )
    return result


async def delete_group(
    self: AsyncClient, group: str, *, delete_dead_letters: bool = False
) -> DeletedGroup:
    """Delete consumer group ``group`` (protocol version 5; no member may be live): its
    committed offsets, its retry topic and, with ``delete_dead_letters``, its
    dead-letter topic, as ``MessageStore.delete_group``. Raises GroupError while the
    group has live members, GroupNotFoundError for a group the store does not have,
    BrokerTooOldError from a broker older than version 5 (nothing sent)."""
    result: DeletedGroup = await self._call(calls.delete_group(group, delete_dead_letters))
    return result


async def create_topic(self: AsyncClient, topic: str, queue_count: int | None = None) -> None:
    await self._call(calls.create_topic(topic, queue_count))


async def topics(self: AsyncClient) -> list[str]:
    result: list[str] = await self._call(calls.topics())
    return result


async def deleted_topics(self: AsyncClient) -> dict[str, int]:
    result: dict[str, int] = await self._call(calls.deleted_topics())
    return result


async def queue_ids(self: AsyncClient, topic: str) -> list[int]:
    result: list[int] = await self._call(calls.queue_ids(topic))
    return result


async def queue_range(self: AsyncClient, topic: str, queue_id: int) -> tuple[int, int]:
    result: tuple[int, int] = await self._call(await self._made(calls.queue_range, topic, queue_id))
    return result


async def stats(self: AsyncClient, group: str | None = None) -> dict[str, Any]:
    """The broker's counters and a summary of its groups; with ``group``, that group's
    lag per queue, members and assignment (docs/protocol.md, "stats")."""
    result: dict[str, Any] = await self._call(calls.stats(group))
    return result if group is None else calls.one_group(result, group)


async def ping(self: AsyncClient) -> None:
    await self._call(calls.ping())


def consumer(
    self: AsyncClient,
    group: str,
    topics: str | Iterable[str],
    *,
    tags: str | Iterable[str] | None = None,
    start: Start = "committed",
    batch_size: int = 32,
    prefetch: int = DEFAULT_PREFETCH,
    auto_commit: bool = True,
    auto_commit_interval: float = DEFAULT_AUTO_COMMIT_INTERVAL,
    session_timeout: float = DEFAULT_SESSION_TIMEOUT,
    max_retries: int | None = None,
    timeout: float | None = None,
    consumer_id: str | None = None,
    max_poll_interval: float = DEFAULT_MAX_POLL_INTERVAL,
) -> AsyncGroupConsumer:
    """A member of consumer group ``group`` on this client; it joins on ``start()``
    or entering ``async with``. AsyncGroupConsumer's options, checked as the store's
    ``consumer`` checks its own (docs/groups.md)."""
    from equeue.client.consumer_aio import AsyncGroupConsumer

    return AsyncGroupConsumer(
        self, group, topics, tags=tags, start=start, batch_size=batch_size,
        prefetch=prefetch, auto_commit=auto_commit,
        auto_commit_interval=auto_commit_interval, session_timeout=session_timeout,
        max_retries=max_retries, timeout=timeout, consumer_id=consumer_id,
        max_poll_interval=max_poll_interval,
    )  # fmt: skip
