"""Each method of the clients as one request: its op, its wire arguments (checked by
equeue/client/args.py), what a lost connection reports unanswered, and how long the
broker may hold it beyond the client's timeout (a pull's wait)."""

from __future__ import annotations

import datetime as dt
from typing import Any, NamedTuple

from equeue.client import args
from equeue.errors import InvalidTypeError

# the messages of a send as the caller gave them (a send's fields as a tuple: see
# core.given), None for an op that stores nothing
Given = list[Any] | tuple[Any, ...] | None


class Call(NamedTuple):
    op: str
    args: dict[str, Any]
    unanswered: Given
    wait: float = 0.0


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
    wire = [args.outgoing(item, name) for item in items]
    return Call("send_batch", {"topic": name, "messages": wire}, items)


def pull(
    topic: str, queue_id: int, offset: int, max_count: int, tags: object, wait: float,
    max_bytes: int | None,
) -> Call:  # fmt: skip
    name = args.topic(topic)
    wire: dict[str, Any] = {
        "topic": name,
        "queue_id": args.queue_id(queue_id, name),
        "offset": args.offset(offset),
        "max_count": args.positive("max_count", max_count),
    }
    if max_bytes is not None:
        wire["max_bytes"] = args.positive("max_bytes", max_bytes)
    milliseconds = args.wait_ms(wait)
    if milliseconds:
        wire["wait_ms"] = milliseconds
    if tags is not None:
        wire["tags"] = args.tags(tags)
    return Call("pull", wire, None, milliseconds / 1000)


def get(message_id: str) -> Call:
    return Call("get", {"message_id": args.message_id(message_id)}, None)


def query_by_key(topic: str, key: str, limit: int) -> Call:
    name = args.topic(topic)
    return Call(
        "query_by_key",
        {"topic": name, "key": args.name("key", key), "limit": args.limit(limit)},
        None,
    )


def offset_for_time(topic: str, queue_id: int, timestamp: float | dt.datetime) -> Call:
    name = args.topic(topic)
    wire = {
        "topic": name,
        "queue_id": args.queue_id(queue_id, name),
        "timestamp": args.timestamp(timestamp),
    }
    return Call("offset_for_time", wire, None)


def commit_offset(group: str, topic: str, queue_id: int, offset: int) -> Call:
    name = args.topic(topic)
    wire = {
        "topic": name,
        "queue_id": args.queue_id(queue_id, name),
        "group": args.group(group),
        "offset": args.offset(offset),
    }
    return Call("commit_offset", wire, None)


def committed_offset(group: str, topic: str, queue_id: int) -> Call | None:
    """None: no store holds an offset for this queue id (a negative one), so no request."""
    wire: dict[str, Any] = {"group": args.name("group", group), "topic": args.name("topic", topic)}
    if not args.is_int(queue_id):
        raise InvalidTypeError(f"queue_id must be a int, got {type(queue_id).__name__}")
    if not 0 <= queue_id < 1 << 64:
        return None
    wire["queue_id"] = int(queue_id)
    return Call("committed_offset", wire, None)


def create_topic(topic: str, queue_count: int | None) -> Call:
    wire: dict[str, Any] = {"topic": args.topic(topic)}
    count = args.queue_count(queue_count)
    if count is not None:
        wire["queue_count"] = count
    return Call("create_topic", wire, None)


def topics() -> Call:
    return Call("topics", {}, None)


def queue_ids(topic: str) -> Call:
    return Call("queue_ids", {"topic": args.topic(topic)}, None)


def queue_range(topic: str, queue_id: int) -> Call:
    name = args.topic(topic)
    return Call("queue_range", {"topic": name, "queue_id": args.queue_id(queue_id, name)}, None)


def stats() -> Call:
    return Call("stats", {}, None)


def ping() -> Call:
    return Call("ping", {}, None)
