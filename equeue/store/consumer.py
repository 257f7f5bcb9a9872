"""The consumer loop: ``store.consumer(group, topics)`` iterates the messages of every
queue of its topics and commits the group's offsets, at least once.

Fetching: each fetch visits the queues in turn, starting one queue further on each
time, and takes an equal share of the batch from each (the rest of the batch is then
filled from the queues that had more), so a busy queue cannot starve the others;
within a queue, messages come in offset order.

Processed, committed: a message handed out is *processed* once the caller comes back,
that is, asks for the next message (iteration), calls ``poll()`` again (every message
of the previous poll), calls ``commit()`` or ``close()`` (everything handed out so
far), or leaves the consumer's ``with`` block normally (also by ``break``). Leaving it
by an exception does not count the messages in hand (the current message, the last
poll's): they come again. With ``auto_commit`` the processed offsets are committed
when a batch is done (before the next one is fetched, and before waiting for new
messages) and by ``close()``; so after a crash the messages handed out since the last
commit, at most one batch (``batch_size``, over all queues), come again: at least
once. Without ``auto_commit`` only ``commit()`` commits.

Where commits go: ``consumers/GROUP.json``, from the writer's handle or a read-only
one (equeue/store/offsets.py); a group's offset never moves back through a consumer's
commit.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Iterable, Iterator
from types import TracebackType
from typing import TYPE_CHECKING

from equeue.errors import ChunkRemovedError, ClosedError, InvalidTypeError
from equeue.protocol.retries import check_store_group
from equeue.store import offsets as group_offsets
from equeue.store.consumerargs import (
    Start,
    check_count,
    check_seconds,
    check_start,
    check_tags,
    check_topics,
)
from equeue.store.types import Message

if TYPE_CHECKING:
    from equeue.store.store import MessageStore

log = logging.getLogger("equeue.consumer")

_Queue = tuple[str, int]  # (topic, queue id)
# A read-only handle learns of new messages by polling its files, as pull(wait=) does.
_POLL_SECONDS = 0.01
# A writer handle's wait is woken by each send; it also looks at the clock this often.
_WAKE_SECONDS = 0.5
_ATTEMPTS = 8  # pulls retried while retention removes chunks under them


class Consumer:
    """Iterates the messages of ``topics`` for ``group`` and commits how far it got.

    ``start``: ``"committed"`` (the group's committed offset, else the queue's first),
    ``"earliest"`` (each queue's first retained offset) or ``"latest"`` (only what is
    sent from now on); a queue the topic gains later starts at its committed or first
    offset. A commit never moves the group's offset back, so ``"earliest"`` re-reads
    without lowering it (reset a group with the writer's ``commit_offset``), and never
    past offsets the group has not committed that ``"latest"`` passed over: such a queue
    is not committed by this consumer (a warning says which).

    ``for message in consumer`` blocks for new messages; with ``timeout`` (seconds) the
    iteration ends once none arrived for that long. ``poll(max_count, timeout)``
    returns a list (empty once ``timeout`` passed). ``skipped`` counts, per
    ``(topic, queue_id)``, the offsets retention removed before this consumer read them
    (each also logged as a warning); the consumer goes on at the queue's first offset.

    A consumer belongs to one thread. It is a context manager; ``close()`` commits what
    was handed out (with ``auto_commit``; see above for a ``with`` block left by an
    exception) and leaves the store open.
    """

    def __init__(
        self,
        store: MessageStore,
        group: str,
        topics: str | Iterable[str],
        *,
        tags: str | Iterable[str] | None = None,
        start: Start = "committed",
        auto_commit: bool = True,
        batch_size: int = 32,
        timeout: float | None = None,
    ) -> None:
        self.store = store
        self.group = group_offsets.check_group(group)
        check_store_group(self.group)
        if store.read_only:
            store.refresh()  # the writer's topics, offsets and queue ends as they are now
        self.topics = check_topics(topics)
        for topic in self.topics:
            store.queue_ids(topic)  # TopicNotFoundError
        self.tags = check_tags(tags)  # its errors now, not at the first pull
        start = check_start(start)
        if not isinstance(auto_commit, bool):
            raise InvalidTypeError(f"auto_commit must be a bool, got {type(auto_commit).__name__}")
        self.auto_commit = auto_commit
        self.batch_size = check_count(batch_size, "batch_size")
        self.timeout = check_seconds(timeout, "timeout")
        self.skipped: dict[_Queue, int] = {}
        self._positions: dict[_Queue, int] = {}  # where the next pull of a queue starts
        self._processed: dict[_Queue, int] = {}  # the offsets a commit may write
        self._committed: dict[_Queue, int] = {}  # what this consumer committed last
        # queues started past the group's committed offset: never committed (_skip_backlog)
        self._uncommitted: set[_Queue] = set()
        self._undelivered: deque[tuple[Message, int]] = deque()  # (message, offset after it)
        self._pending: list[tuple[Message, int]] = []  # handed out, not yet processed
        self._turn = 0
        self._closed = False
        # Each topic's deletion marker when its queues were added: a topic deleted since
        # (and maybe created again) starts over (_forget_deleted).
        self._deleted: dict[str, int | None] = {t: store._deleted.get(t) for t in self.topics}
        self._add_queues(start)

    # --- the loop ----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Message]:
        return self

    def __next__(self) -> Message:
        self._check_open()
        self._done_with_pending()
        if not self._undelivered:
            if self.auto_commit:
                self._commit_processed()
            batch = self._fetch(self.batch_size, self.timeout)
            if not batch:
                raise StopIteration
            self._undelivered.extend(batch)
        item = self._undelivered.popleft()
        self._pending.append(item)
        return item[0]

    def poll(self, max_count: int | None = None, timeout: float | None = 0.0) -> list[Message]:
        """Up to ``max_count`` (default ``batch_size``) messages, waiting up to ``timeout``
        seconds (None: until one arrives) for the first; the messages of the previous
        poll count as processed."""
        self._check_open()
        limit = self.batch_size if max_count is None else check_count(max_count, "max_count")
        wait = check_seconds(timeout, "timeout")
        self._done_with_pending()
        if self.auto_commit:
            self._commit_processed()
        batch: list[tuple[Message, int]] = []
        while self._undelivered and len(batch) < limit:  # what the iteration fetched first
            batch.append(self._undelivered.popleft())
        if not batch:  # a fetch starts with nothing unprocessed (see _pull)
            batch = self._fetch(limit, wait)
        self._pending.extend(batch)
        return [message for message, _ in batch]

    # The name the clients' group members give this shape too (their ``poll`` hands out
    # one message): code written against poll_batch runs on either.
    poll_batch = poll

    def commit(self) -> None:
        """Commit every message handed out so far (it counts as processed)."""
        self._check_open()
        self._done_with_pending()
        self._commit_processed()

    def close(self) -> None:
        """Commit everything handed out (with ``auto_commit``) and stop; the store stays
        open."""
        self._close(processed=True)

    def _close(self, *, processed: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if processed:
            self._done_with_pending()
        if not self.auto_commit:
            return
        if self.store._closed:  # closed first: these messages will come again
            log.warning(
                "consumer group %r: the store was closed first; nothing committed", self.group
            )
            return
        self._commit_processed()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close(processed=exc_type is None)

    def positions(self) -> dict[_Queue, int]:
        """Where this consumer goes on in each queue (its processed offsets)."""
        return dict(self._processed)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._positions)} queues"
        return f"<Consumer group={self.group!r} topics={self.topics!r} {state}>"

    # --- internals -----------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"the consumer of group {self.group!r} is closed")

    def _add_queues(self, start: Start) -> None:
        """Start every queue not yet known: those of the topics at creation by ``start``,
        those a topic gained since at their committed or first offset."""
        committed: group_offsets.Offsets | None = None
        for topic in self.topics:
            for queue_id in self.store.queue_ids(topic):
                key = (topic, queue_id)
                if key in self._positions:
                    continue
                first, following = self.store.queue_range(topic, queue_id)
                if committed is None:
                    committed = group_offsets.committed(self.store)
                offset = committed.get(self.group, {}).get(topic, {}).get(str(queue_id))
                if start == "latest":
                    at = following
                elif start == "earliest" or offset is None:
                    at = first
                else:  # past the end (committed by hand): RocketMQ's correction
                    at = min(offset, following)
                self._positions[key] = self._processed[key] = at
                if offset is not None:
                    self._committed[key] = offset
                    # the backlog: what the group has not committed and can still read
                    # (offsets retention removed are no one's backlog: review3 R1)
                    backlog = max(offset, first)
                    if start == "latest" and at > backlog:
                        self._skip_backlog(key, backlog, at)

    def _skip_backlog(self, key: _Queue, committed: int, at: int) -> None:
        """A start past the group's committed offset (``"latest"``): a commit of this
        consumer would mark the offsets in between processed for the whole group, which
        never read them (review 38e E13: a watcher under a production group's name threw
        its backlog away, silently). So this consumer does not commit the queue."""
        self._uncommitted.add(key)
        topic, queue_id = key
        log.warning(
            "consumer group %r: start=\"latest\" passes %s/%d offsets %d..%d, which the group "
            "has not committed; this consumer will not commit that queue (its commits would "
            "mark them processed). To skip them for the group, commit_offset(%r, %r, %d, %d)",
            self.group, topic, queue_id, committed, at - 1, self.group, topic, queue_id, at,
        )  # fmt: skip

    def _done_with_pending(self) -> None:
        for message, after in self._pending:
            self._processed[(message.topic, message.queue_id)] = after
        self._pending.clear()

    def _forget_deleted(self) -> None:
        """Forget the queues of a topic deleted since they were added: their offsets and
        messages are the old topic's (a topic created again is read from its start)."""
        for topic in self.topics:
            marker = self.store._deleted.get(topic)
            if marker == self._deleted[topic]:
                continue
            self._deleted[topic] = marker
            for table in (self._positions, self._processed, self._committed):
                for key in [key for key in table if key[0] == topic]:
                    del table[key]
            self._uncommitted = {key for key in self._uncommitted if key[0] != topic}
            self._undelivered = deque(i for i in self._undelivered if i[0].topic != topic)
            self._pending = [i for i in self._pending if i[0].topic != topic]

    def _commit_processed(self) -> None:
        self._forget_deleted()
        changed = {
            key: offset
            for key, offset in self._processed.items()
            if offset > self._committed.get(key, -1) and key not in self._uncommitted
        }
        if not changed:
            return
        self.store._check_open()
        group_offsets.commit_group(self.store, self.group, changed, self._deleted)
        self._committed.update(changed)

    def _fetch(self, limit: int, timeout: float | None) -> list[tuple[Message, int]]:
        """A batch from every queue in turn; waits up to ``timeout`` for a first message."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            batch = self._fetch_once(limit)
            if batch or self._closed:
                return batch
            if self.auto_commit:  # queues a tag filter moved past: nothing left to process
                self._commit_processed()
            if not self._wait(deadline):
                return self._fetch_once(limit)

    def _fetch_once(self, limit: int) -> list[tuple[Message, int]]:
        self._forget_deleted()
        if len(self._positions) < sum(len(self.store.queue_ids(t)) for t in self.topics):
            self._add_queues("committed")
        keys = list(self._positions)
        turn = self._turn % len(keys)
        self._turn += 1
        order = keys[turn:] + keys[:turn]
        share = max(1, limit // len(keys))
        batch: list[tuple[Message, int]] = []
        full: list[_Queue] = []
        for key in order:
            if len(batch) >= limit:
                break
            if self._pull(key, min(share, limit - len(batch)), batch):
                full.append(key)
        for key in full:  # what the others left of the batch, in the same turn order
            if len(batch) >= limit:
                break
            self._pull(key, limit - len(batch), batch)
        return batch

    def _pull(self, key: _Queue, count: int, batch: list[tuple[Message, int]]) -> bool:
        """Append up to ``count`` messages of queue ``key`` to ``batch``; True if it may
        hold more."""
        topic, queue_id = key
        at = self._positions[key]
        store = self.store
        for attempt in range(_ATTEMPTS):
            try:
                first = store.queue_range(topic, queue_id)[0]
                result = store.pull(topic, queue_id, at, count, self.tags)
                break
            except ChunkRemovedError:  # retention removed it between range and pull
                if attempt == _ATTEMPTS - 1:
                    raise
        messages, following = result.messages, result.next_offset
        first = max(first, store.queue_range(topic, queue_id)[0])
        reached = messages[0].queue_offset if messages else following
        if at < min(first, reached):
            self._skip(key, at, min(first, reached))
        if following <= at:
            return False
        self._positions[key] = following
        if not messages:  # a tag filter passed over them all
            # A fetch starts once everything handed out is processed: only messages of
            # this batch may come before them.
            ours = [i for i, (m, _) in enumerate(batch) if (m.topic, m.queue_id) == key]
            if ours:
                batch[ours[-1]] = (batch[ours[-1]][0], following)
            else:
                self._processed[key] = following
            return False
        for message in messages[:-1]:
            batch.append((message, message.queue_offset + 1))
        batch.append((messages[-1], following))
        return len(messages) == count

    def _skip(self, key: _Queue, at: int, first: int) -> None:
        self.skipped[key] = self.skipped.get(key, 0) + first - at
        log.warning(
            "consumer group %r: retention removed offsets %d..%d of %s/%d before they were "
            "consumed; going on at offset %d",
            self.group, at, first - 1, key[0], key[1], first,
        )  # fmt: skip

    def _wait(self, deadline: float | None) -> bool:
        """Wait until a queue may have a message past this consumer's position; False
        once ``deadline`` passed."""
        store = self.store
        remaining = math.inf if deadline is None else deadline - time.monotonic()
        if remaining <= 0:
            return False
        if store.read_only:  # the writer is another process: its files are polled
            time.sleep(min(remaining, _POLL_SECONDS))
            return True
        with store._arrived:
            store._waiting += 1
            try:
                if not self._has_new() and not store._closed:
                    store._arrived.wait(min(remaining, _WAKE_SECONDS))
            finally:
                store._waiting -= 1
        return True

    def _has_new(self) -> bool:
        for (topic, queue_id), at in self._positions.items():
            if self.store.queue_range(topic, queue_id)[1] > at:
                return True
        return len(self._positions) < sum(len(self.store.queue_ids(t)) for t in self.topics)
