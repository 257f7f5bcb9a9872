"""``equeue verify``'s look at committed offsets past their queue's end: what a power
cut leaves when a group committed messages its consumer read before the log's fdatasync
(docs/durability.md). The next writable open sets each to the end and reports it
(equeue/store/offsetcuts.py); verify says so before, so that the skip it prevents is
not a surprise."""

from __future__ import annotations

from pathlib import Path

from equeue.atomicfile import read_json
from equeue.errors import EQueueError
from equeue.format.message import QUEUE_RECORD_SIZE
from equeue.inspect.layout import ChunkDir, Problem, StoreFiles
from equeue.store.meta import CONSUMERS_DIR, OFFSETS_FILE
from equeue.store.offsets import file_name


def past_end_problems(
    store: StoreFiles, dirs: dict[Path, ChunkDir], log_next: dict[tuple[str, int], int]
) -> list[Problem]:
    """Each committed offset (offsets.json and the group files, as every handle merges
    them) past the end its queue recovers to: the larger of its queue files' end and the
    offset after its last message in the log (recovery re-dispatches those)."""
    problems: list[Problem] = []
    for group, topics in sorted(store.offsets.items()):
        if not isinstance(topics, dict):
            continue
        for topic, queues in sorted(topics.items()):
            if not isinstance(queues, dict) or topic not in store.topics:
                continue
            for key, committed in sorted(queues.items()):
                if not key.isdigit() or not isinstance(committed, int):
                    continue
                queue_id = int(key)
                if queue_id >= store.topics[topic]:
                    continue
                chunks = dirs.get(store.queue_dir(topic, queue_id))
                end = max(
                    0 if chunks is None else chunks.end_position // QUEUE_RECORD_SIZE,
                    log_next.get((topic, queue_id), 0),
                )
                if committed <= end:
                    continue
                # The file holding the offset: offsets.json's entry if it is past the end
                # (commit_offset's), else the group file (a consumer's commits).
                where = store.path / OFFSETS_FILE
                if _writer_offset(where, group, topic, key) < committed:
                    where = store.path / CONSUMERS_DIR / file_name(group)
                problems.append(
                    Problem(
                        str(where),
                        None,
                        "committed offset",
                        f"consumer group {group!r} committed offset {committed} on "
                        f"{topic}/{queue_id}, past the queue's end {end}: a crash cut the log "
                        "after the group committed; the next writable open sets it to the "
                        "end (else the group would skip the messages sent next)",
                    )
                )
    return problems


def _writer_offset(path: Path, group: str, topic: str, queue_id: str) -> int:
    """offsets.json's own value (StoreFiles.offsets merges the group files in); -1 when
    it has none or cannot be read (open_store reported that)."""
    try:
        body = read_json(path)
    except (OSError, EQueueError):
        return -1
    for name in (group, topic, queue_id):
        body = body.get(name) if isinstance(body, dict) else None
    return body if isinstance(body, int) and not isinstance(body, bool) else -1
