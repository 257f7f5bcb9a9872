"""Pass 1 of compaction on the executors: which records go.

Two ``mapInArrow`` steps with one shuffle between them, nothing else:

1. ``ChunkScan``, one task per chunk file: streams the chunk (metadata only)
   and settles what the chunk alone can settle, with the topic policies it
   carries: a keyless message, or any message of a "delete" topic, goes or
   stays by retention, and only those that go are sent on; an expired
   tombstone goes. Every keyed message of a compacted topic is sent on, as a
   128-bit key hash, its position and a state, for the second step.
2. ``RemovedRows``, one task per partition of key hashes: sorts the
   partition's keyed rows by (key, position) and marks every row followed by
   one with the same key as superseded. The newest message of a key can be in
   any chunk read, the ongoing one included, so only this step sees enough.

Each step's Python work is a loop over records (step 1) or a few numpy
operations over columns (step 2); Spark moves only these small rows, never a
message body, and runs no join, window or sort of its own.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import pyarrow as pa
import xxhash

from equeue.chunks.stream import ChunkFile
from equeue.format.chunk import FRAME_OVERHEAD
from equeue.format.message import FLAG_HAS_KEY, MESSAGE_HEAD, MESSAGE_HEAD_SIZE

# size_state: the frame size times 4 plus the state; with the chunk left out (step 2
# finds it from the position), every row crosses the shuffle as four longs.
SCAN_SCHEMA: Final = "hi long, lo long, position long, size_state long"
REMOVED_SCHEMA: Final = "chunk long, position long, size int"

# The state of a scanned row. Keyed rows (below GONE) take part in deciding the
# newest message of their key, wherever they are; only eligible ones can go.
SUPERSEDES_ONLY: Final = 0  # keyed, in a chunk that is not rewritten
GOES_IF_SUPERSEDED: Final = 1  # keyed, in an eligible chunk
GOES_KEYED: Final = 2  # keyed, in an eligible chunk, an expired tombstone: goes anyway
GONE: Final = 3  # not a key of a compacted topic, past retention, in an eligible chunk

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
    """The ``mapInArrow`` function of step 1, over ``spark.range(len(chunks))`` with one
    row per partition: row i scans ``chunks[i]``. The listing and the rules travel
    with the function, so Spark plans no Python-made DataFrame and no join."""

    chunks: Sequence[ScanChunk]
    rules: dict[str, TopicRule]

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        rules = {topic.encode(): rule for topic, rule in self.rules.items()}
        for batch in batches:
            for index in batch.column(0).to_pylist():
                yield from scan_chunk(self.chunks[index], rules)


def scan_chunk(chunk: ScanChunk, rules: dict[bytes, TopicRule]) -> Iterator[pa.RecordBatch]:
    """Step 1 for one chunk file: batches of ``SCAN_SCHEMA`` rows."""
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
            yield _scan_batch(hashes, positions, sizes, states)
            hashes, positions, sizes, states = bytearray(), [], [], []
    if positions:
        yield _scan_batch(hashes, positions, sizes, states)


def _scan_batch(
    hashes: bytearray, positions: list[int], sizes: list[int], states: list[int]
) -> pa.RecordBatch:
    pairs = np.frombuffer(hashes, ">i8").reshape(-1, 2).astype(np.int64)
    size_state = np.array(sizes, np.int64) * _STATES + np.array(states, np.int64)
    return pa.RecordBatch.from_arrays(
        [
            pa.array(pairs[:, 0]),
            pa.array(pairs[:, 1]),
            pa.array(positions, pa.int64()),
            pa.array(size_state),
        ],
        schema=_SCAN_ARROW,
    )


_STATES: Final = 4


@dataclass(frozen=True, slots=True)
class RemovedRows:
    """The ``mapInArrow`` function of step 2, over one partition of the scanned rows
    hashed by key (every row of a key in the same partition): the rows that go, as
    ``REMOVED_SCHEMA``. ``starts`` are the chunk files' start numbers, ascending."""

    starts: Sequence[int]
    chunk_data_size: int

    def __call__(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        table = pa.Table.from_batches(list(batches), schema=_SCAN_ARROW)
        if table.num_rows == 0:
            return
        hi, lo, position, size_state = (c.to_numpy() for c in table.columns)
        state = size_state % _STATES
        keyed = np.flatnonzero(state < GONE)
        order = keyed[np.lexsort((position[keyed], lo[keyed], hi[keyed]))]
        # Sorted by (key, position): a row is superseded when the next one has its key.
        superseded = np.zeros(len(state), np.bool_)
        superseded[order[:-1]] = (hi[order[:-1]] == hi[order[1:]]) & (
            lo[order[:-1]] == lo[order[1:]]
        )
        goes = np.flatnonzero((state >= GOES_KEYED) | ((state == GOES_IF_SUPERSEDED) & superseded))
        # A file covers the chunk numbers from its start to the next file's start.
        starts = np.asarray(self.starts, np.int64)
        for first in range(0, len(goes), BATCH_ROWS):
            rows = goes[first : first + BATCH_ROWS]
            number = position[rows] // self.chunk_data_size
            yield pa.RecordBatch.from_arrays(
                [
                    pa.array(starts[np.searchsorted(starts, number, "right") - 1]),
                    pa.array(position[rows]),
                    pa.array((size_state[rows] // _STATES).astype(np.int32)),
                ],
                schema=_REMOVED_ARROW,
            )


def _arrow_schema(ddl: str) -> pa.Schema:
    types = {"long": pa.int64(), "int": pa.int32()}
    return pa.schema([(name, types[kind]) for name, kind in (f.split() for f in ddl.split(", "))])


_SCAN_ARROW: Final = _arrow_schema(SCAN_SCHEMA)
_REMOVED_ARROW: Final = _arrow_schema(REMOVED_SCHEMA)
