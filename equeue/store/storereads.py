"""MessageStore's reads: ``pull`` by queue offset, ``read`` and ``get`` by log position
or message id, ``query_by_key``/``key_positions`` through the key index, and
``offset_for_time``. Apart from store.py: none of these takes the write lock."""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from equeue.errors import (
    ChunkRemovedError,
    CompactedAwayError,
    CorruptRecordError,
    InvalidTypeError,
    MessageNotFoundError,
    PositionNotFoundError,
)
from equeue.format.message import decode_message_id
from equeue.store import follow, pulling, times, validate
from equeue.store.keyindex import NO_BOUND
from equeue.store.reads import tag_filter
from equeue.store.types import Message, PullResult

if TYPE_CHECKING:
    from equeue.store.store import MessageStore


def pull(
    self: MessageStore,
    topic: str,
    queue_id: int,
    offset: int,
    max_count: int = 32,
    tags: str | Iterable[str] | None = None,
    wait: float = 0.0,
    *,
    max_bytes: int | None = None,
) -> PullResult:
    """Up to ``max_count`` messages of a queue from ``offset`` on, in offset order, and
    ``next_offset``, where to go on (an offset past the queue's end reads as its end).

    ``tags`` keeps only messages with one of these tags (None or "*": every message;
    an empty list is refused). ``wait`` > 0 (seconds) blocks until a matching message
    arrives or the time passes. ``max_bytes`` stops before the bodies would add up to
    more, but returns the first message whatever its size. Raises TopicNotFoundError,
    QueueNotFoundError, InvalidMessageError/InvalidTypeError for bad arguments, and a
    CorruptionError naming the file if a record is damaged.
    """
    queue = self._queue(topic, queue_id)
    validate.check_pull(offset, max_count, wait, max_bytes)
    wanted = tag_filter(tags)
    deadline = time.monotonic() + wait  # one deadline for every wait of this pull
    result = pulling.pull_once(self, queue, offset, max_count, wanted, wait, max_bytes)
    if wait <= 0 or result:
        return result
    return pulling.wait_on(self, queue, result, max_count, wanted, deadline, max_bytes)


def read(self: MessageStore, position: int) -> Message:
    """The message at log ``position`` (a byte offset in the message log, as
    SendResult.position and Message.position give it). Raises MessageNotFoundError if
    no message starts there, ChunkRemovedError if retention removed it,
    CompactedAwayError if compaction did, a CorruptionError naming the file if damaged."""
    self._check_open()
    if not isinstance(position, int) or isinstance(position, bool):
        raise InvalidTypeError(f"position must be an int, got {type(position).__name__}")
    follow.look(self)
    try:
        return self._log.read(position)
    except (PositionNotFoundError, CorruptRecordError) as exc:
        # A position from a caller (or a message id) that names no record start reads
        # as an invalid frame; the frame check still keeps corrupt bytes from escaping.
        raise MessageNotFoundError(f"no message at position {position}: {exc}") from exc


def get(self: MessageStore, message_id: str) -> Message:
    """The message with this id (24 hex digits: this store's id and the log position;
    no index is consulted). Raises MessageNotFoundError for an id of another store or
    of no message, and what ``read`` raises."""
    decoded = decode_message_id(message_id)
    if decoded is None or decoded[0] != self.store_id:
        raise MessageNotFoundError(f"{message_id!r} is not a message id of this store")
    return self.read(decoded[1])


def query_by_key(
    self: MessageStore, topic: str, key: str, limit: int = 32, *, before: int | None = None
) -> list[Message]:
    """Messages of ``topic`` with ``key``, newest first; with ``before``, only those at
    log positions below it (the rest of a query cut short: the broker's answers)."""
    return list(messages_at(self, topic, key, self.key_positions(topic, key, limit, before=before)))


def messages_at(
    store: MessageStore, topic: str, key: str, positions: Iterable[int]
) -> Iterator[Message]:
    """query_by_key's messages at key_positions' ``positions``, read one at a time, so that
    a reader that stops early (the broker, at a frame's bytes) reads no more of them. (A
    helper, not a method: the broker calls it on its store.)"""
    for position in positions:
        try:
            message = store._log.read(position)
        except (ChunkRemovedError, CompactedAwayError):
            continue
        if message.key == key and message.topic == topic:
            yield message


def key_positions(
    self: MessageStore, topic: str, key: str, limit: int = 32, *, before: int | None = None
) -> list[int]:
    """The log positions of ``topic``'s messages with ``key``, newest first (below
    ``before``, if given), from the key index alone (query_by_key's, no message read):
    for readers of chunk files, which check every record they read. A position may lie
    in a chunk removed since."""
    self._topic(topic)
    validate.check_key(key)
    validate.check_limit(limit)
    if before is None:
        before = NO_BOUND
    elif not isinstance(before, int) or isinstance(before, bool) or before < 0:
        raise InvalidTypeError(f"before must be a log position (an int >= 0), got {before!r}")
    follow.look(self)
    since = self._deleted.get(topic, 0)  # older records: a deleted topic's
    return [p for p in self._keys.positions(topic, key, limit, min(before, NO_BOUND)) if p >= since]


def offset_for_time(
    self: MessageStore, topic: str, queue_id: int, timestamp: float | dt.datetime
) -> int:
    """The first offset of the queue stored at or after ``timestamp``: seconds since the
    epoch or an aware datetime (a naive one is refused: equeue.store.times). The
    queue's next offset if none is. Raises InvalidMessageError, TopicNotFoundError."""
    follow.look(self)  # read-only: a chunk retention removed is reported as removed
    queue = self._queue(topic, queue_id)
    try:
        return times.offset_for_time(self, topic, queue_id, timestamp)
    except follow.READ_FAILURES:
        if not self.read_only:
            raise
        return follow.beside_deletion(
            self, queue, lambda: times.offset_for_time(self, topic, queue_id, timestamp)
        )
