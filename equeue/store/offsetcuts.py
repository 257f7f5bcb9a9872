"""Committed offsets past their queue's end after a crash, lowered at the writable open.

A group's commit is written (and fsync'd) when its consumer has read the messages, which
can be before the log's fdatasync that makes them durable: a pull serves what is
appended, and under ``flush="sync"`` a send is answered only after its fdatasync, but a
consumer may read the message first. A power cut in that window leaves a committed
offset past the end the log recovers to. A pull from past the end is answered the end,
so the group would wait at the old offset and skip the messages sent after the restart
up to it, acknowledged and durable ones too (review19 R19-1). ``commit_offset`` refuses
an offset past the end, so an offset past it at an open was left by such a cut (or a
hand); the open sets it to the end, as ``commit_offset`` would, and reports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from equeue.errors import EQueueError
from equeue.store import groupdeletion
from equeue.store import offsets as group_offsets

if TYPE_CHECKING:
    from equeue.store.store import MessageStore


def lower_past_ends(store: MessageStore) -> list[str]:
    """The writer's open, after recovery, before anything is served: every committed
    offset past its queue's end set to the end; one problem a queue of a group."""
    problems: list[str] = []
    for group, topics in sorted(group_offsets.committed(store).items()):
        if groupdeletion.has_intent(store, group):
            continue  # its deletion finishes later in this open
        for topic, queues in sorted(topics.items()):
            known = store._queues.get(topic, [])
            for key, offset in sorted(queues.items()):
                queue_id = int(key)
                if queue_id >= len(known) or offset <= known[queue_id].next_offset:
                    continue
                queue = known[queue_id]
                if queue.deferred:
                    queue.manager  # noqa: B018 (its end from its files, not a checkpoint's)
                    if offset <= queue.next_offset:
                        continue
                end = queue.next_offset
                what = (
                    f"consumer group {group!r} had committed offset {offset} on "
                    f"{topic}/{queue_id}, past the queue's end {end} after recovery: a crash "
                    f"cut the log after the group committed (its consumer had read messages "
                    f"that were not yet durable)"
                )
                try:
                    group_offsets.set_offset(store, group, topic, queue_id, end)
                except (EQueueError, OSError) as exc:
                    problems.append(
                        f"{what}; lowering it to {end} failed ({exc}): until it is, the group "
                        f"skips the messages sent to offset {offset}; commit_offset({group!r}, "
                        f"{topic!r}, {queue_id}, {end}) lowers it"
                    )
                else:
                    problems.append(
                        f"{what}; lowered to {end}, so the group reads the messages sent from "
                        "now on instead of skipping them"
                    )
    return problems
