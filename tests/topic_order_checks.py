"""The durability order of topic changes, checked on a disk image without the store.

The rule (docs/durability.md, "The order of a topic's changes"): nothing that names a
topic becomes durable before the topic's creation record (a topics.journal record or
topics.json), and a deleted topic's files go only after its deletion record is durable.
``order_problems`` reads a store directory the way a power cut left it and lists every
file that names a topic the durable topics state does not have:

* a message record of the log (an independent walk, each frame's checksum checked) whose
  topic has no entry, an entry that is only a deletion made before the record's position
  (a topic created again whose creation record was lost), or fewer queues than its queue id;
* a queue directory ``queues/<topic>/<n>/`` holding chunk files;
* the checkpoint's queues (``queues``, ``queue_starts``);
* the committed offsets of ``offsets.json`` and of ``consumers/*.json``.

A deleted topic's entry (``deleted_before``) counts as naming it for the files a deletion
removes after its commit point (queue directories, offsets, an older checkpoint): a writer's
open finishes those.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from crash_checks import walk_log

from equeue.format.chunk import parse_chunk_file_name
from equeue.format.message import MESSAGE_HEAD, MESSAGE_HEAD_SIZE
from equeue.store.meta import CHECKPOINT_FILE, CONSUMERS_DIR, OFFSETS_FILE, QUEUES_DIR
from equeue.store.topics import DELETED_BEFORE
from equeue.store.topicsfile import read_topics_body


def durable_topics(root: Path) -> dict[str, dict[str, Any]]:
    """topics.json with the journal replayed over it (a torn tail left out), as the next
    open reads them."""
    body = read_topics_body(root)
    assert isinstance(body, dict), body
    return body


def _json_body(path: Path) -> Any:
    """A metadata file's body (atomicfile's layout: {"body": ..., "xxh64": ...}); None if
    it is missing or unreadable (the open reports that, it names nothing)."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return data.get("body", data) if isinstance(data, dict) else None


def order_problems(root: Path, chunk_data_size: int) -> list[str]:
    topics = durable_topics(root)
    problems: list[str] = []

    def known(topic: str, what: str) -> None:
        if topic not in topics:
            problems.append(f"{what} names topic {topic!r}, which no durable topic record has")

    records, _ = walk_log(root / "messages", chunk_data_size)
    for position, payload in records:
        (_, _, _, _, queue_id, _, _, _, topic_length, *_) = MESSAGE_HEAD.unpack_from(payload)
        topic = payload[MESSAGE_HEAD_SIZE : MESSAGE_HEAD_SIZE + topic_length].decode()
        entry = topics.get(topic)
        what = f"the message record at position {position} ({topic}/{queue_id})"
        if entry is None:
            known(topic, what)
        elif position < entry.get(DELETED_BEFORE, 0):
            continue  # a deleted topic's record: skipped by recovery
        elif entry.get("queue_count") is None:
            problems.append(
                f"{what} comes after the topic's deletion at {entry[DELETED_BEFORE]}, "
                "and no durable record creates it again"
            )
        elif queue_id >= entry["queue_count"]:
            problems.append(f"{what}: the durable record gives it {entry['queue_count']} queues")
    queues = root / QUEUES_DIR
    for topic_dir in sorted(queues.iterdir()) if queues.is_dir() else []:
        for queue_dir in sorted(topic_dir.iterdir()):
            if any(parse_chunk_file_name(p.name) for p in queue_dir.iterdir()):
                known(topic_dir.name, f"the queue directory {queue_dir.relative_to(root)}")
    checkpoint = _json_body(root / CHECKPOINT_FILE)
    if isinstance(checkpoint, dict):
        for field in ("queues", "queue_starts"):
            for topic in checkpoint.get(field, {}):
                known(topic, f"the checkpoint's {field}")
    offsets = _json_body(root / OFFSETS_FILE)
    for group, by_topic in (offsets if isinstance(offsets, dict) else {}).items():
        for topic in by_topic:
            known(topic, f"{OFFSETS_FILE} (group {group!r})")
    consumers = root / CONSUMERS_DIR
    for path in sorted(consumers.glob("*.json")) if consumers.is_dir() else []:
        body = _json_body(path)
        for topic in body.get("offsets", {}) if isinstance(body, dict) else {}:
            known(topic, f"{path.relative_to(root)}")
    return problems
