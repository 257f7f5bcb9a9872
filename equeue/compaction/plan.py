"""What a compaction job works on, in plain Python: the store snapshot it plans from,
and how chunks with something to remove are grouped into replacement files.

Eligible chunks are completed and end at or before the store's checkpoint
(every queue entry pointing into them is durable, so recovery never needs to
re-dispatch from a chunk that compaction rewrote). Later chunks are read, up to
the checkpoint, only so their keys supersede older messages.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from equeue.chunks.stream import ChunkFile
from equeue.format.chunk import FOOTER_SIZE, HEADER_SIZE, MAP_ENTRY_SIZE
from equeue.store.meta import CHECKPOINT_FILE
from equeue.store.topics import TopicPolicy


@dataclass(frozen=True, slots=True)
class SnapshotChunk:
    path: str
    data_end: int  # committed data end, capped at the checkpoint (see take_snapshot)
    start_number: int
    end_number: int
    version: int
    completed: bool
    record_count: int
    file_size: int
    map_bytes: int
    eligible: bool


@dataclass(frozen=True, slots=True)
class Snapshot:
    store: str
    store_id: int
    chunk_data_size: int
    checkpoint_position: int
    chunks: list[SnapshotChunk]
    policies: dict[str, TopicPolicy]

    @property
    def eligible(self) -> list[SnapshotChunk]:
        return [c for c in self.chunks if c.eligible]


def take_snapshot(store: str | Path) -> Snapshot:
    """The store as a read-only open sees it now (beside a running writer, if any)."""
    from equeue.store.store import MessageStore

    with MessageStore.open(store, read_only=True) as opened:
        checkpoint = opened._read_meta(CHECKPOINT_FILE, {})
        position = checkpoint.get("log_position") if isinstance(checkpoint, dict) else None
        checkpointed = position if isinstance(position, int) else 0
        chunks = list(opened._messages)
        last = chunks[-1] if chunks else None
        return Snapshot(
            store=os.path.abspath(store),
            store_id=opened.store_id,
            chunk_data_size=opened.config.layout.chunk_data_size,
            checkpoint_position=checkpointed,
            chunks=[
                SnapshotChunk(
                    # Absolute (tasks run in other working directories), not resolved:
                    # the path the user gave is the one every node mounts.
                    path=os.path.abspath(c.path),
                    # Only records up to the checkpoint are known durable: a newer message
                    # that could still be lost to a power cut must not supersede an older
                    # one that compaction would remove for good.
                    data_end=max(0, min(c.data_end, checkpointed - c.start_position)),
                    start_number=c.start_number,
                    end_number=c.end_number,
                    version=c.version,
                    completed=c.is_completed,
                    record_count=c.record_count,
                    # From the loaded header and footer, not a stat: retention may have
                    # removed the file since the open listed it (review17 R17-5 showed a
                    # FileNotFoundError here beside a writer with retention).
                    file_size=c.file_size,
                    map_bytes=c.footer.map_entry_count * MAP_ENTRY_SIZE
                    if c.footer is not None and c.header.compacted
                    else 0,
                    eligible=c.is_completed and c is not last and c.end_position <= checkpointed,
                )
                for c in chunks
            ],
            policies={t: opened.topic_policy(t) for t in opened.topics()},
        )


@dataclass(frozen=True, slots=True)
class Removals:
    """What pass 1 decided to remove from one chunk."""

    count: int
    bytes: int  # frame bytes


@dataclass(slots=True)
class Group:
    """Consecutive chunks rewritten into one compacted file."""

    index: int
    chunks: list[SnapshotChunk] = field(default_factory=list)
    kept: list[tuple[int, int]] = field(default_factory=list)  # per chunk: survivors' bytes, count
    removed_count: int = 0
    kept_bytes: int = 0
    kept_count: int = 0

    @property
    def version(self) -> int:
        return max(c.version for c in self.chunks) + 1

    @property
    def start_number(self) -> int:
        return self.chunks[0].start_number

    @property
    def end_number(self) -> int:
        return self.chunks[-1].end_number

    @property
    def bytes_before(self) -> int:
        return sum(c.file_size for c in self.chunks)

    @property
    def bytes_after(self) -> int:
        """The replacement's file size, known before it is written."""
        return HEADER_SIZE + self.kept_bytes + MAP_ENTRY_SIZE * self.kept_count + FOOTER_SIZE

    def open_chunks(self) -> list[ChunkFile]:
        return [ChunkFile.open(c.path, c.data_end) for c in self.chunks]


def plan_groups(
    snapshot: Snapshot, removals: dict[int, Removals], *, merge: bool = True
) -> list[Group]:
    """Group the eligible chunks that have something to remove.

    A chunk is rewritten only if its content would shrink: the survivors plus
    their position map take fewer bytes than its data and map do now.
    Consecutive such chunks are merged (as EventStore's scavenger does) while the
    survivors of the group fit one chunk's data size.
    """
    rewritten = _shrinking(snapshot, removals)
    groups: list[Group] = []
    for chunk, removed in rewritten:
        kept_bytes = chunk.data_end - removed.bytes
        last = groups[-1] if groups else None
        if (
            merge
            and last is not None
            and last.end_number + 1 == chunk.start_number
            and last.kept_bytes + kept_bytes <= snapshot.chunk_data_size
        ):
            group = last
        else:
            group = Group(len(groups))
            groups.append(group)
        group.chunks.append(chunk)
        group.kept.append((kept_bytes, chunk.record_count - removed.count))
        group.removed_count += removed.count
        group.kept_bytes += kept_bytes
        group.kept_count += chunk.record_count - removed.count
    return groups


def _shrinking(
    snapshot: Snapshot, removals: dict[int, Removals]
) -> list[tuple[SnapshotChunk, Removals]]:
    """The eligible chunks whose content would shrink, with what they lose."""
    rewritten: list[tuple[SnapshotChunk, Removals]] = []
    for chunk in snapshot.eligible:
        removed = removals.get(chunk.start_number)
        if removed is None or removed.count == 0:
            continue
        kept_bytes = chunk.data_end - removed.bytes
        kept_count = chunk.record_count - removed.count
        if kept_bytes + MAP_ENTRY_SIZE * kept_count >= chunk.data_end + chunk.map_bytes:
            continue
        rewritten.append((chunk, removed))
    return rewritten


@dataclass(frozen=True, slots=True)
class ConditionalTombstone:
    """An expired tombstone, its key's newest record, with older records of its key in
    the files starting at the chunk numbers ``older``."""

    position: int
    size: int  # frame bytes
    older: frozenset[int]


def settle_tombstones(
    snapshot: Snapshot,
    removals: dict[int, Removals],
    tombstones: list[ConditionalTombstone],
    gone: frozenset[int] = frozenset(),
) -> tuple[dict[int, Removals], dict[int, list[int]]]:
    """What goes once the conditional tombstones are settled, and per chunk file (start
    number) the positions of those that stay.

    A tombstone goes only if its own file and every file with an older record of its key
    are rewritten: a chunk left alone (it would not shrink) keeps its superseded values,
    and without the tombstone the newest of them would be the key's final value again
    (Kafka's guarantee: a tombstone outlives every older value of its key). Keeping a
    tombstone can stop its own chunk from shrinking, which keeps more values, so this
    starts from every tombstone going and drops those whose files are not rewritten until
    nothing changes (the set only shrinks, so it ends). A file in ``gone`` (retention
    removed it since the snapshot) holds none of its older values any more: it counts as
    rewritten, as for a job that never saw it."""
    file_of = _file_of(snapshot)
    going = list(tombstones)
    while True:
        total = dict(removals)
        for tombstone in going:
            number = file_of(tombstone.position)
            before = total.get(number, Removals(0, 0))
            total[number] = Removals(before.count + 1, before.bytes + tombstone.size)
        rewritten = {chunk.start_number for chunk, _ in _shrinking(snapshot, total)}
        still = [
            t for t in going if file_of(t.position) in rewritten and t.older <= rewritten | gone
        ]
        if len(still) == len(going):
            break
        going = still
    goes = {t.position for t in going}
    kept: dict[int, list[int]] = {}
    for tombstone in tombstones:
        if tombstone.position not in goes:
            kept.setdefault(file_of(tombstone.position), []).append(tombstone.position)
    return total, kept


def tombstone_needs(
    snapshot: Snapshot, tombstones: list[ConditionalTombstone], kept: dict[int, list[int]]
) -> dict[int, frozenset[int]]:
    """Per chunk file (start number), the other files whose rewrite its replacement
    needs: those with older records of the keys whose tombstones go from it (see
    settle_tombstones). Installed without them, the newest older value kept there would be
    its key's final value again; with them gone (retention), no older value is left."""
    file_of = _file_of(snapshot)
    stays = {p for positions in kept.values() for p in positions}
    needs: dict[int, set[int]] = {}
    for tombstone in tombstones:
        if tombstone.position not in stays:
            number = file_of(tombstone.position)
            needs.setdefault(number, set()).update(tombstone.older - {number})
    return {number: frozenset(older) for number, older in needs.items() if older}


def _file_of(snapshot: Snapshot) -> Callable[[int], int]:
    """The start number of the snapshot's chunk file holding a position."""
    numbers = [c.start_number for c in snapshot.chunks]
    size = snapshot.chunk_data_size

    def file_of(position: int) -> int:
        return numbers[bisect.bisect_right(numbers, position // size) - 1]

    return file_of
