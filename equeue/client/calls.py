"""Each method of the clients as one request: its op, its wire arguments (checked by
equeue/client/args.py), what a lost connection reports unanswered, and how long the
broker may hold it beyond the client's timeout (a pull's wait)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any, NamedTuple

from equeue.client import args
from equeue.errors import EQueueError, InvalidTypeError, QueueNotFoundError
from equeue.protocol.records import all_bytes
from equeue.store import validate

# the messages of a send as the caller gave them (a send's fields as a tuple: see
# core.given), None for an op that stores nothing
Given = list[Any] | tuple[Any, ...] | None


class Call(NamedTuple):
    op: str
    args: dict[str, Any]
    unanswered: Given
    wait: float = 0.0


class Probe(Exception):
    """An argument refused here, where the store would first have looked the topic or
    queue up (and refused a missing one): the clients send ``call`` to ask the broker,
    raise what it raises, and else ``error``. Only on this failure path."""

    def __init__(
        self,
        error: EQueueError,
        call: Call,
        judge: Callable[[Any], EQueueError | None] | None = None,
    ) -> None:
        super().__init__(str(error))
        self.error = error
        self.call = call
        # With a judge, the call only informs: its result may name an earlier error
        # (the judge's), its failure is not reported.
        self.judge = judge


def _queue_of(name: str, queue_id: object) -> int:
    """A queue id, checked after the topic's lookup as the store does."""
    try:
        return args.queue_id(queue_id, name)
    except EQueueError as exc:
        raise Probe(exc, Call("queue_ids", {"topic": name}, None)) from None


def _probed(error: EQueueError, name: str, queue_id: int | None) -> Probe:
    if queue_id is None:
        return Probe(error, Call("queue_ids", {"topic": name}, None))
    return Probe(error, Call("queue_range", {"topic": name, "queue_id": queue_id}, None))


_DEFAULTS = ("", None, None, 0, None)  # a send's tag, key, properties, code, queue_id


def send(
    topic: str, body: bytes, tag: str, key: str | None, properties: dict[str, str] | None,
    code: int, queue_id: int | None,
) -> Call:  # fmt: skip
    given = (body, tag, key, properties, code, queue_id)
    if (
        type(topic) is str and type(body) is bytes and type(code) is int  # (False == 0)
        and given[1:] == _DEFAULTS
    ):  # fmt: skip  # the usual send: nothing more to check here
        return Call("send", {"topic": topic, "body": body}, given)
    name = args.topic(topic)
    fields = args.message(body, tag, key, properties, code, queue_id, name)
    fields["topic"] = name
    return Call("send", fields, given)


def send_batch(topic: str, messages: object) -> Call:
    name = args.topic(topic)
    items = args.batch_items(messages)
    if all_bytes(items):
        # Bodies alone: send_bodies, the list as it is (RequestEncoder sends it as
        # send_batch to a broker of protocol version 1).
        return Call("send_bodies", {"topic": name, "bodies": items}, items)
    wire: list[dict[str, Any]] = []
    for item in items:
        try:
            wire.append(args.outgoing(item, name))
        except EQueueError as exc:
            if not any("queue_id" in fields for fields in wire):
                raise
            # The store checks each message in turn against the topic's queue count: an
            # earlier message's queue id out of range is the error it reports.
            raise Probe(exc, queue_ids(name), lambda ids: _first_out_of(wire, ids, name)) from None
    return Call("send_batch", {"topic": name, "messages": wire}, items)


def _first_out_of(wire: list[dict[str, Any]], ids: list[int], name: str) -> EQueueError | None:
    for fields in wire:
        if fields.get("queue_id", 0) >= len(ids):
            return QueueNotFoundError(
                f"queue_id {fields['queue_id']} is out of range for topic {name!r} with "
                f"{len(ids)} queues (0..{len(ids) - 1}); create_topic() can raise the queue count"
            )
    return None


def pull(
    topic: str, queue_id: int, offset: int, max_count: int, tags: object, wait: float,
    max_bytes: int | None,
) -> Call:  # fmt: skip
    name = args.topic(topic)
    wire: dict[str, Any] = {"topic": name, "queue_id": _queue_of(name, queue_id)}
    try:
        wire["offset"] = args.pull_offset(offset)
        wire["max_count"] = args.positive("max_count", max_count)
        if max_bytes is not None:
            wire["max_bytes"] = args.positive("max_bytes", max_bytes)
        milliseconds = args.wait_ms(wait)
        if tags is not None:
            wire["tags"] = args.tags(tags)
    except EQueueError as exc:
        raise _probed(exc, name, wire["queue_id"]) from None
    if milliseconds:
        wire["wait_ms"] = milliseconds
    return Call("pull_columns", wire, None, milliseconds / 1000)  # "pull" to a broker < v3


def get(message_id: str) -> Call:
    return Call("get", {"message_id": args.message_id(message_id)}, None)


def query_by_key(topic: str, key: str, limit: int, before: int | None = None) -> Call:
    """A page of query_by_key (protocol version 4; query_by_key to an older broker): its
    answer is (messages, where the rest begins or None). ``before`` continues a page."""
    name = args.topic(topic)
    try:
        wire: dict[str, Any] = {
            "topic": name,
            "key": args.name("key", key),
            "limit": args.limit(limit),
        }
    except EQueueError as exc:
        raise _probed(exc, name, None) from None
    if before is not None:
        wire["before"] = before  # (a position the broker answered)
    return Call("query_by_key_page", wire, None)


def offset_for_time(topic: str, queue_id: int, timestamp: float | dt.datetime) -> Call:
    name = args.topic(topic)
    number = _queue_of(name, queue_id)
    try:
        when = args.timestamp(timestamp)
    except EQueueError as exc:
        raise _probed(exc, name, number) from None
    return Call("offset_for_time", {"topic": name, "queue_id": number, "timestamp": when}, None)


def commit_offset(group: str, topic: str, queue_id: int, offset: int) -> Call:
    name = args.topic(topic)
    number = _queue_of(name, queue_id)
    try:
        wire = {
            "topic": name,
            "queue_id": number,
            "group": args.group(group),
            "offset": args.offset(offset),
        }
    except EQueueError as exc:
        raise _probed(exc, name, number) from None
    return Call("commit_offset", wire, None)


def committed_offset(group: str, topic: str, queue_id: int) -> Call:
    """The store's order: the three types, the topic and queue (a missing one refused as
    commit_offset refuses it), then the group's name."""
    group = args.name("group", group)
    args.name("topic", topic)
    if not args.is_int(queue_id):
        raise InvalidTypeError(f"queue_id must be a int, got {type(queue_id).__name__}")
    name = args.topic(topic)
    number = _queue_of(name, queue_id)
    try:
        validate.check_group(group)
    except EQueueError as exc:
        raise _probed(exc, name, number) from None
    return Call("committed_offset", {"group": group, "topic": name, "queue_id": number}, None)


def create_topic(topic: str, queue_count: int | None) -> Call:
    name = args.topic(topic)
    wire: dict[str, Any] = {"topic": name}
    count = args.queue_count(queue_count, name)
    if count is not None:
        wire["queue_count"] = count
    return Call("create_topic", wire, None)


def delete_group(group: str, delete_dead_letters: bool) -> Call:
    if not isinstance(delete_dead_letters, bool):
        raise InvalidTypeError(
            f"delete_dead_letters must be a bool, got {type(delete_dead_letters).__name__}"
        )
    wire: dict[str, Any] = {"group": args.group(group)}
    if delete_dead_letters:
        wire["delete_dead_letters"] = True
    return Call("delete_group", wire, None)


def topics() -> Call:
    return Call("topics", {}, None)


def deleted_topics() -> Call:
    return Call("deleted_topics", {}, None)


def queue_ids(topic: str) -> Call:
    return Call("queue_ids", {"topic": args.topic(topic)}, None)


def queue_range(topic: str, queue_id: int) -> Call:
    name = args.topic(topic)
    return Call("queue_range", {"topic": name, "queue_id": _queue_of(name, queue_id)}, None)


def stats(group: str | None = None) -> Call:
    if group is None:
        return Call("stats", {}, None)
    return Call("stats", {"group": args.name("group", group)}, None)


def one_group(answer: dict[str, Any], group: str) -> dict[str, Any]:
    """A ``stats {"group": G}`` answer as a broker of protocol version 5 gives it, also
    from an older broker (sent a plain ``stats``: every group's detail)."""
    kept = {k: v for k, v in answer.items() if k not in ("groups_omitted", "coordinator_omitted")}
    for key in ("groups", "coordinator"):
        found = answer.get(key)
        if isinstance(found, dict):
            kept[key] = {group: found[group]} if group in found else {}
    return kept


def ping() -> Call:
    return Call("ping", {}, None)
