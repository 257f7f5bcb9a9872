"""``delete_topic``: a topic's queues and consumer offsets removed, crash-safe.

The commit point is a record of topics.json's journal (equeue/store/topicsfile.py): one
fdatasynced append drops the topic's entry and records the log position of the
deletion (``deleted_before``). Before it, a crash leaves the
topic as it was; after it, the topic is gone, and a writer's open finishes what the
crash interrupted (its consumer offsets, its queue directories). The topic's message
records stay in the log until retention removes them: recovery's re-dispatch skips a
topic's records from before its deletion (they are neither queued again nor reported),
and so does ``query_by_key``, so a topic created again under the same name starts empty.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import TYPE_CHECKING, Any

from equeue.atomicfile import read_json, write_json
from equeue.chunks.fileops import fsync_directory
from equeue.errors import EQueueError, StoreWriteError, TopicNotFoundError
from equeue.store import offsets as group_offsets
from equeue.store import validate
from equeue.store.meta import CHECKPOINT_FILE, OFFSETS_FILE, QUEUES_DIR

if TYPE_CHECKING:
    from equeue.store.store import MessageStore


def _step(name: str) -> None:
    """A point between two steps of a deletion (the crash tests stop a process here)."""


def delete_topic(store: MessageStore, topic: str) -> None:
    validate.check_topic(topic)
    store._check_writable()
    store._topic(topic)  # TopicNotFoundError before anything is written
    # A checkpoint first: re-dispatch after a crash then starts past the topic's records.
    store._checkpoint(flush=True)
    _step("checkpointed")
    with store._checkpoint_lock, store._lock:
        store._check_writable()
        queues = store._queues.get(topic)
        if queues is None:
            raise TopicNotFoundError(f"no topic {topic!r} in {store.path}")
        # The log durable up to the position recorded: after a power loss a shorter log
        # would put the records of a topic created again below it, hidden as deleted ones.
        store._writer.flush()
        deleted = store._deleted | {topic: store._messages.committed_position}
        counts = {t: len(qs) for t, qs in store._queues.items() if t != topic}
        # The commit point (a topics journal record); a failed write changes nothing.
        store._topics_file.record(
            topic, None, None, deleted[topic], lambda: (counts, store._policies, deleted)
        )
        _step("committed")
        store._deleted = deleted
        for table in (store._queues, store._topic_bytes, store._round_robin, store._policies):
            table.pop(topic, None)
        failure: BaseException | None = None
        for queue in queues:
            try:
                queue.close()
            except Exception as exc:  # the files go anyway
                failure = failure or exc
        _finish(store, topic)
    store._wake()  # pulls waiting on the closed queues fail now, not at their deadline
    store._checkpoint(flush=True)  # records the store without the topic
    _step("done")
    if failure is not None:
        raise failure


def record_mark(store: MessageStore, topic: str) -> bool:
    """A deletion mark for ``topic``, which does not exist: records of it below the log's
    end are a deleted topic's (the retry mover drops a deleted group's delayed copies by
    it). One journal record, the commit point delete_topic's has, and no topic made:
    nothing is left half done by a crash. False (nothing recorded) if the topic exists."""
    validate.check_topic(topic)
    with store._checkpoint_lock, store._lock:
        store._check_writable()
        if topic in store._queues:
            return False
        store._writer.flush()  # (durable up to the mark, as in delete_topic)
        deleted = store._deleted | {topic: store._messages.committed_position}
        counts = {t: len(qs) for t, qs in store._queues.items()}
        store._topics_file.record(
            topic, None, None, deleted[topic], lambda: (counts, store._policies, deleted)
        )
        store._deleted = deleted
    return True


def finish_deletions(store: MessageStore, checkpoint: dict[str, Any]) -> None:
    """At a writer's open: complete the deletions a crash interrupted after their commit
    point (a topic listed as deleted and not created again); ``checkpoint``, as the open
    read it, is kept in line with the file."""
    for topic in list(store._deleted):
        if topic not in store._queues:
            _finish(store, topic, checkpoint)


def follow_deletions(store: MessageStore, before: dict[str, int]) -> None:
    """A read-only handle: forget the topics deleted since it last read topics.json (a
    topic created again is then opened anew, as the writer made it)."""
    for topic, position in store._deleted.items():
        if before.get(topic) != position and topic in store._queues:
            for queue in store._queues.pop(topic):
                queue.close()
            for table in (store._topic_bytes, store._round_robin, store._policies):
                table.pop(topic, None)


def _finish(store: MessageStore, topic: str, checkpoint: dict[str, Any] | None = None) -> None:
    """Drop the deleted topic's consumer offsets (offsets.json, then the group files),
    then its queue directories."""
    if any(topic in topics for topics in store._offsets.values()):
        offsets = {
            group: {t: dict(qs) for t, qs in topics.items() if t != topic}
            for group, topics in store._offsets.items()
        }
        offsets = {group: topics for group, topics in offsets.items() if topics}
        # The checkpoint's count of committed offsets first: fewer offsets than it
        # records would be reported as lost (equeue/store/losses.py).
        count = sum(len(q) for ts in offsets.values() for q in ts.values())
        _lower_committed_count(store, count)
        if checkpoint is not None and isinstance(checkpoint.get("committed_offsets"), int):
            checkpoint["committed_offsets"] = min(count, checkpoint["committed_offsets"])
        _step("checkpoint count lowered")
        write_json(store.path / OFFSETS_FILE, offsets)
        store._offsets = offsets
        _step("offsets dropped")
    # The group files; the handle's parses of them too (none yet during its open).
    group_offsets.drop_topic(store.path, topic, getattr(store, "_group_files", None))
    directory = store.path / QUEUES_DIR / topic
    if not os.path.lexists(directory):
        return
    try:
        for entry in sorted(os.listdir(directory)):
            shutil.rmtree(directory / entry)
            _step("queue removed")
        os.rmdir(directory)
        fsync_directory(directory.parent)
    except OSError as exc:
        raise StoreWriteError(
            exc.errno,
            f"topic {topic!r} is deleted, but removing {directory} failed ({exc}); the next "
            "writable open removes what is left",
        ) from exc


def _lower_committed_count(store: MessageStore, count: int) -> None:
    path = store.path / CHECKPOINT_FILE
    body: Any = None
    with contextlib.suppress(OSError, EQueueError):  # none or damaged: nothing to compare
        body = read_json(path)
    if isinstance(body, dict) and isinstance(body.get("committed_offsets"), int):
        write_json(path, body | {"committed_offsets": min(count, body["committed_offsets"])})
