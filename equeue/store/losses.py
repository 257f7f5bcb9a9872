"""Losses a store can see at open: files deleted or replaced from outside.

Retention deletes chunks only after the checkpoint names the log's new start and
the queues' new first offsets (``checkpoint.note_retention``), and consumer offsets
are never removed, so the checkpoint's ``log_start``, ``queue_starts`` and
``committed_offsets`` tell a deletion from retention: a log or a queue that starts
later than recorded, or fewer committed offsets than recorded, lost data. A writer's
next checkpoint records the store as it is now, so each loss is reported once.

Topics are derived too: a writer whose topics.json is missing or damaged rebuilds it
from the ``queues/<topic>/<n>/`` directories holding chunk files (names validated as
the API validates them); the topics' cleanup policies are lost with the file.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from equeue.atomicfile import read_json
from equeue.errors import EQueueError, location
from equeue.format.chunk import parse_chunk_file_name
from equeue.format.message import QUEUE_RECORD_SIZE
from equeue.store import validate
from equeue.store.meta import (
    CHECKPOINT_FILE,
    MESSAGES_DIR,
    OFFSETS_FILE,
    QUEUES_DIR,
    TOPICS_FILE,
)
from equeue.store.topics import TopicPolicy

if TYPE_CHECKING:
    from equeue.store.store import MessageStore


def _recorded(checkpoint: dict[str, Any], name: str) -> int | None:
    value = checkpoint.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def losses_at_open(store: MessageStore, checkpoint: dict[str, Any]) -> list[str]:
    """What the checkpoint says the store held and it no longer holds."""
    problems: list[str] = []
    where = location(store.path / CHECKPOINT_FILE, None)
    messages = store._messages
    first, end = messages.first_position, messages.committed_position
    # The starts from a checkpoint read after the chunks were listed: beside a live
    # writer, retention may have noted a later start and deleted since the first read.
    starts = _reread(store) if store.read_only else checkpoint
    log_start = _recorded(starts, "log_start")
    if log_start is not None and first > log_start:
        problems.append(
            f"the message log in {store.path / MESSAGES_DIR} starts at position {first}, but "
            f"the checkpoint {where} recorded that it starts at {log_start}: the chunk files "
            f"holding positions {log_start}..{first - 1} were deleted (not by retention, which "
            "records the log's new start before it deletes)"
        )
    durable = _recorded(checkpoint, "log_position")
    if durable is not None and end < durable and (log_start is None or durable > log_start):
        problems.append(
            f"the message log in {store.path / MESSAGES_DIR} ends at position {end}, but the "
            f"checkpoint {where} recorded durable records up to {durable}: the records "
            f"from {max(end, first)} to {durable} are lost"
        )
    queue_starts = starts.get("queue_starts")
    for topic, offsets in (queue_starts if isinstance(queue_starts, dict) else {}).items():
        queues = store._queues.get(topic, [])
        for queue_id, recorded in enumerate(offsets if isinstance(offsets, list) else []):
            if queue_id >= len(queues) or not isinstance(recorded, int):
                continue
            if queues[queue_id].deferred:
                continue  # checked when opened (QueueFiles._check_ends)
            manager = queues[queue_id].manager
            on_disk = manager.first_position // QUEUE_RECORD_SIZE
            if on_disk > recorded:
                problems.append(
                    f"queue {topic}/{queue_id} in {manager.directory} starts at offset "
                    f"{on_disk}, but the checkpoint {where} recorded its first offset as "
                    f"{recorded}: the entries {recorded}..{on_disk - 1} were deleted"
                )
    if store.read_only:  # a writer's recovery_start reports these, and rebuilds them
        problems += _short_queues(store, checkpoint, where)
    committed = _recorded(checkpoint, "committed_offsets")
    have = sum(len(qs) for ts in store._offsets.values() for qs in ts.values())
    offsets_path = str(store.path / OFFSETS_FILE)
    reported = any(offsets_path in problem for problem in store._meta_problems)  # damaged
    if committed is not None and have < committed and not reported:
        problems.append(
            f"{offsets_path} holds {have} committed consumer offsets, but the "
            f"checkpoint {where} recorded {committed}: {committed - have} were lost (offsets "
            "are never removed); those consumer groups restart where their clients say"
        )
    return problems


def _reread(store: MessageStore) -> dict[str, Any]:
    try:
        body = read_json(store.path / CHECKPOINT_FILE)
    except (OSError, EQueueError):
        return {}
    return body if isinstance(body, dict) else {}


def _short_queues(store: MessageStore, checkpoint: dict[str, Any], where: str) -> list[str]:
    problems = []
    ends = checkpoint.get("queues")
    for topic, offsets in (ends if isinstance(ends, dict) else {}).items():
        queues = store._queues.get(topic, [])
        for queue_id, recorded in enumerate(offsets if isinstance(offsets, list) else []):
            if queue_id < len(queues) and isinstance(recorded, int):
                queue = queues[queue_id]
                if not queue.deferred and queue.next_offset < recorded:  # (opened on use)
                    problems.append(
                        f"queue {topic}/{queue_id} in {queue.directory} ends at offset "
                        f"{queue.next_offset}, but the checkpoint {where} recorded {recorded} "
                        "entries: the rest are missing (a writer's open rebuilds them from "
                        "the log)"
                    )
    return problems


def topics_from_directories(
    root: Path, known: Collection[str] = ()
) -> tuple[dict[str, int], list[str]]:
    """{topic: queue count} of the topic directories under ``root`` (queues/) whose queue
    directories hold chunk files, ``known`` topics left out (one listdir for them all);
    and what was skipped, and why."""
    found: dict[str, int] = {}
    skipped: list[str] = []
    try:
        names = sorted(os.listdir(root))
    except (FileNotFoundError, NotADirectoryError):
        return found, skipped
    for name in names:
        if name in known:
            continue
        path = root / name
        if path.is_symlink() or not path.is_dir():
            continue
        bad: list[tuple[Path, str]] = []
        ids, holds_chunks = scan_topic_dir(path, bad)
        skipped += [f"{where}: {why}" for where, why in bad]
        if ids and holds_chunks:  # empty directories: a create_topic that did not finish
            found[name] = max(ids) + 1
    return found, skipped


def scan_topic_dir(path: Path, skipped: list[tuple[Path, str]]) -> tuple[list[int], bool]:
    """The queue ids of the directories in the topic directory ``path`` (its name and
    theirs checked as the API checks a topic and a queue id), and whether one of them
    holds chunk files; what is not a topic's or a queue's is added to ``skipped`` with
    why (the store never opens it; the inspector reports it)."""
    try:
        validate.check_topic(path.name)
    except EQueueError as exc:
        skipped.append((path, f"not a topic name ({exc})"))
        return [], False
    ids: list[int] = []
    holds_chunks = False
    for entry in sorted(os.listdir(path)):
        queue_dir = path / entry
        if queue_dir.is_symlink() or not queue_dir.is_dir():
            continue
        # ASCII digits only ("²".isdigit(), and int() refuses it), no leading zero, and
        # bounded: 99999999 must not make a reader walk 10**8 queues.
        valid = entry.isascii() and entry.isdecimal() and str(int(entry)) == entry
        if not valid or int(entry) >= validate.MAX_QUEUES:
            skipped.append((queue_dir, f"not a queue id (0..{validate.MAX_QUEUES - 1})"))
            continue
        ids.append(int(entry))
        holds_chunks = holds_chunks or any(parse_chunk_file_name(n) for n in os.listdir(queue_dir))
    return ids, holds_chunks


def recover_topics(
    store: MessageStore, listed: dict[str, Any], intact: bool, problems: list[str]
) -> dict[str, Any]:
    """topics.json's body, with the topics whose queue directories hold chunk files
    added when the file is missing or damaged (``intact`` False) or lacks them; a writer
    writes the result back. Every addition is reported."""
    found, skipped = topics_from_directories(store.path / QUEUES_DIR, listed)
    added = {topic: count for topic, count in found.items() if topic not in listed}
    if not added:
        return listed
    path = store.path / TOPICS_FILE
    policy = TopicPolicy().to_json()
    result = dict(listed) | {topic: {"queue_count": n, **policy} for topic, n in added.items()}
    state = "missing or damaged" if not intact else "lacks them"
    message = (
        f"topics {sorted(added)} have queue directories under {store.path / QUEUES_DIR} "
        f"but {path} is {state}: rebuilt from the directories "
        f"({', '.join(f'{t}: {n} queues' for t, n in sorted(added.items()))}); their cleanup "
        "policies are lost and reset to the defaults (cleanup='delete', no retention): set "
        "them again with create_topic()"
    )
    if skipped:
        message += "; skipped " + "; ".join(skipped)
    if not store.read_only:
        # (at a generation: never an old version's head), once the open succeeds
        store._topics_file.recovered_at_open(result)
        message += f"; {path} rewritten"
    if message not in problems:  # a read-only handle rereads topics.json on refresh()
        problems.append(message)
    return result


def read_topics(store: MessageStore) -> dict[str, Any]:
    """topics.json's body, recovered from the queue directories where it falls short."""
    path = store.path / TOPICS_FILE
    existed = os.path.lexists(path)
    before = len(store._meta_problems)
    listed = store._topics_file.read(lambda: store._read_meta(TOPICS_FILE, {}))
    intact = existed and len(store._meta_problems) == before and isinstance(listed, dict)
    return recover_topics(
        store, listed if isinstance(listed, dict) else {}, intact, store._meta_problems
    )
