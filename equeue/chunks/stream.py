"""Sequential reads of one chunk file with plain buffered I/O.

For batch work that reads a whole chunk once, typically in another process
than the writer (the compaction job, the Spark data source): memory stays at
one block however large the chunk, where a mapping would leave every page
read counted in the process's resident set. Every frame is checked (lengths
and checksum); anything wrong raises a CorruptionError naming the file and
the offset, never returns bad bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Final

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
        with open(path, "rb") as f:
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
        with open(self.path, "rb", buffering=0) as f:
            frames = _frames(f, self.path, self.data_end, block_size)
            if not self.header.compacted:
                yield from frames
                return
            with open(self.path, "rb", buffering=0) as m:
                entries = _map_entries(m, self.path, HEADER_SIZE + self.data_end, self.map_bytes)
                for physical, payload in frames:
                    entry = next(entries, None)
                    if entry is None or entry[1] != physical:
                        raise CorruptionError(
                            "position map disagrees with the records: no entry for the "
                            f"record at data offset {physical}",
                            file=self.path,
                            offset=HEADER_SIZE + physical,
                        )
                    yield entry[0], payload
                if next(entries, None) is not None:
                    raise CorruptionError(
                        "position map has more entries than the chunk has records",
                        file=self.path,
                        offset=HEADER_SIZE + self.data_end,
                    )


def _frames(f: BinaryIO, path: Path, end: int, block_size: int) -> Iterator[tuple[int, bytes]]:
    """(data offset, payload) of every frame in data[0:end]."""
    f.seek(HEADER_SIZE)
    buf = b""
    pos = 0  # of the next frame in buf
    at = 0  # data offset of buf[0]
    read = 0  # data bytes read so far

    def refill(need: int) -> bytes:
        nonlocal read
        more = min(max(block_size, need), end - read)
        chunk = f.read(more) if more > 0 else b""
        read += len(chunk)
        if len(buf) - pos + len(chunk) < need:
            raise TruncatedError(
                f"short read: the chunk's data should run to offset {end}",
                file=path,
                offset=HEADER_SIZE + at + len(buf) + len(chunk),
            )
        return buf[pos:] + chunk

    while at + pos < end:
        if end - (at + pos) < FRAME_OVERHEAD + 1:
            raise CorruptRecordError(
                f"{end - at - pos} bytes at the end of the data cannot hold a record",
                file=path,
                offset=HEADER_SIZE + at + pos,
            )
        if len(buf) - pos < FRAME_PREFIX_SIZE:
            buf, at, pos = refill(FRAME_PREFIX_SIZE), at + pos, 0
        (n,) = _unpack_prefix(buf, pos)
        size = n + FRAME_OVERHEAD
        if n == 0 or at + pos + size > end:
            raise CorruptRecordError(
                f"record length {n} does not fit the data (ending at {end})",
                file=path,
                offset=HEADER_SIZE + at + pos,
            )
        if len(buf) - pos < size:
            buf, at, pos = refill(size), at + pos, 0
        problem = frame_problem(buf, pos, pos + size, n)
        if problem is not None:
            reason, expected, found = problem
            raise CorruptRecordError(
                reason, file=path, offset=HEADER_SIZE + at + pos, expected=expected, found=found
            )
        yield at + pos, buf[pos + FRAME_PREFIX_SIZE : pos + FRAME_PREFIX_SIZE + n]
        pos += size


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
