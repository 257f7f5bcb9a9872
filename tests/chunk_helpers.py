"""Shared helpers for the chunk engine tests (not a test module)."""

from __future__ import annotations

import os
import random
from collections.abc import Iterable
from pathlib import Path

from store_helpers import snapshot as store_snapshot

from equeue.chunks import ChunkManager, ChunkManagerConfig, ChunkReader, ChunkWriter
from equeue.format.chunk import (
    FOOTER_SIZE,
    FRAME_OVERHEAD,
    HEADER_SIZE,
    chunk_file_size,
    parse_chunk_file_name,
)

SMALL = 4096  # the smallest chunk_data_size the config allows

Record = tuple[int, bytes]


def make_config(
    chunk_data_size: int = SMALL,
    *,
    record_size: int = 0,
    max_record_size: int | None = None,
    sync_flush: bool = False,
    timestamp_offset: int | None = None,
    max_open_chunks: int = 8,
) -> ChunkManagerConfig:
    """A small configuration; by default a record may fill a whole chunk."""
    return ChunkManagerConfig(
        chunk_data_size=chunk_data_size,
        record_size=record_size,
        max_record_size=chunk_data_size if max_record_size is None else max_record_size,
        sync_flush=sync_flush,
        timestamp_offset=timestamp_offset,
        max_open_chunks=max_open_chunks,
    )


def payload(seed: int, size: int) -> bytes:
    """Deterministic pseudo-random bytes; never all zero (the first byte is non-zero)."""
    data = bytearray(random.Random(seed).randbytes(size))
    data[0] = seed % 255 + 1
    return bytes(data)


def frame_size(record: bytes) -> int:
    return len(record) + FRAME_OVERHEAD


def write_all(writer: ChunkWriter, records: Iterable[bytes]) -> list[Record]:
    return [(writer.write(record), record) for record in records]


def read_all(manager: ChunkManager, position: int = 0) -> list[Record]:
    return list(ChunkReader(manager).iter_from(position))


def chunk_files(directory: Path) -> list[Path]:
    """The chunk files of a directory, in chunk-number order."""
    found = []
    for name in os.listdir(directory):
        parsed = parse_chunk_file_name(name)
        if parsed is not None:
            found.append((parsed, directory / name))
    return [path for _, path in sorted(found)]


def snapshot(directory: Path) -> dict[str, bytes | None]:
    """Every file (bytes) and directory (None) under ``directory``, by relative path, once
    the chunk maker has settled (store_helpers.snapshot; nothing skipped)."""
    return store_snapshot(directory, skip=())


def full_size(chunk_data_size: int = SMALL) -> int:
    return chunk_file_size(chunk_data_size)


def footer_offset(chunk_data_size: int = SMALL) -> int:
    return chunk_file_size(chunk_data_size) - FOOTER_SIZE


def data_offset(local: int) -> int:
    """File offset of chunk-relative data offset ``local``."""
    return HEADER_SIZE + local


def flip_byte(path: Path, offset: int, mask: int = 0xFF) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        (old,) = f.read(1)
        f.seek(offset)
        f.write(bytes([old ^ mask]))


def overwrite(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
