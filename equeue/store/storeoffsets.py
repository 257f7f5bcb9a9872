"""MessageStore's consumer offsets: committing and reading a group's offsets by hand,
and ``consumer()``, the loop that commits them itself (consumer.py). Apart from store.py:
what a consumer group sees, not how the log is written."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from equeue.protocol.retries import check_store_group
from equeue.store import groupdeletion, validate
from equeue.store import offsets as group_offsets
from equeue.store.consumer import Consumer
from equeue.store.consumerargs import Start

if TYPE_CHECKING:
    from equeue.store.store import MessageStore


def commit_offset(self: MessageStore, group: str, topic: str, queue_id: int, offset: int) -> None:
    """Set ``group``'s offset on ``topic``/``queue_id`` (persisted), also lower: a reset."""
    self._check_writable()  # before the checks: a read-only handle's end may be stale
    validate.check_commit(group, offset, self._queue(topic, queue_id).next_offset)
    check_store_group(group)
    with self._lock:
        self._check_writable()
        group_offsets.set_offset(self, group, topic, queue_id, offset)


def committed_offset(self: MessageStore, group: str, topic: str, queue_id: int) -> int | None:
    """The offset ``group`` last committed for the queue (the next offset it will
    consume), or None if it never committed one. A read-only handle sees the writer's
    commits as of its last ``refresh()``. Raises what ``commit_offset`` raises for the
    same names: InvalidTypeError, InvalidMessageError for a bad name, TopicNotFoundError,
    QueueNotFoundError (a typo does not read as "nothing committed")."""
    self._check_open()
    validate.check_names(group, topic, queue_id)
    self._queue(topic, queue_id)  # (the order of commit_offset's checks)
    validate.check_group(group)
    return group_offsets.committed_group(self, group).get(topic, {}).get(str(queue_id))


def consumer_groups(self: MessageStore) -> dict[str, dict[str, dict[int, int]]]:
    """Every committed offset: {group: {topic: {queue id: offset}}}."""
    self._check_open()
    return group_offsets.by_queue_id(group_offsets.committed(self))


def delete_group(
    self: MessageStore, group: str, *, delete_dead_letters: bool = False
) -> groupdeletion.DeletedGroup:
    """Delete consumer group ``group``: its committed offsets (retention no longer counts
    it), its retry topic ``equeue.retry.GROUP``, and with ``delete_dead_letters`` its
    dead-letter topic ``equeue.dlq.GROUP`` (kept by default: they are data). Crash-safe:
    a crash leaves the group or none of it (equeue/store/groupdeletion.py). Raises
    GroupNotFoundError for a group the store does not have, ReadOnlyError, InvalidMessageError
    for a bad name or the retry mover's (``equeue.mover``)."""
    return groupdeletion.delete_group(self, group, delete_dead_letters=delete_dead_letters)


def consumer(
    self: MessageStore,
    group: str,
    topics: str | Iterable[str],
    *,
    tags: str | Iterable[str] | None = None,
    start: Start = "committed",
    auto_commit: bool = True,
    batch_size: int = 32,
    timeout: float | None = None,
) -> Consumer:
    """A loop over every queue of ``topics`` that commits ``group``'s offsets, at least
    once; also on a read-only handle (equeue/store/consumer.py says how)."""
    return Consumer(
        self, group, topics, tags=tags, start=start, auto_commit=auto_commit,
        batch_size=batch_size, timeout=timeout,
    )  # fmt: skip
