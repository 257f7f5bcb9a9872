"""``spark.read.format("equeue").load(STORE)``: a store's messages as a DataFrame.

One partition per chunk file, each streamed once by the Python worker
(``ChunkFile.records``: one block of memory, never the whole chunk) and
handed to Spark as Arrow record batches. Options:

- ``fields``: ``"messages"`` (default, the schema below) or ``"meta"``:
  (chunk, position, topic, key hash, stored_ns, tombstone, size), which skips
  decoding bodies and properties.
- ``chunks``: a JSON list of ``[path, data_end]`` to read instead of listing
  the store (the compaction job passes the snapshot it planned with).

Without ``chunks`` the store is opened read-only on the driver, beside a
running writer if there is one; its ongoing chunk is read up to the
committed end seen then.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any, Final

import pyarrow as pa
import xxhash
from pyspark.sql.datasource import DataSourceReader, InputPartition

from equeue.chunks.stream import ChunkFile
from equeue.format.chunk import FRAME_OVERHEAD
from equeue.format.message import (
    FLAG_HAS_KEY,
    MESSAGE_HEAD,
    MESSAGE_HEAD_SIZE,
    decode_properties,
    encode_message_id,
)

MESSAGE_SCHEMA: Final = (
    "topic string, queue_id int, queue_offset long, position long, message_id string, "
    "tag string, key string, properties map<string,string>, body binary, "
    "created_at timestamp, stored_at timestamp"
)
META_SCHEMA: Final = (
    "chunk long, position long, topic string, key_hash_hi long, key_hash_lo long, "
    "stored_ns long, tombstone boolean, size int"
)
BATCH_ROWS: Final = 16_384

_ARROW_MESSAGE: Final = pa.schema(
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
        ("created_at", pa.timestamp("us", tz="UTC")),
        ("stored_at", pa.timestamp("us", tz="UTC")),
    ]
)
_ARROW_META: Final = pa.schema(
    [
        ("chunk", pa.int64()),
        ("position", pa.int64()),
        ("topic", pa.string()),
        ("key_hash_hi", pa.int64()),
        ("key_hash_lo", pa.int64()),
        ("stored_ns", pa.int64()),
        ("tombstone", pa.bool_()),
        ("size", pa.int32()),
    ]
)


class ChunkPartition(InputPartition):
    def __init__(self, path: str, data_end: int, store_id: int) -> None:
        super().__init__(path)
        self.path = path
        self.data_end = data_end
        self.store_id = store_id


def store_snapshot(store: str) -> tuple[int, list[tuple[str, int]]]:
    """(store id, [(chunk path, committed data end)]) as a read-only open sees them now."""
    from equeue.store.store import MessageStore

    with MessageStore.open(store, read_only=True) as opened:
        chunks = [(str(c.path), c.data_end) for c in opened._messages]
        return opened.store_id, chunks


def schema_for(options: dict[str, str]) -> str:
    return META_SCHEMA if options.get("fields") == "meta" else MESSAGE_SCHEMA


class EqueueReader(DataSourceReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.store = options.get("path")
        self.meta = options.get("fields") == "meta"
        fields = options.get("fields", "messages")
        if fields not in ("messages", "meta"):
            raise ValueError(f"option fields={fields!r}: it must be 'messages' or 'meta'")
        self.chunks_json = options.get("chunks")
        self.store_id = int(options.get("store_id", "0"))

    def partitions(self) -> Sequence[InputPartition]:
        if self.chunks_json is not None:
            chunks = [(str(p), int(e)) for p, e in json.loads(self.chunks_json)]
            store_id = self.store_id
        else:
            if not self.store:
                raise ValueError('load(STORE) needs the store directory: .load("/path/to/store")')
            store_id, chunks = store_snapshot(self.store)
        return [ChunkPartition(path, end, store_id) for path, end in chunks]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        assert isinstance(partition, ChunkPartition)
        chunk = ChunkFile.open(partition.path, partition.data_end)
        if self.meta:
            return meta_batches(chunk)
        return message_batches(chunk, partition.store_id)


def meta_batches(chunk: ChunkFile, batch_rows: int = BATCH_ROWS) -> Iterator[pa.RecordBatch]:
    """Pass 1's view of a chunk: what deciding survivors needs, nothing of the bodies.

    A key is carried as the 128-bit xxh3 hash of topic and key (two signed longs, null
    for a keyless message): Spark groups and sorts fixed-width longs far faster than
    strings. Kafka's cleaner likewise compares keys by a 128-bit digest (MD5); two
    distinct keys of one store collide with probability about n**2 / 2**129.
    """
    number = chunk.header.chunk_start_number
    unpack = MESSAGE_HEAD.unpack_from
    key_hash = xxhash.xxh3_128_intdigest
    positions: list[int] = []
    topics: list[str] = []
    his: list[int | None] = []
    los: list[int | None] = []
    stored: list[int] = []
    tombstones: list[bool] = []
    sizes: list[int] = []
    for _, payload in chunk.records():
        (pos, st, _, _, _, _, _, flags, tl, gl, kl, _, bl) = unpack(payload)
        positions.append(pos)
        topic = payload[MESSAGE_HEAD_SIZE : MESSAGE_HEAD_SIZE + tl]
        topics.append(topic.decode())
        stored.append(st)
        sizes.append(len(payload) + FRAME_OVERHEAD)
        if flags & FLAG_HAS_KEY:
            k = MESSAGE_HEAD_SIZE + tl + gl
            digest = key_hash(topic + b"\0" + payload[k : k + kl])
            hi, lo = digest >> 64, digest & _U64
            his.append(hi - _2_64 if hi > _I64_MAX else hi)
            los.append(lo - _2_64 if lo > _I64_MAX else lo)
            tombstones.append(bl == 0)
        else:
            his.append(None)
            los.append(None)
            tombstones.append(False)
        if len(positions) == batch_rows:
            yield _meta_batch(number, positions, topics, his, los, stored, tombstones, sizes)
            positions, topics, his, los, stored, tombstones, sizes = [], [], [], [], [], [], []
    if positions:
        yield _meta_batch(number, positions, topics, his, los, stored, tombstones, sizes)


_U64: Final = (1 << 64) - 1
_2_64: Final = 1 << 64
_I64_MAX: Final = (1 << 63) - 1


def _meta_batch(number: int, *columns: list[Any]) -> pa.RecordBatch:
    fields = list(_ARROW_META)[1:]
    arrays = [pa.array(values, field.type) for values, field in zip(columns, fields, strict=True)]
    return pa.RecordBatch.from_arrays(
        [pa.array([number] * len(columns[0]), pa.int64()), *arrays], schema=_ARROW_META
    )


def message_batches(
    chunk: ChunkFile, store_id: int, batch_rows: int = BATCH_ROWS
) -> Iterator[pa.RecordBatch]:
    unpack = MESSAGE_HEAD.unpack_from
    rows: list[list[Any]] = [[] for _ in _ARROW_MESSAGE]
    count = 0
    for _, payload in chunk.records():
        (pos, st, created, qoff, qid, _, _, flags, tl, gl, kl, pl, _) = unpack(payload)
        p = MESSAGE_HEAD_SIZE
        topic = payload[p : p + tl].decode()
        p += tl
        tag = payload[p : p + gl].decode()
        p += gl
        key = payload[p : p + kl].decode() if flags & FLAG_HAS_KEY else None
        p += kl
        props = list(decode_properties(payload[p : p + pl]).items()) if pl else []
        p += pl
        row = (
            topic,
            qid,
            qoff,
            pos,
            encode_message_id(store_id, pos),
            tag,
            key,
            props,
            payload[p:],
            created // 1000,  # ns to the µs of Spark timestamps
            st // 1000,
        )
        for column, value in zip(rows, row, strict=True):
            column.append(value)
        count += 1
        if count == batch_rows:
            yield _message_batch(rows)
            rows, count = [[] for _ in _ARROW_MESSAGE], 0
    if count:
        yield _message_batch(rows)


def _message_batch(rows: list[list[Any]]) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [pa.array(values, field.type) for values, field in zip(rows, _ARROW_MESSAGE, strict=True)],
        schema=_ARROW_MESSAGE,
    )
