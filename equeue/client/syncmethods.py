"""MessageStore's methods of the blocking client (``equeue.connect``'s Client): one
request each, its arguments checked and encoded by equeue/client/calls.py, run by the
client's ``_call`` (equeue/client/sync.py: the connection, the reader's turn).

Functions bound into sync.Client's class body (as store/storesend.py's into
MessageStore): the same function objects are the client's methods, looked up as before.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from equeue.client import calls
from equeue.client.calls import Call
from equeue.client.core import batch_results
from equeue.client.groupstate import (
    DEFAULT_AUTO_COMMIT_INTERVAL,
    DEFAULT_MAX_POLL_INTERVAL,
    DEFAULT_PREFETCH,
    DEFAULT_SESSION_TIMEOUT,
)
from equeue.errors import EQueueError
from equeue.store.consumerargs import Start
from equeue.store.groupdeletion import DeletedGroup
from equeue.store.types import Message, OutgoingMessage, PullResult, SendResult

if TYPE_CHECKING:
    from equeue.client.consumer import GroupConsumer
    from equeue.client.sync import Client

DEFAULT_WINDOW = 256


def _made(self: Client, make: Callable[..., Call], *arguments: Any) -> Call:
    """``make(*arguments)``; an argument it refuses is reported after the broker
    reports the topic or queue missing, if it is (calls.Probe: the store's order)."""
    try:
        return make(*arguments)
    except calls.Probe as probe:
        try:
            found = self._call(probe.call)
        except EQueueError:
            if probe.judge is None:
                raise  # the store's earlier error: the topic or queue is missing
            raise probe.error from None
        earlier = probe.judge(found) if probe.judge is not None else None
        raise (earlier or probe.error) from None


def send(
    self: Client,
    topic: str,
    body: bytes,
    *,
    tag: str = "",
    key: str | None = None,
    properties: dict[str, str] | None = None,
    code: int = 0,
    queue_id: int | None = None,
) -> SendResult:
    result: SendResult = self._call(calls.send(topic, body, tag, key, properties, code, queue_id))
    return result


def send_batch(
    self: Client, topic: str, messages: Iterable[bytes | OutgoingMessage | dict[str, Any]]
) -> list[SendResult]:
    """One request: the broker stores all or none (as MessageStore.send_batch)."""
    call = self._made(calls.send_batch, topic, messages)
    return batch_results(self._call(call), call.args, self.url)


def send_many(
    self: Client,
    topic: str,
    messages: Iterable[bytes | OutgoingMessage | dict[str, Any]],
    *,
    window: int = DEFAULT_WINDOW,
) -> list[SendResult]:
    """The messages in chunks of consecutive ones (one send_bodies or send_batch
    request each, all or nothing each), at most ``window`` messages in flight; the
    results in the messages' order. What a failure midway reports (``sent``,
    ``unsent``, ``unanswered``): equeue/client/many.py, docs/client.md."""
    from equeue.client.many import send_many

    return send_many(self, topic, messages, window)


def pull(
    self: Client,
    topic: str,
    queue_id: int,
    offset: int,
    max_count: int = 32,
    tags: str | Iterable[str] | None = None,
    wait: float = 0.0,
    *,
    max_bytes: int | None = None,
) -> PullResult:
    result: PullResult = self._call(
        self._made(calls.pull, topic, queue_id, offset, max_count, tags, wait, max_bytes)
    )
    return result


def get(self: Client, message_id: str) -> Message:
    result: Message = self._call(calls.get(message_id))
    return result


def query_by_key(self: Client, topic: str, key: str, limit: int = 32) -> list[Message]:
    """As MessageStore.query_by_key: up to ``limit`` messages, newest first. An answer
    the broker cut to its frame (max_frame_bytes, max_pull_count) is followed by
    requests for the rest, so the list is the store's whatever its size."""
    found: list[Message] = []
    before: int | None = None
    while True:
        call = self._made(calls.query_by_key, topic, key, limit - len(found), before)
        page, before = self._call(call)
        found += page
        if before is None or len(found) >= limit:
            return found


def offset_for_time(self: Client, topic: str, queue_id: int, timestamp: float | dt.datetime) -> int:
    result: int = self._call(self._made(calls.offset_for_time, topic, queue_id, timestamp))
    return result


def commit_offset(self: Client, group: str, topic: str, queue_id: int, offset: int) -> None:
    self._call(self._made(calls.commit_offset, group, topic, queue_id, offset))


def committed_offset(self: Client, group: str, topic: str, queue_id: int) -> int | None:
    result: int | None = self._call(self._made(calls.committed_offset, group, topic, queue_id))
    return result


def delete_group(self: Client, group: str, *, delete_dead_letters: bool = False) -> DeletedGroup:
    """Delete consumer group ``group`` (protocol version 5; no member may be live): its
    committed offsets, its retry topic and, with ``delete_dead_letters``, its
    dead-letter topic, as ``MessageStore.delete_group``. Raises GroupError while the
    group has live members, GroupNotFoundError for a group the store does not have,
    BrokerTooOldError from a broker older than version 5 (nothing sent)."""
    result: DeletedGroup = self._call(calls.delete_group(group, delete_dead_letters))
    return result


def create_topic(self: Client, topic: str, queue_count: int | None = None) -> None:
    self._call(calls.create_topic(topic, queue_count))


def topics(self: Client) -> list[str]:
    result: list[str] = self._call(calls.topics())
    return result


def deleted_topics(self: Client) -> dict[str, int]:
    """MessageStore.deleted_topics: a broker of protocol version 5 or later (else
    BrokerTooOldError, nothing sent)."""
    result: dict[str, int] = self._call(calls.deleted_topics())
    return result


def queue_ids(self: Client, topic: str) -> list[int]:
    result: list[int] = self._call(calls.queue_ids(topic))
    return result


def queue_range(self: Client, topic: str, queue_id: int) -> tuple[int, int]:
    result: tuple[int, int] = self._call(self._made(calls.queue_range, topic, queue_id))
    return result


def stats(self: Client, group: str | None = None) -> dict[str, Any]:
    """The broker's counters and a summary of its groups; with ``group``, that group's
    lag per queue, members and assignment (docs/protocol.md, "stats")."""
    result: dict[str, Any] = self._call(calls.stats(group))
    return result if group is None else calls.one_group(result, group)


def ping(self: Client) -> None:
    self._call(calls.ping())


def consumer(
    self: Client,
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
) -> GroupConsumer:
    """A member of consumer group ``group`` on this client, joined now: GroupConsumer's
    options (equeue/client/consumer.py, docs/groups.md), checked as the store's
    ``consumer`` checks its own."""
    from equeue.client.consumer import GroupConsumer

    return GroupConsumer(
        self, group, topics, tags=tags, start=start, batch_size=batch_size,
        prefetch=prefetch, auto_commit=auto_commit,
        auto_commit_interval=auto_commit_interval, session_timeout=session_timeout,
        max_retries=max_retries, timeout=timeout, consumer_id=consumer_id,
        max_poll_interval=max_poll_interval,
    )  # fmt: skip
