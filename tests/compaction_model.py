"""A plain-Python reference of the compaction policy, for tests to compare the job against.

Written from the issue's rules, not from the job: newest message per key for
compacted topics (tombstones expire after delete_retention, and then go once no older
record of their key survives), retention for
keyless messages and for "delete" topics, only eligible chunks touched, and a
chunk rewritten only if its survivors plus their position map are smaller
than what it holds now.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from equeue import Message, MessageStore
from equeue.chunks.stream import ChunkFile
from equeue.compaction.plan import Snapshot, SnapshotChunk, take_snapshot
from equeue.format.chunk import FRAME_OVERHEAD, HEADER_SIZE, MAP_ENTRY_SIZE
from equeue.format.message import MessageLogRecord
from equeue.store.topics import TopicPolicy


@dataclass(frozen=True)
class Stored:
    position: int
    topic: str
    key: str | None
    stored_ns: int
    tombstone: bool
    frame_size: int
    chunk: int  # start number of the chunk file holding it


def stored_messages(snapshot: Snapshot) -> list[Stored]:
    """Every record of the snapshot's chunks, read straight from the files."""
    found = []
    for chunk in snapshot.chunks:
        for _, payload in ChunkFile.open(chunk.path, chunk.data_end).records():
            record = MessageLogRecord.unpack(payload)
            found.append(
                Stored(
                    record.log_position,
                    record.topic,
                    record.key,
                    record.stored_ns,
                    record.key is not None and record.body == b"",
                    len(payload) + FRAME_OVERHEAD,
                    chunk.start_number,
                )
            )
    return found


def policy_removes(
    messages: list[Stored], policies: dict[str, TopicPolicy], now: float
) -> set[int]:
    """Positions the policy removes, wherever they are (eligibility is applied later)."""
    now_ns = int(now * 1e9)
    latest: dict[tuple[str, str], int] = {}
    for m in messages:
        if m.key is not None and policies.get(m.topic, TopicPolicy()).compact:
            latest[(m.topic, m.key)] = max(latest.get((m.topic, m.key), -1), m.position)
    removed = set()
    for m in messages:
        policy = policies.get(m.topic, TopicPolicy())
        if policy.compact and m.key is not None:
            tombstone_cutoff = now_ns - int(policy.delete_retention.total_seconds() * 1e9)
            if m.position < latest[(m.topic, m.key)] or (
                m.tombstone and m.stored_ns < tombstone_cutoff
            ):
                removed.add(m.position)
        elif policy.retention is not None and m.stored_ns < now_ns - int(
            policy.retention.total_seconds() * 1e9
        ):
            removed.add(m.position)
    return removed


def expected_removed(store: Path, now: float, *, snapshot: Snapshot | None = None) -> set[int]:
    """What a compaction at ``now`` must remove from the store as it is now.

    Only chunks that would shrink are rewritten; and an expired tombstone, its key's
    newest record, goes only if no older record of its key survives anywhere (Kafka's
    cleaner guarantee: else the older value would become the key's final value again).
    Keeping a tombstone can stop its chunk from shrinking, so this is settled by
    repeating until nothing changes."""
    snapshot = snapshot or take_snapshot(store)
    messages = stored_messages(snapshot)
    removed = policy_removes(messages, snapshot.policies, now)
    of_key: dict[tuple[str, str], list[Stored]] = {}
    for m in messages:
        if m.key is not None and snapshot.policies.get(m.topic, TopicPolicy()).compact:
            of_key.setdefault((m.topic, m.key), []).append(m)
    # A key's newest record (of a compacted topic) is removed only as an expired tombstone.
    conditional: dict[int, list[Stored]] = {}
    for records in of_key.values():
        newest = max(records, key=lambda m: m.position)
        if newest.position in removed:
            conditional[newest.position] = [m for m in records if m is not newest]
    by_chunk: dict[int, list[Stored]] = {}
    for m in messages:
        by_chunk.setdefault(m.chunk, []).append(m)
    while True:
        rewritten: dict[int, list[Stored]] = {}
        for chunk in snapshot.eligible:
            records = by_chunk.get(chunk.start_number, [])
            gone = [m for m in records if m.position in removed]
            kept = [m for m in records if m.position not in removed]
            new_size = sum(m.frame_size for m in kept) + MAP_ENTRY_SIZE * len(kept)
            if gone and new_size < chunk.data_end + chunk.map_bytes:
                rewritten[chunk.start_number] = gone
        result = {m.position for gone in rewritten.values() for m in gone}
        survivors = [
            position
            for position, older in conditional.items()
            if position in removed and any(o.position not in result for o in older)
        ]
        if not survivors:
            return result
        removed -= set(survivors)


def all_messages(store: MessageStore) -> dict[int, Message]:
    """Every message a consumer can pull, by position, over every topic and queue."""
    found: dict[int, Message] = {}
    for topic in store.topics():
        for queue_id in store.queue_ids(topic):
            offset = 0
            while True:
                result = store.pull(topic, queue_id, offset, 1000)
                for message in result.messages:
                    found[message.position] = message
                if result.next_offset == offset:
                    break
                offset = result.next_offset
    return found


def made_up_snapshot(size: int = 4096) -> Snapshot:
    """4 eligible chunks of ``size`` bytes holding 40 records of 100 bytes each (4000
    bytes): a chunk shrinks once 5 of its records go."""
    chunks = [
        SnapshotChunk(f"c{n}", 4000, n, n, 0, True, 40, HEADER_SIZE + 4000, 0, True)
        for n in range(4)
    ]
    return Snapshot("s", 1, size, 4 * size, chunks, {})
