"""``equeue records --follow``: keep printing messages as a writer in another process
adds them, like ``tail -f``.

New messages come through a read-only ``MessageStore`` (its public ``pull`` and
``refresh``), so the follower moves on as read-only handles do: across rollovers,
past chunks that retention removed, onto chunks compaction installed, and to topics
created after it started. The messages already in the store are printed first by
the log or queue walk of records.py; ``Follower`` is created before that walk, so
that together they print every message once (see ``records``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

from equeue.format.message import MessageLogRecord
from equeue.inspect.records import Filters, Record
from equeue.store import Message, MessageStore

# The longest a new message waits before it is printed (when nothing is arriving).
POLL_SECONDS: Final = 0.2
# What the follower was about to print but the store no longer holds: topic, queue id,
# the first offset missed and the offset after the last.
Skipped = Callable[[str, int, int, int], None]
# Messages taken from one queue per round: a busy queue cannot starve the others.
_BATCH: Final = 256
_NO_CUT: Final = 1 << 63  # above every log position


def _record(message: Message) -> Record:
    # The API gives times as float seconds: back to ns, exact to well under a microsecond.
    return Record(
        message.message_id,
        MessageLogRecord(
            log_position=message.position,
            topic=message.topic,
            queue_id=message.queue_id,
            queue_offset=message.queue_offset,
            body=message.body,
            stored_ns=round(message.stored_at * 1e9),
            created_ns=round(message.created_at * 1e9),
            tag=message.tag,
            key=message.key,
            properties=message.properties,
            code=message.code,
        ),
    )


class Follower:
    """The queues of ``topic`` (all topics when None; queue ``queue_id`` alone when
    given), each from where it ends now: create it before walking what the store holds.
    ``skipped`` hears of every run of offsets retention (or compaction) removed before
    the follower read them, so that a ``tail -f`` reader is told, not left to guess."""

    def __init__(
        self,
        path: Path,
        topic: str | None,
        queue_id: int | None,
        offset: int = 0,
        skipped: Skipped | None = None,
    ) -> None:
        self._store = MessageStore.open(path, read_only=True)
        self._topic = topic
        self._queue_id = queue_id
        self._skipped = skipped
        self._next: dict[tuple[str, int], int] = {}
        for topic_queue in self._queues():
            end = self._store.queue_range(*topic_queue)[1]
            self._next[topic_queue] = max(end, offset) if queue_id is not None else end

    def close(self) -> None:
        self._store.close()

    def _queues(self) -> list[tuple[str, int]]:
        topics = self._store.topics()
        if self._topic is not None:
            topics = [self._topic] if self._topic in topics else []
        return [
            (topic, queue_id)
            for topic in topics
            for queue_id in self._store.queue_ids(topic)
            if self._queue_id is None or queue_id == self._queue_id
        ]

    def records(self, after: int, filters: Filters) -> Iterator[Record]:
        """Every new message past log position ``after`` (the walk before printed those
        up to it) that ``filters`` keeps, in log order; never ends (stop it with
        KeyboardInterrupt).

        Each round pulls every queue past where it stopped, then looks for topics created
        meanwhile and pulls those too. The pulls are not one snapshot (a writer goes on
        between them), but messages are written in position order: every message up to
        the highest position seen before this round (the walk's end, or a pull of an
        earlier round) was written before this round's first pull, so this round holds
        all of them, but for a queue whose batch was cut short. Up to there a round
        prints, in log order; the rest is held and printed by a later round."""
        held: list[Message] = []
        seen = after  # the highest position known written before the next round starts
        while True:
            known = self._queues()
            arrived, cut = self._pull(known)
            if not arrived and not held:
                time.sleep(POLL_SECONDS)
                self._store.refresh()  # new topics, and chunks retention removed
                continue
            self._store.refresh()
            more, more_cut = self._pull([q for q in self._queues() if q not in set(known)])
            arrived += more
            limit = min(seen, cut, more_cut)
            seen = max([seen, *(m.position for m in arrived)])
            pending = sorted(held + arrived, key=lambda m: m.position)
            held = [m for m in pending if m.position > limit]
            for message in pending:
                if message.position > limit:
                    break
                if message.position <= after:
                    continue  # the walk has seen it
                record = _record(message)
                if filters.match(record.message):
                    yield record

    def _pull(self, queues: list[tuple[str, int]]) -> tuple[list[Message], int]:
        """What ``queues`` hold past where each stopped, and the lowest last position of
        a queue that may hold more (its batch was full; a large number when none was)."""
        arrived: list[Message] = []
        cut = _NO_CUT
        for topic, queue_id in queues:
            offset = self._next.get((topic, queue_id), 0)
            result = self._store.pull(topic, queue_id, offset, max_count=_BATCH)
            self._next[(topic, queue_id)] = result.next_offset
            # No tag filter here: every offset up to next_offset comes back but those
            # the store no longer holds (a pull moves past what retention removed).
            reached = result.messages[0].queue_offset if result.messages else result.next_offset
            if reached > offset and self._skipped is not None:
                self._skipped(topic, queue_id, offset, reached)
            arrived += result.messages
            if len(result.messages) == _BATCH:
                cut = min(cut, result.messages[-1].position)
        return arrived, cut
