"""The batch source's Arrow record batches, built a block of frames at a time.

``ChunkFile.frame_blocks`` reads a chunk a block at a time and checks every frame
(lengths, checksum); here the records of a block become column buffers in bulk (the C
accelerator's ``record_columns``/``record_bodies``, or ``record_columns_py``/
``record_bodies_py``, which build the very same bytes) and pyarrow wraps them with
``pa.Array.from_buffers``, copying nothing further. Bodies are gathered only when the
``body`` column is wanted, and only for the rows a pushed filter keeps; properties are
decoded (in Python) only for records that have some. One batch per block keeps memory
at a block and its columns, whatever the chunk's size.
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Final

import numpy as np
import pyarrow as pa

from equeue import speedups
from equeue.chunks.stream import ChunkFile
from equeue.errors import CorruptionError, CorruptRecordError
from equeue.format.chunk import FRAME_PREFIX, FRAME_PREFIX_SIZE, HEADER_SIZE
from equeue.format.message import (
    FLAG_HAS_KEY,
    MESSAGE_HEAD,
    MESSAGE_HEAD_SIZE,
    decode_properties,
    message_id_prefix,
)

_UTC_US: Final = pa.timestamp("us", tz="UTC")
MESSAGE_FIELDS: Final = pa.schema(
    [
        ("topic", pa.string()),
        ("queue_id", pa.int32()),
        ("queue_offset", pa.int64()),
        ("position", pa.int64()),
        ("message_id", pa.string()),
        ("tag", pa.string()),
        ("key", pa.string()),
        ("properties", pa.map_(pa.string(), pa.string())),
        ("body", pa.binary()),
        ("created_at", _UTC_US),
        ("stored_at", _UTC_US),
    ]
)
COLUMN_NAMES: Final = tuple(MESSAGE_FIELDS.names)
SPARK_TYPES: Final = {
    "topic": "string",
    "queue_id": "int",
    "queue_offset": "long",
    "position": "long",
    "message_id": "string",
    "tag": "string",
    "key": "string",
    "properties": "map<string,string>",
    "body": "binary",
    "created_at": "timestamp",
    "stored_at": "timestamp",
}
RowFilter = Callable[[Mapping[str, pa.Array]], pa.Array]


def spark_schema(columns: Sequence[str]) -> str:
    return ", ".join(f"{name} {SPARK_TYPES[name]}" for name in columns)


def arrow_schema(columns: Sequence[str]) -> pa.Schema:
    return pa.schema([MESSAGE_FIELDS.field(name) for name in columns])


# --- the column buffers, in Python (where the C accelerator is not used) --------------

_I64: Final = struct.Struct("<q")
_U64: Final = (1 << 64) - 1  # as C formats a position: its 64 bits, unsigned


def adds_up(buf: bytes, offset: int) -> tuple[Any, ...] | None:
    """The message head of the frame at ``offset`` of ``buf`` if its lengths (head,
    topic, tag, key, properties, body) add up to the frame's payload length within
    ``buf``, else None: the check record_columns makes in C (arrowcols.c)."""
    if offset < 0 or offset > len(buf) - FRAME_PREFIX_SIZE - MESSAGE_HEAD_SIZE:
        return None
    (n,) = FRAME_PREFIX.unpack_from(buf, offset)
    start = offset + FRAME_PREFIX_SIZE
    if n > len(buf) - start or n < MESSAGE_HEAD_SIZE:
        return None
    head = MESSAGE_HEAD.unpack_from(buf, start)
    return head if MESSAGE_HEAD_SIZE + sum(head[8:13]) == n else None


def _heads(buf: bytes, offsets: bytes) -> Iterator[tuple[int, tuple[Any, ...]]]:
    """(payload start, head fields) of each frame whose lengths add up, up to the first
    one that does not (record_columns's ``done``)."""
    for (offset,) in struct.iter_unpack("<q", offsets):
        head = adds_up(buf, offset)
        if head is None:
            return
        yield offset + FRAME_PREFIX_SIZE, head


def record_columns_py(buf: bytes, offsets: bytes, id_prefix: str) -> tuple[Any, ...]:
    """``equeue._speedups.record_columns`` in Python: the same bytes."""
    qid, qoff, pos, created, stored = (array(t) for t in "iqqqq")
    names: list[tuple[array[int], bytearray]] = [(array("i", [0]), bytearray()) for _ in "tgk"]
    valid = bytearray()
    ids = bytearray()
    props = array("q")
    done = 0
    for start, head in _heads(buf, offsets):
        (position, st, cr, q_off, q_id, _, _, flags, tl, gl, kl, pl, _) = head
        qid.append(q_id)
        qoff.append(q_off)
        pos.append(position)
        created.append(cr // 1000)  # ns to µs, floored as Python floors
        stored.append(st // 1000)
        s = start + MESSAGE_HEAD_SIZE
        has_key = flags & FLAG_HAS_KEY
        for (offs, data), length, present in zip(names, (tl, gl, kl), (1, 1, has_key), strict=True):
            if present:
                data += buf[s : s + length]
            offs.append(len(data))
            s += length
        if done % 8 == 0:
            valid.append(0)
        if has_key:
            valid[-1] |= 1 << (done % 8)
        ids += f"{id_prefix}{position & _U64:016x}".encode()
        if pl:
            props.extend((done, s, pl))
        done += 1
    (to, td), (go, gd), (ko, kd) = names
    return (
        done,
        *(a.tobytes() for a in (qid, qoff, pos, created, stored, to)),
        bytes(td),
        go.tobytes(),
        bytes(gd),
        ko.tobytes(),
        bytes(kd),
        bytes(valid),
        bytes(ids),
        props.tobytes(),
    )


def record_bodies_py(buf: bytes, offsets: bytes) -> tuple[int, bytes, bytes]:
    """``equeue._speedups.record_bodies`` in Python: the same bytes."""
    ends = array("i", [0])
    parts: list[bytes] = []
    total = 0
    for start, head in _heads(buf, offsets):
        bl = head[12]
        if total + bl > 0x7FFFFFFF:
            break
        end = start + MESSAGE_HEAD_SIZE + sum(head[8:13])
        parts.append(buf[end - bl : end])
        total += bl
        ends.append(total)
    return len(ends) - 1, ends.tobytes(), b"".join(parts)


# --- Arrow arrays from the buffers ----------------------------------------------------


def _fixed(kind: pa.DataType, n: int, data: bytes) -> pa.Array:
    return pa.Array.from_buffers(kind, n, [None, pa.py_buffer(data)])


def _var(
    kind: pa.DataType, n: int, offsets: bytes, data: bytes, valid: bytes | None = None
) -> pa.Array:
    bitmap = None if valid is None else pa.py_buffer(valid)
    return pa.Array.from_buffers(kind, n, [bitmap, pa.py_buffer(offsets), pa.py_buffer(data)])


def head_arrays(
    buf: bytes, offsets: bytes, store_id: int, chunk: ChunkFile, at: int
) -> dict[str, pa.Array]:
    """Every column but body and properties for the frames at ``offsets`` (of ``buf``,
    which holds data from data offset ``at``), and "_props": the (row, start, length)
    triples of the records with properties. Raises CorruptionError naming the record
    whose lengths do not add up, or a string that is not UTF-8."""
    prefix = message_id_prefix(store_id)
    fast = speedups.SPEEDUPS
    build = record_columns_py if fast is None else fast.record_columns
    (done, qid, qoff, pos, created, stored, to, td, go, gd, ko, kd, kv, ids, props) = build(
        buf, offsets, prefix
    )
    n = len(offsets) // 8
    if done < n:
        (offset,) = _I64.unpack_from(offsets, done * 8)
        raise CorruptRecordError(
            "message record lengths do not add up to the record size",
            file=chunk.path,
            offset=HEADER_SIZE + at + offset,
        )
    columns = {
        "topic": _var(pa.string(), n, to, td),
        "queue_id": _fixed(pa.int32(), n, qid),
        "queue_offset": _fixed(pa.int64(), n, qoff),
        "position": _fixed(pa.int64(), n, pos),
        "message_id": _var(pa.string(), n, array("i", range(0, 24 * n + 1, 24)).tobytes(), ids),
        "tag": _var(pa.string(), n, go, gd),
        "key": _var(pa.string(), n, ko, kd, kv),
        "created_at": _fixed(_UTC_US, n, created),
        "stored_at": _fixed(_UTC_US, n, stored),
        "_props": pa.array(np.frombuffer(props, np.int64)),
    }
    for name in ("topic", "tag", "key"):
        try:
            columns[name].validate(full=True)
        except pa.ArrowInvalid as exc:  # UTF-8: the writer checks it; a bug or a forgery
            raise CorruptionError(
                f"a message {name} in this block is not UTF-8 ({exc})",
                file=chunk.path,
                offset=HEADER_SIZE + at,
            ) from None
    return columns


def properties_array(
    buf: bytes, props: np.ndarray[Any, Any], n: int, chunk: ChunkFile, at: int
) -> pa.Array:
    """The properties map of ``n`` rows from the (row, start, length) triples of the rows
    that have any (the others get an empty map, as before)."""
    counts = np.zeros(n + 1, np.int32)
    keys: list[str] = []
    values: list[str] = []
    for row, start, length in props.reshape(-1, 3).tolist():
        try:
            decoded = decode_properties(buf[start : start + length])
        except CorruptionError as exc:
            raise CorruptionError(
                str(exc), file=chunk.path, offset=HEADER_SIZE + at + start
            ) from None
        counts[row + 1] = len(decoded)
        keys += decoded.keys()
        values += decoded.values()
    return pa.MapArray.from_arrays(
        pa.array(np.cumsum(counts, dtype=np.int32)),
        pa.array(keys, pa.string()),
        pa.array(values, pa.string()),
    )


def block_batch(
    buf: bytes,
    offsets: bytes,
    at: int,
    chunk: ChunkFile,
    store_id: int,
    columns: Sequence[str],
    keep: RowFilter | None = None,
) -> pa.RecordBatch | None:
    """The record batch of the frames at ``offsets``: ``columns`` only, the rows ``keep``
    (a pushed filter) lets through; None if it lets none through."""
    heads = head_arrays(buf, offsets, store_id, chunk, at)
    n = len(offsets) // 8
    props = heads.pop("_props").to_numpy().reshape(-1, 3)
    if keep is not None:
        mask = keep(heads).to_numpy(zero_copy_only=False)
        if not mask.any():
            return None
        if not mask.all():
            chosen = np.flatnonzero(mask)
            offsets = np.frombuffer(offsets, np.int64)[chosen].tobytes()
            heads = {name: heads[name].take(pa.array(chosen)) for name in heads}
            if len(props):
                rows = np.searchsorted(chosen, props[:, 0])
                found = (rows < len(chosen)) & (
                    chosen[np.minimum(rows, len(chosen) - 1)] == props[:, 0]
                )
                props = props[found].copy()
                props[:, 0] = rows[found]
            n = len(chosen)
    arrays: list[pa.Array] = []
    for name in columns:
        if name == "body":
            fast = speedups.SPEEDUPS
            gather = record_bodies_py if fast is None else fast.record_bodies
            done, bo, bd = gather(buf, offsets)
            if done < n:  # checked by head_arrays already: a block over 2 GiB of bodies
                raise CorruptionError(
                    "a block's bodies exceed 2 GiB", file=chunk.path, offset=HEADER_SIZE + at
                )
            arrays.append(_var(pa.binary(), n, bo, bd))
        elif name == "properties":
            arrays.append(properties_array(buf, props, n, chunk, at))
        else:
            arrays.append(heads[name])
    return pa.RecordBatch.from_arrays(arrays, schema=arrow_schema(columns))


def chunk_batches(
    chunk: ChunkFile, store_id: int, columns: Sequence[str], keep: RowFilter | None = None
) -> Iterator[pa.RecordBatch]:
    """Every record of the chunk (up to its ``data_end``), a block at a time. A compacted
    chunk's frames are checked against its position map by frame_blocks."""
    for at, buf, offsets, _ in chunk.frame_blocks():
        batch = block_batch(buf, offsets, at, chunk, store_id, columns, keep)
        if batch is not None:
            yield batch
