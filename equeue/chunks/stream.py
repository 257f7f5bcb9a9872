"""Sequential reads of one chunk file with plain buffered I/O.

For batch work that reads a whole chunk once, typically in another process
than the writer (the compaction job, the Spark data source): memory stays at
one block however large the chunk, where a mapping would leave every page
read counted in the process's resident set. Every frame is checked (lengths
and checksum); anything wrong raises a CorruptionError naming the file and
the offset, never returns bad bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Final

from equeue import speedups
from equeue.errors import CorruptionError, CorruptRecordError, TruncatedError
from equeue.format.chunk import (
    FOOTER_SIZE,
    FRAME_OVERHEAD,
    FRAME_PREFIX,
    FRAME_PREFIX_SIZE,
    HEADER_SIZE,
    MAP_ENTRY,
    MAP_ENTRY_SIZE,
    ChunkFooter,
    ChunkHeader,
    ChunkType,
    frame_problem,
)
from equeue.safepath import open_file

BLOCK_SIZE: Final = 4 << 20
_MAP_BLOCK_ENTRIES: Final = 64 << 10

_unpack_prefix = FRAME_PREFIX.unpack_from


@dataclass(frozen=True, slots=True)
class ChunkFile:
    """A chunk file as found on disk: header, footer (None while ongoing) and how far
    its data goes (the footer's physical size, or a committed end seen by a reader)."""

    path: Path
    header: ChunkHeader
    footer: ChunkFooter | None
    data_end: int

    @classmethod
    def open(cls, path: str | Path, data_end: int | None = None) -> ChunkFile:
        """Read the header and footer. ``data_end`` bounds the records read (a snapshot's
        committed end); an ongoing chunk needs it, since nothing in the file records it."""
        path = Path(path)
        with open_file(path, "rb") as f:
            header = ChunkHeader.unpack(f.read(HEADER_SIZE), file=str(path))
            size = f.seek(0, 2)
            if size < HEADER_SIZE + FOOTER_SIZE:
                raise TruncatedError(
                    f"chunk file of {size} bytes has no room for a footer", file=path, offset=size
                )
            f.seek(size - FOOTER_SIZE)
            raw = f.read(FOOTER_SIZE)
        footer = None
        if not ChunkFooter.is_blank(raw):
            footer = ChunkFooter.unpack(raw, file=str(path), offset=size - FOOTER_SIZE)
        if footer is not None:
            # A reader's committed end from before the writer completed the chunk
            # still bounds what it reads: a snapshot must not grow under its reader.
            if data_end is None or header.compacted:
                data_end = footer.physical_data_size
            data_end = min(data_end, footer.physical_data_size)
        elif data_end is None:
            raise CorruptionError(
                "an ongoing chunk is read only up to a committed end, and none was given",
                file=path,
            )
        if header.chunk_type != ChunkType.VARIABLE:
            raise CorruptionError(
                "only chunks of variable-size records can be streamed", file=path, offset=6
            )
        return cls(path, header, footer, data_end)

    @property
    def compacted(self) -> bool:
        return self.header.compacted

    @property
    def logical_end(self) -> int:
        """Logical bytes covered, relative to the chunk's start position."""
        if self.footer is not None:
            return int(self.footer.logical_data_size)
        return self.data_end

    @property
    def map_bytes(self) -> int:
        if self.footer is None or not self.header.compacted:
            return 0
        return int(self.footer.map_entry_count) * MAP_ENTRY_SIZE

    def records(self, block_size: int = BLOCK_SIZE) -> Iterator[tuple[int, bytes]]:
        """(logical offset relative to the chunk's start, payload) of every record, in order."""
        prefix = _unpack_prefix
        for at, buf, offsets, logicals in self.frame_blocks(block_size):
            physical = _offsets(offsets)
            for offset, logical in zip(
                physical,
                (at + o for o in physical) if logicals is None else _offsets(logicals),
                strict=True,
            ):
                (n,) = prefix(buf, offset)
                start = offset + FRAME_PREFIX_SIZE
                yield logical, buf[start : start + n]

    def frame_blocks(
        self, block_size: int = BLOCK_SIZE
    ) -> Iterator[tuple[int, bytes, bytes, bytes | None]]:
        """The data read a block at a time, every frame checked: (data offset of
        ``buf[0]``, ``buf``, ``offsets``, ``logicals``). ``offsets`` packs (little-endian
        int64) the offset in ``buf`` of each frame this block hands out; every frame of
        the data comes in exactly one block, in order. ``logicals`` packs the same way
        their logical offsets relative to the chunk's start, from the position map of
        a compacted chunk (checked against the frames); None for any other chunk,
        where a frame's logical offset is its data offset."""
        with open_file(self.path, "rb", buffering=0) as f:
            blocks = _frame_blocks(f, self.path, self.data_end, block_size)
            if not self.header.compacted:
                for at, buf, offsets in blocks:
                    yield at, buf, offsets, None
                return
            with open_file(self.path, "rb", buffering=0) as m:
                entries = _map_entries(m, self.path, HEADER_SIZE + self.data_end, self.map_bytes)
                for at, buf, offsets in blocks:
                    logicals = []
                    for offset in _offsets(offsets):
                        entry = next(entries, None)
                        if entry is None or entry[1] != at + offset:
                            raise CorruptionError(
                                "position map disagrees with the records: no entry for the "
                                f"record at data offset {at + offset}",
                                file=self.path,
                                offset=HEADER_SIZE + at + offset,
                            )
                        logicals.append(entry[0])
                    yield at, buf, offsets, struct.pack(f"<{len(logicals)}q", *logicals)
                if next(entries, None) is not None:
                    raise CorruptionError(
                        "position map has more entries than the chunk has records",
                        file=self.path,
                        offset=HEADER_SIZE + self.data_end,
                    )


def _offsets(packed: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(packed) // 8}q", packed)


def frame_offsets(buf: bytes, offset: int, end: int) -> tuple[int, bytes]:
    """What ``equeue._speedups.frame_offsets`` does, in Python (where the C accelerator is
    not used): walk the valid frames of buf[offset:end]; (where the walk stopped, their
    offsets as little-endian int64)."""
    found: list[int] = []
    while offset + FRAME_OVERHEAD + 1 <= end:
        (n,) = _unpack_prefix(buf, offset)
        if n == 0 or offset + FRAME_OVERHEAD + n > end:
            break
        if frame_problem(buf, offset, end, n) is not None:
            break
        found.append(offset)
        offset += n + FRAME_OVERHEAD
    return offset, struct.pack(f"<{len(found)}q", *found)


def _frame_blocks(
    f: BinaryIO, path: Path, end: int, block_size: int
) -> Iterator[tuple[int, bytes, bytes]]:
    """``ChunkFile.frame_blocks`` for data[0:end]: the valid frames are found in C (or by
    ``frame_offsets``); where the walk stops short of the data's end, the frame there
    either needs more data read or is damaged, which the checks below name."""
    fast = speedups.SPEEDUPS
    scan = frame_offsets if fast is None else fast.frame_offsets
    f.seek(HEADER_SIZE)
    buf = b""
    pos = 0  # of the next frame in buf
    at = 0  # data offset of buf[0]
    read = 0  # data bytes read so far
    while True:
        pos, offsets = scan(buf, pos, len(buf))
        if offsets:
            yield at, buf, offsets
        if at + pos >= end:
            return
        if end - (at + pos) < FRAME_OVERHEAD + 1:
            raise CorruptRecordError(
                f"{end - at - pos} bytes at the end of the data cannot hold a record",
                file=path,
                offset=HEADER_SIZE + at + pos,
            )
        need = FRAME_PREFIX_SIZE
        if len(buf) - pos >= FRAME_PREFIX_SIZE:
            (n,) = _unpack_prefix(buf, pos)
            need = n + FRAME_OVERHEAD
            if n == 0 or at + pos + need > end:
                raise CorruptRecordError(
                    f"record length {n} does not fit the data (ending at {end})",
                    file=path,
                    offset=HEADER_SIZE + at + pos,
                )
            if len(buf) - pos >= need:  # whole, yet the walk stopped at it: damaged
                reason, expected, found = frame_problem(buf, pos, pos + need, n) or (
                    "the frame checks in C and in Python disagree",
                    None,
                    None,
                )
                raise CorruptRecordError(
                    reason, file=path, offset=HEADER_SIZE + at + pos, expected=expected, found=found
                )
        more = min(max(block_size, need), end - read)
        chunk = f.read(more) if more > 0 else b""
        read += len(chunk)
        if len(buf) - pos + len(chunk) < need:
            raise TruncatedError(
                f"short read: the chunk's data should run to offset {end}",
                file=path,
                offset=HEADER_SIZE + at + len(buf) + len(chunk),
            )
        buf, at, pos = buf[pos:] + chunk, at + pos, 0


def _map_entries(f: BinaryIO, path: Path, start: int, size: int) -> Iterator[tuple[int, int]]:
    f.seek(start)
    done = 0
    while done < size:
        want = min(size - done, _MAP_BLOCK_ENTRIES * MAP_ENTRY_SIZE)
        block = f.read(want)
        if len(block) != want:
            raise TruncatedError(
                "short read of the position map", file=path, offset=start + done + len(block)
            )
        done += want
        yield from MAP_ENTRY.iter_unpack(block)
