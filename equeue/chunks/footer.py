"""Reading a chunk file's footer at open, with the checks a completed chunk must pass."""

from __future__ import annotations

from pathlib import Path

from equeue.errors import CorruptionError, TruncatedError
from equeue.format.chunk import FOOTER_SIZE, HEADER_SIZE, ChunkFooter, ChunkHeader, chunk_file_size
from equeue.safepath import open_file


def read_footer(path: Path, header: ChunkHeader, size: int, *, last: bool) -> ChunkFooter | None:
    """The footer of a completed chunk; None for the ongoing (last) chunk."""
    full = chunk_file_size(header.chunk_data_size)
    if size < HEADER_SIZE + FOOTER_SIZE or (not header.compacted and size != full):
        if last and not header.compacted:
            return None  # a short last chunk: scanned and extended by recovery
        raise TruncatedError(f"chunk file is {size} bytes, expected {full}", file=path, offset=size)
    at = size - FOOTER_SIZE
    with open_file(path, "rb") as f:
        f.seek(at)
        raw = f.read(FOOTER_SIZE)
    if last and ChunkFooter.is_blank(raw):
        return None
    try:
        footer = ChunkFooter.unpack(raw, file=str(path), offset=at)
        if not footer.completed:
            raise CorruptionError("footer without the completed flag", file=path, offset=at)
    except CorruptionError:
        if last and not header.compacted:
            return None  # torn footer on the last chunk: recovery cuts it and rescans
        raise
    if footer.physical_data_size > header.chunk_data_size * (
        header.chunk_end_number - header.chunk_start_number + 1
    ):
        raise CorruptionError(
            f"footer physical data size {footer.physical_data_size} exceeds the data area",
            file=path,
            offset=at + 8,
        )
    return footer
