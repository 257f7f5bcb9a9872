"""Pass 1 of compaction on the executors: which records go.

Two Python steps over Spark RDDs with one shuffle between them, nothing else:

1. ``ChunkScan``, one task per chunk file: streams the chunk (metadata only)
   and settles what the chunk alone can settle, with the topic policies it
   carries: a keyless message, or any message of a "delete" topic, goes or
   stays by retention, and only those that go are sent on; an expired
   tombstone goes. Every keyed message of a compacted topic is sent on, as a
   128-bit key hash, its position and a state, for the second step. The task
   hashes its rows into the shuffle's partitions itself and hands Spark one
   packed block of rows (``ROW``) per partition and batch: the JVM moves
   opaque bytes, never converts a row.
2. ``RemovedRows``, one task per partition of key hashes: sorts the
   partition's keyed rows by (key, position) and marks every row followed by
   one with the same key as superseded. The newest message of a key can be in
   any chunk read, the ongoing one included, so only this step sees enough. It
   hands back, per chunk file, how many records go, their frame bytes and
   their positions (packed, ascending).

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

from equeue.chunks.stream import ChunkFile
from equeue.format.chunk import FRAME_OVERHEAD
from equeue.format.message import FLAG_HAS_KEY, MESSAGE_HEAD, MESSAGE_HEAD_SIZE

# A scanned row: the key hash as two signed longs (its 16 big-endian bytes), the
# record's position, and size_state: the frame size times 4 plus the state.
ROW: Final = np.dtype([("hi", "<i8"), ("lo", "<i8"), ("position", "<i8"), ("size_state", "<i8")])

# The state of a scanned row. Keyed rows (below GONE) take part in deciding the
# newest message of their key, wherever they are; only eligible ones can go.
SUPERSEDES_ONLY: Final = 0  # keyed, in a chunk that is not rewritten
GOES_IF_SUPERSEDED: Final = 1  # keyed, in an eligible chunk
GOES_KEYED: Final = 2  # keyed, in an eligible chunk, an expired tombstone: goes anyway
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
class Removed:
    """What step 2 found to go in one chunk file, from one partition of key hashes."""

    count: int
    size: int  # frame bytes
    positions: bytes  # little-endian int64, ascending


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
            for rows in scan_chunk(self.chunks[index], rules):
                yield from split_rows(rows, self.partitions)


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
    """Step 1 for one chunk file: arrays of ``ROW`` rows, up to BATCH_ROWS each."""
    unpack = MESSAGE_HEAD.unpack_from
    digest = xxhash.xxh3_128_digest
    eligible = chunk.eligible
    keyed_state = GOES_IF_SUPERSEDED if eligible else SUPERSEDES_ONLY
    # Key hashes are appended as their 16 canonical (big-endian) bytes and read back
    # as two signed longs at the end: no per-record integer arithmetic.
    hashes = bytearray()
    positions: list[int] = []
    sizes: list[int] = []
    states: list[int] = []
    for _, payload in ChunkFile.open(chunk.path, chunk.data_end).records():
        (pos, stored, _, _, _, _, _, flags, tl, gl, kl, _, bl) = unpack(payload)
        topic = payload[MESSAGE_HEAD_SIZE : MESSAGE_HEAD_SIZE + tl]
        rule = rules.get(topic)
        if rule is None:
            continue  # a topic without a policy keeps everything, and its keys are its own
        if rule.compact and flags & FLAG_HAS_KEY:
            k = MESSAGE_HEAD_SIZE + tl + gl
            hashes += digest(topic + b"\0" + payload[k : k + kl])
            state = keyed_state
            if eligible and bl == 0 and stored < rule.tombstone_cutoff:
                state = GOES_KEYED
        elif eligible and rule.retention_cutoff is not None and stored < rule.retention_cutoff:
            # Not a key, but the shuffle partitions by it: the position spreads these
            # rows over every partition instead of piling them all into one.
            hashes += pos.to_bytes(8, "big", signed=True) * 2
            state = GONE
        else:
            continue
        positions.append(pos)
        sizes.append(len(payload) + FRAME_OVERHEAD)
        states.append(state)
        if len(positions) == BATCH_ROWS:
            yield _rows(hashes, positions, sizes, states)
            hashes, positions, sizes, states = bytearray(), [], [], []
    if positions:
        yield _rows(hashes, positions, sizes, states)


def _rows(
    hashes: bytearray, positions: list[int], sizes: list[int], states: list[int]
) -> np.ndarray:
    pairs = np.frombuffer(hashes, ">i8").reshape(-1, 2)
    rows = np.empty(len(positions), ROW)
    rows["hi"] = pairs[:, 0]
    rows["lo"] = pairs[:, 1]
    rows["position"] = positions
    rows["size_state"] = np.array(sizes, np.int64) * _STATES + np.array(states, np.int64)
    return rows


@dataclass(frozen=True, slots=True)
class RemovedRows:
    """The step-2 function, over one partition of the scanned rows hashed by key
    (every row of a key in the same partition): (chunk file start number, ``Removed``)
    for every chunk file with a row that goes. ``starts`` are the chunk files' start
    numbers, ascending."""

    starts: Sequence[int]
    chunk_data_size: int

    def __call__(self, pairs: Iterable[tuple[int, bytes]]) -> Iterator[tuple[int, Removed]]:
        rows = np.frombuffer(b"".join(blob for _, blob in pairs), ROW)
        if len(rows) == 0:
            return
        hi, lo, position = rows["hi"], rows["lo"], rows["position"]
        state = rows["size_state"] % _STATES
        keyed = np.flatnonzero(state < GONE)
        order = keyed[np.lexsort((position[keyed], lo[keyed], hi[keyed]))]
        # Sorted by (key, position): a row is superseded when the next one has its key.
        superseded = np.zeros(len(state), np.bool_)
        superseded[order[:-1]] = (hi[order[:-1]] == hi[order[1:]]) & (
            lo[order[:-1]] == lo[order[1:]]
        )
        goes = np.flatnonzero((state >= GOES_KEYED) | ((state == GOES_IF_SUPERSEDED) & superseded))
        if len(goes) == 0:
            return
        gone = np.sort(position[goes])  # positions are unique: their rows follow
        sizes = rows["size_state"][goes][np.argsort(position[goes])] // _STATES
        # A file covers the chunk numbers from its start to the next file's start.
        starts = np.asarray(self.starts, np.int64)
        files = starts[np.searchsorted(starts, gone // self.chunk_data_size, "right") - 1]
        bounds = np.flatnonzero(np.diff(files)) + 1
        for first, last in zip(
            np.concatenate(([0], bounds)), np.concatenate((bounds, [len(gone)])), strict=True
        ):
            yield (
                int(files[first]),
                Removed(
                    int(last - first), int(sizes[first:last].sum()), gone[first:last].tobytes()
                ),
            )
