"""MessageStore's topics and queues: creating, changing and deleting a topic, listing
topics, queues and chunk files, and the lookups every read and send starts with
(``_topic``, ``_queue``, ``_queues_and_count``). Apart from store.py so that the store's
class stays its opening, closing and lock; the functions are bound as methods there."""

from __future__ import annotations

import contextlib
import datetime as dt
from typing import TYPE_CHECKING

from equeue.errors import ConfigError, LimitExceededError, TopicNotFoundError
from equeue.protocol.retries import RESERVED_PREFIX, is_internal_topic
from equeue.store import deletion, entrycheck, follow, validate
from equeue.store.losses import read_topics
from equeue.store.queue import Queue
from equeue.store.queuerebuild import open_queue
from equeue.store.topics import (
    UNSET,
    Cleanup,
    TopicPolicy,
    _Unset,
    create_or_change,
    deletions,
    topic_entries,
)
from equeue.store.topicsfile import save_topic

if TYPE_CHECKING:
    from equeue.store.store import MessageStore


def create_topic(
    self: MessageStore,
    topic: str,
    queue_count: int | None = None,
    *,
    cleanup: Cleanup | _Unset = UNSET,
    retention: dt.timedelta | _Unset | None = UNSET,
    delete_retention: dt.timedelta | _Unset = UNSET,
) -> None:
    """Create a topic, or change an existing one: its queue count grows (it never
    shrinks), and each cleanup setting given replaces the topic's (see TopicPolicy)."""
    validate.check_topic(topic)
    if is_internal_topic(topic) and (
        cleanup == "compact" or (not isinstance(retention, _Unset) and retention is not None)
    ):
        # The broker's retries are read from a cursor, and compaction's holes are skipped
        # there uncounted: a retry removed so would be pending for ever (review f F7).
        raise ConfigError(
            f"topic {topic!r} is the broker's own (delayed retries and retry copies): it "
            "takes no retention and no cleanup='compact'; the store's retention "
            "(StoreConfig.retention, max_store_bytes) covers it"
        )
    with self._lock:
        self._check_writable()
        self._check_directory()  # before any queue directory or topics file is written
        if topic not in self._queues:
            self._check_room_for_topic(topic)
        # (by name: this module's topics() would shadow the topics module)
        create_or_change(self, topic, queue_count, cleanup, retention, delete_retention)


def delete_topic(self: MessageStore, topic: str) -> None:
    """Delete ``topic``: its queues and its consumer groups' offsets (crash-safe: a
    crash leaves the topic or none of it). Its records stay in the log until retention
    but are never seen again; a topic created under the name starts empty. Raises
    TopicNotFoundError, ReadOnlyError, StoreWriteError (equeue/store/deletion.py)."""
    deletion.delete_topic(self, topic)


def topic_policy(self: MessageStore, topic: str) -> TopicPolicy:
    """What the compaction batch may remove from ``topic``."""
    self._topic(topic)
    return self._policies.get(topic, TopicPolicy())


def topics(self: MessageStore) -> list[str]:
    """The names of the store's topics, sorted. Raises ClosedError once closed."""
    self._check_open()
    return sorted(self._queues)


def queue_ids(self: MessageStore, topic: str) -> list[int]:
    """The queue ids of ``topic``: 0 to its queue count - 1. Raises TopicNotFoundError."""
    return list(range(len(self._topic(topic))))


def queue_range(self: MessageStore, topic: str, queue_id: int) -> tuple[int, int]:
    """(first retained offset, next offset) of a queue."""
    queue = self._queue(topic, queue_id)
    return queue.first_offset, queue.next_offset


def queue_positions(
    self: MessageStore, topic: str, queue_id: int, offset: int, count: int
) -> list[int]:
    """The log positions of up to ``count`` entries of a queue from ``offset`` on, without
    reading the messages (so also those of records compaction removed, which pull skips:
    a reader of chunk files finds them gone).
    Raises CorruptRecordError naming the queue file and offset for an entry that cannot
    be intact (equeue/store/entrycheck.py)."""
    queue = self._queue(topic, queue_id)
    validate.check_offset(offset)
    validate.check_count(count)
    try:
        return entrycheck.checked_positions(self, queue, offset, queue.entries(offset, count))
    except follow.READ_FAILURES:  # (a try costs nothing until it catches)
        if not self.read_only:
            raise
        return _positions_beside_deletion(self, queue, offset, count)


def _positions_beside_deletion(
    store: MessageStore, queue: Queue, offset: int, count: int
) -> list[int]:
    """The check inside the retry too: a view of the deleted topic's queue maps its chunk
    by name, and may find the new topic's file there, its entries not yet written (zero:
    "position -1"); that is the deletion's doing, not damage. (A function of its own:
    a closure in queue_positions cost its every call ~1,800 instructions, 5%.)"""
    return follow.beside_deletion(
        store,
        queue,
        lambda: entrycheck.checked_positions(store, queue, offset, queue.entries(offset, count)),
    )


def chunk_files(self: MessageStore) -> list[tuple[str, int]]:
    """(path, committed data end) of each message log chunk now, oldest first: for
    readers of whole chunk files (the Spark batch source)."""
    self._check_open()
    follow.look(self)
    return [(str(chunk.path), chunk.data_end) for chunk in self._messages]


def deleted_topics(self: MessageStore) -> dict[str, int]:
    """Topic: the log position of its deletion. Records of the topic below it are the
    deleted topic's (the log keeps them until retention); pull and query_by_key never
    return them, and neither should a reader of chunk files."""
    self._check_open()
    return dict(self._deleted)


def _load_topics(self: MessageStore) -> None:
    body = read_topics(self)
    before, self._deleted = self._deleted, deletions(body)
    self._files.plan(self._deleted)  # at a writer's open
    if self.read_only:
        deletion.follow_deletions(self, before)
    for topic, count, policy in topic_entries(body, self.path, self._meta_problems):
        if count > len(self._queues.get(topic, ())):
            self._open_queues(topic, count)
        self._policies[topic] = policy


def _open_queues(self: MessageStore, topic: str, count: int) -> None:
    queues = self._queues.get(topic, [])
    try:
        for queue_id in range(len(queues), count):
            queues.append(open_queue(self, topic, queue_id, self._files.ends(topic, queue_id)))
    except BaseException:
        if topic not in self._queues:  # (a new topic's queues so far: no one else holds them)
            for queue in queues:
                with contextlib.suppress(Exception):
                    queue.close()
        raise
    self._queues[topic] = queues
    self._topic_bytes[topic] = topic.encode()
    self._round_robin.setdefault(topic, 0)


def _save_topics(self: MessageStore, topic: str) -> None:
    save_topic(self, topic)  # topics.json's journal (topicsfile.py)


def _topic(self: MessageStore, topic: str) -> list[Queue]:
    self._check_open()  # every read by topic; one attribute on the pull path
    queues = self._queues.get(topic) if isinstance(topic, str) else None
    if queues is None and self.read_only and isinstance(topic, str):
        follow.again_if_deleted(self._load_topics)  # the writer may have created it since
        queues = self._queues.get(topic)
    if queues is None:
        validate.check_topic(topic)
        raise TopicNotFoundError(f"no topic {topic!r} in {self.path}")
    return queues


def _queue(self: MessageStore, topic: str, queue_id: int) -> Queue:
    queues = self._topic(topic)
    return follow.fresh(self, queues[validate.check_queue_id(queue_id, topic, len(queues))])


def _queues_and_count(self: MessageStore, topic: object) -> tuple[list[Queue] | None, int]:
    """A send's topic: its queues (None if it is new) and their count, or an error."""
    if self.read_only or self._closed:
        self._check_writable()
    queues = self._queues.get(topic) if type(topic) is str else None
    if queues is not None:
        return queues, len(queues)
    return None, self._count_for_new(topic)


def _count_for_new(self: MessageStore, topic: object) -> int:
    """The queue count an unknown topic would get on its first send, or an error."""
    validate.check_topic(topic)
    if not self.config.auto_create_topics:
        raise TopicNotFoundError(
            f"no topic {topic!r} in {self.path}, and auto_create_topics is off "
            "(StoreConfig.auto_create_topics); create it with create_topic()"
        )
    assert isinstance(topic, str)  # (check_topic refused any other)
    self._check_room_for_topic(topic)
    return self.config.default_queue_count


def _check_room_for_topic(self: MessageStore, topic: str) -> None:
    """LimitExceededError if a new ``topic`` would pass StoreConfig.max_topics. The
    broker's own topics (equeue.*: delays, a group's retries and dead letters) are not
    counted nor refused: the broker's max_groups bounds them, and a mover must not fail."""
    limit = self.config.max_topics
    if limit is None or topic.startswith(RESERVED_PREFIX):
        return
    own = RESERVED_PREFIX
    count = sum(1 for name in self._queues if not name.startswith(own))  # (rare: a new topic)
    if count >= limit:
        raise LimitExceededError(
            f"{self.path} has {count} topics, the most max_topics={limit} allows "
            "(StoreConfig.max_topics; equeue serve --max-topics); topic "
            f"{topic[:64]!r} was not created"
        )


def _create_for_send(self: MessageStore, topic: str) -> list[Queue]:
    """Called only after the message was checked, so a rejected send creates nothing."""
    self.create_topic(topic)  # the default count, or what a racing creator chose
    return self._queues[topic]
