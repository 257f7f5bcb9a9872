"""Pass 1 of compaction on the executors: which records go.

Two Python steps over Spark RDDs, a shuffle after each, nothing else:

1. ``ChunkScan``, one task per chunk file: streams the chunk (metadata only)
   and settles what the chunk alone can settle, with the topic policies it
   carries: a keyless message, or any message of a "delete" topic, goes or
   stays by retention, and only those that go are sent on; an expired
   tombstone is marked to go. Every keyed message of a compacted topic is sent on, as a
   128-bit key hash, its position and a state, for the second step. The task
   hashes its rows into the shuffle's partitions itself and hands Spark one
   packed block of rows (``ROW``) per partition and batch: the JVM moves
   opaque bytes, never converts a row.
2. ``RemovedRows``, one task per partition of key hashes: sorts the
   partition's keyed rows by key and marks every row of a key but the one of its
   largest position as superseded. The newest message of a key can be in
   any chunk read, the ongoing one included, so only this step sees enough. An
   expired tombstone that is its key's newest row but not its only one is left to
   the driver (``CONDITIONAL``): it goes only if every older row goes. It
   shuffles the positions that go (packed, ascending) straight to one partition
   per chunk file, where pass 2 reads them, and how many go from each file and
   their frame bytes to one more partition, the driver's summary.

RDDs rather than DataFrames: the job needs no query planning, no Arrow
conversion of rows in the JVM, and its Python workers import neither pyarrow
nor pandas; each of those cost seconds that did not shrink with more task
slots (see docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import xxhash

from equeue.chunks.opening import retention_took
from equeue.chunks.stream import ChunkFile
from equeue.format.chunk import FRAME_OVERHEAD, FRAME_PREFIX_SIZE
from equeue.format.message import (
    BODY_LENGTH_OFFSET,
    FLAG_HAS_KEY,
    FLAGS_OFFSET,
    MESSAGE_HEAD_SIZE,
    POSITION_OFFSET,
    STORED_TIME_OFFSET,
    TOPIC_LENGTH_OFFSET,
)

# A scanned row: the key hash as two signed longs (its 16 big-endian bytes), the
# record's position, and size_state: the frame size times 4 plus the state.
ROW: Final = np.dtype([("hi", "<i8"), ("lo", "<i8"), ("position", "<i8"), ("size_state", "<i8")])

# The state of a scanned row. Keyed rows (below GONE) take part in deciding the
# newest message of their key, wherever they are; only eligible ones can go.
SUPERSEDES_ONLY: Final = 0  # keyed, in a chunk that is not rewritten
GOES_IF_SUPERSEDED: Final = 1  # keyed, in an eligible chunk
GOES_KEYED: Final = 2  # keyed, eligible, an expired tombstone: goes unless older records stay
GONE: Final = 3  # not a key of a compacted topic, past retention, in an eligible chunk
_STATES: Final = 4

BATCH_ROWS: Final = 65_536


@dataclass(frozen=True, slots=True)
class TopicRule:
    """A topic's policy as absolute cutoffs (ns since the epoch) at the job's ``now``."""

    compact: bool
    retention_cutoff: int | None  # stored before it: past retention
    tombstone_cutoff: int  # a tombstone stored before it has expired


@dataclass(frozen=True, slots=True)
class ScanChunk:
    path: str
    data_end: int
    number: int  # the chunk file's start number
    eligible: bool


@dataclass(frozen=True, slots=True)
class ChunkScan:
    """The step-1 function, over ``parallelize(range(len(chunks)), len(chunks))``: the
    element i scans ``chunks[i]`` and yields (partition, packed ``ROW`` rows) pairs for
    ``partitionBy(partitions, shuffle_partition)``. The listing and the rules travel
    with the function."""

    chunks: Sequence[ScanChunk]
    rules: dict[str, TopicRule]
    partitions: int

    def __call__(self, indices: Iterable[int]) -> Iterator[tuple[int, bytes]]:
        rules = {topic.encode(): rule for topic, rule in self.rules.items()}
        for index in indices:
            try:
                for rows in scan_chunk(self.chunks[index], rules):
                    yield from split_rows(rows, self.partitions)
            except FileNotFoundError:
                # Retention removed the chunk since the snapshot: the driver leaves it out
                # of the plan (rows sent before it went only stand for records now gone).
                # Anything else that removed it fails the job.
                if not retention_took(self.chunks[index].path):
                    raise


def shuffle_partition(partition: int) -> int:
    """``partitionBy``'s function: the pairs' keys already are partition numbers."""
    return partition


def split_rows(rows: np.ndarray, partitions: int) -> Iterator[tuple[int, bytes]]:
    """Rows by partition of their key hash: every row of a key lands in one partition."""
    target = rows["hi"] % partitions
    order = np.argsort(target, kind="stable")
    bounds = np.searchsorted(target[order], np.arange(partitions + 1))
    for partition in range(partitions):
        if bounds[partition] < bounds[partition + 1]:
            yield partition, rows[order[bounds[partition] : bounds[partition + 1]]].tobytes()


def scan_chunk(chunk: ScanChunk, rules: dict[bytes, TopicRule]) -> Iterator[np.ndarray]:
    """Step 1 for one chunk file: arrays of ``ROW`` rows, about BATCH_ROWS each."""
    table = _RuleTable(rules)
    pending: list[np.ndarray] = []
    count = 0
    for _, buf, offsets, _ in ChunkFile.open(chunk.path, chunk.data_end).frame_blocks():
        rows = _block_rows(buf, np.frombuffer(offsets, "<i8"), table, chunk.eligible)
        pending.append(rows)
        count += len(rows)
        if count >= BATCH_ROWS:
            yield np.concatenate(pending)
            pending, count = [], 0
    if count:
        yield np.concatenate(pending)


class _RuleTable:
    """The rules as columns, indexed by a topic's number (the last row: no policy)."""

    def __init__(self, rules: dict[bytes, TopicRule]) -> None:
        self.number = {topic: i for i, topic in enumerate(rules)}
        listed = [*rules.values(), TopicRule(False, None, _NEVER)]
        self.known = np.array([True] * len(rules) + [False])
        self.compact = np.array([r.compact for r in listed])
        self.retention_cutoff = np.array(
            [_NEVER if r.retention_cutoff is None else r.retention_cutoff for r in listed],
            np.int64,
        )
        self.tombstone_cutoff = np.array([r.tombstone_cutoff for r in listed], np.int64)


_NEVER: Final = np.iinfo(np.int64).min  # a cutoff nothing is stored before


def _column(data: np.ndarray, at: np.ndarray, dtype: str) -> np.ndarray:
    """The little-endian field of type ``dtype`` at each byte offset ``at`` of ``data``."""
    width = np.dtype(dtype).itemsize
    return data[at[:, None] + np.arange(width)].view(dtype).ravel()


def _block_rows(buf: bytes, offsets: np.ndarray, table: _RuleTable, eligible: bool) -> np.ndarray:
    """The rows of the frames at ``offsets`` of ``buf`` (checked frames): the heads' fields
    are read column-wise; only the topic lookup and the key hash run per record."""
    data = np.frombuffer(buf, np.uint8)
    head = offsets + FRAME_PREFIX_SIZE
    position = _column(data, head + POSITION_OFFSET, "<i8")
    stored = _column(data, head + STORED_TIME_OFFSET, "<i8")
    frame_size = _column(data, offsets, "<u4").astype(np.int64) + FRAME_OVERHEAD
    flags = data[head + FLAGS_OFFSET]
    topic_length = data[head + TOPIC_LENGTH_OFFSET].astype(np.int64)
    tag_length = data[head + TOPIC_LENGTH_OFFSET + 1].astype(np.int64)
    key_length = data[head + TOPIC_LENGTH_OFFSET + 2].astype(np.int64)
    body_length = _column(data, head + BODY_LENGTH_OFFSET, "<u4")
    topic_at = head + MESSAGE_HEAD_SIZE
    topics = [buf[t : t + n] for t, n in zip(topic_at.tolist(), topic_length.tolist(), strict=True)]
    number = table.number
    unknown = len(number)
    rule = np.array([number.get(t, unknown) for t in topics], np.int64)
    keyed = table.compact[rule] & (flags & FLAG_HAS_KEY != 0)
    # Not a key, but the shuffle partitions by it: the position spreads these rows
    # over every partition instead of piling them all into one.
    gone = ~keyed & table.known[rule] & (stored < table.retention_cutoff[rule]) & eligible
    state = np.full(len(position), GOES_IF_SUPERSEDED if eligible else SUPERSEDES_ONLY)
    if eligible:
        expired = (body_length == 0) & (stored < table.tombstone_cutoff[rule])
        state[keyed & expired] = GOES_KEYED
    digest = xxhash.xxh3_128_digest
    with_key = np.flatnonzero(keyed)
    key_at = topic_at + topic_length + tag_length
    hashes = b"".join(
        [
            digest(topics[i] + b"\0" + buf[k : k + n])
            for i, k, n in zip(
                with_key.tolist(),
                key_at[with_key].tolist(),
                key_length[with_key].tolist(),
                strict=True,
            )
        ]
    )
    pairs = np.frombuffer(hashes, ">i8").reshape(-1, 2)
    dropped = np.flatnonzero(gone)
    rows = np.empty(len(with_key) + len(dropped), ROW)
    rows["hi"][: len(with_key)] = pairs[:, 0]
    rows["lo"][: len(with_key)] = pairs[:, 1]
    rows["hi"][len(with_key) :] = position[dropped]
    rows["lo"][len(with_key) :] = position[dropped]
    taken = np.concatenate((with_key, dropped))
    rows["position"] = position[taken]
    rows["size_state"] = frame_size[taken] * _STATES + np.where(
        np.arange(len(taken)) < len(with_key), state[taken], GONE
    )
    return rows


def superseded_rows(hi: np.ndarray, lo: np.ndarray, position: np.ndarray) -> np.ndarray:
    """For each row, whether a row with its key (``hi``, ``lo``) has a larger position.

    Sorted by ``hi`` alone: a 64-bit sort, an order of magnitude faster than sorting
    by (hi, lo, position) (the sorts alone: 40 against 473 ms for 1 M rows; the whole
    of RemovedRows: 183 against 676 ms), and the rows of
    one key are then runs of equal ``hi``. Only if two keys share ``hi`` (about n²/2⁶⁵
    for n keys) does a run hold distinct ``lo``, and then the rows are sorted by both.
    Within a run, the key's newest position is its maximum: the position needs no sort.
    """
    if len(hi) == 0:
        return np.zeros(0, np.bool_)
    order = np.argsort(hi)
    sorted_hi, sorted_lo = hi[order], lo[order]
    same_hi = sorted_hi[1:] == sorted_hi[:-1]
    if not np.array_equal(same_hi, same_hi & (sorted_lo[1:] == sorted_lo[:-1])):
        order = np.lexsort((lo, hi))
        sorted_hi, sorted_lo = hi[order], lo[order]
        same_hi = sorted_hi[1:] == sorted_hi[:-1]
    same_key = same_hi & (sorted_lo[1:] == sorted_lo[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~same_key)))
    sorted_position = position[order]
    newest = np.maximum.reduceat(sorted_position, starts)
    run = np.cumsum(np.concatenate(([True], ~same_key))) - 1
    superseded = np.empty(len(hi), np.bool_)
    superseded[order] = sorted_position < newest[run]
    return superseded


# A step-2 summary row: what goes from one chunk file, as found in one partition of
# key hashes.
SUMMARY: Final = np.dtype([("number", "<i8"), ("count", "<i8"), ("size", "<i8")])

# A conditional tombstone: the newest record of its key, expired, with older records of
# its key in the file starting at chunk ``older`` (a row per such file). It goes only if
# every such file is rewritten (plan.settle_tombstones): were one left alone, the older
# value it keeps would become the key's final value again.
CONDITIONAL: Final = np.dtype([("position", "<i8"), ("size", "<i8"), ("older", "<i8")])


def conditional_tombstones(
    hi: np.ndarray, lo: np.ndarray, candidates: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """For the rows ``candidates`` (each its key's newest row), the pairs (candidate row,
    other row of its key) as two index arrays."""
    order = np.lexsort((lo, hi))
    sorted_hi, sorted_lo = hi[order], lo[order]
    new_key = np.concatenate(
        ([True], (sorted_hi[1:] != sorted_hi[:-1]) | (sorted_lo[1:] != sorted_lo[:-1]))
    )
    group = np.empty(len(hi), np.int64)
    group[order] = np.cumsum(new_key) - 1
    owner = np.full(int(group.max()) + 1, -1, np.int64)
    owner[group[candidates]] = candidates
    row_owner = owner[group]
    older = np.flatnonzero((row_owner >= 0) & (row_owner != np.arange(len(hi))))
    return row_owner[older], older


@dataclass(frozen=True, slots=True)
class RemovedRows:
    """The step-2 function, over one partition of the scanned rows hashed by key
    (every row of a key in the same partition). ``starts`` are the chunk files' start
    numbers, ascending; ``partitionBy(len(starts) + 2, shuffle_partition)`` of its pairs
    gives one partition per chunk file, in that order, of (i, positions that go from
    file i, packed ``<i8``, ascending), a partition of (len(starts), packed ``SUMMARY``
    rows: per file with a row that goes, how many and their frame bytes), and a last one
    of (len(starts) + 1, packed ``CONDITIONAL`` rows). A conditional tombstone's position
    is among its file's positions but not in the summary: the driver decides whether it
    goes (plan.settle_tombstones) and tells pass 2 which of them stay.
    So the positions reach the rewrite of their chunk through this one shuffle, and the
    driver plans from the last two partitions alone."""

    starts: Sequence[int]
    chunk_data_size: int

    def __call__(self, pairs: Iterable[tuple[int, bytes]]) -> Iterator[tuple[int, bytes]]:
        rows = np.frombuffer(b"".join(blob for _, blob in pairs), ROW)
        if len(rows) == 0:
            return
        hi, lo, position = rows["hi"], rows["lo"], rows["position"]
        state = rows["size_state"] % _STATES
        superseded = np.zeros(len(state), np.bool_)
        keyed = np.flatnonzero(state < GONE)
        superseded[keyed] = superseded_rows(hi[keyed], lo[keyed], position[keyed])
        goes = np.flatnonzero((state >= GOES_KEYED) | ((state == GOES_IF_SUPERSEDED) & superseded))
        if len(goes) == 0:
            return
        starts = np.asarray(self.starts, np.int64)
        conditional = np.zeros(len(rows), np.bool_)
        candidates = np.flatnonzero((state[keyed] == GOES_KEYED) & ~superseded[keyed])
        if len(candidates):
            tombstone, older = conditional_tombstones(hi[keyed], lo[keyed], candidates)
            if len(tombstone):
                tombstone, older = keyed[tombstone], keyed[older]
                conditional[tombstone] = True
                pending = np.empty(len(tombstone), CONDITIONAL)
                pending["position"] = position[tombstone]
                pending["size"] = rows["size_state"][tombstone] // _STATES
                files = np.searchsorted(starts, position[older] // self.chunk_data_size, "right")
                pending["older"] = starts[files - 1]
                yield len(starts) + 1, np.unique(pending).tobytes()
        ascending = goes[np.argsort(position[goes])]
        gone = position[ascending]
        files = np.searchsorted(starts, gone // self.chunk_data_size, "right") - 1
        bounds = np.flatnonzero(np.diff(files)) + 1
        firsts = np.concatenate(([0], bounds))
        lasts = np.concatenate((bounds, [len(gone)]))
        for first, last in zip(firsts.tolist(), lasts.tolist(), strict=True):
            yield int(files[first]), gone[first:last].tobytes()
        settled = ~conditional[ascending]
        if settled.any():
            files, sizes = files[settled], rows["size_state"][ascending[settled]] // _STATES
            bounds = np.flatnonzero(np.diff(files)) + 1
            firsts = np.concatenate(([0], bounds))
            summary = np.empty(len(firsts), SUMMARY)
            summary["number"] = starts[files[firsts]]
            summary["count"] = np.diff(np.concatenate((firsts, [len(files)])))
            summary["size"] = np.add.reduceat(sizes, firsts)
            yield len(starts), summary.tobytes()
