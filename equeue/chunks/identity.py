"""Whether a chunk's file, opened again by its name, is still the file the Chunk was
read from. Chunk names repeat: deleting a topic removes its queue directories, and the
topic made again writes ``chunk-000000000000.0000`` anew. A view that let go of a file's
mapping (the LRU of read maps, the cache of open queues) and opens it again by name
would otherwise read the new topic's entries under the old one's offsets. The header's
chunk id (random, written once when the file is made) tells them apart: 16 bytes read
with the descriptor about to be mapped, so what is checked is what is mapped."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from equeue.errors import ChunkReplacedError, TruncatedError
from equeue.format.chunk import CHUNK_ID_OFFSET, CHUNK_ID_SIZE, ChunkHeader, chunk_file_name
from equeue.safepath import open_fd

if TYPE_CHECKING:
    from equeue.chunks.manager import ChunkManager


def check_identity(fd: int, path: Path, header: ChunkHeader) -> None:
    """ChunkReplacedError unless the file open as ``fd`` holds ``header``'s chunk id."""
    found = os.pread(fd, CHUNK_ID_SIZE, CHUNK_ID_OFFSET)
    if len(found) < CHUNK_ID_SIZE:  # cut inside its header: not another chunk, a short one
        raise TruncatedError(
            f"chunk file is {os.fstat(fd).st_size} bytes, cut inside its header (the chunk id "
            f"at offset {CHUNK_ID_OFFSET} needs {CHUNK_ID_OFFSET + CHUNK_ID_SIZE})",
            file=path,
            offset=CHUNK_ID_OFFSET,
        )
    if found != header.chunk_id.bytes:
        raise replaced(path, header, found)


def check_path_identity(path: Path, header: ChunkHeader) -> None:
    """``check_identity`` of the file now named ``path`` (FileNotFoundError if none)."""
    fd = open_fd(path, os.O_RDONLY)
    try:
        check_identity(fd, path, header)
    finally:
        os.close(fd)


def replaced(path: Path, header: ChunkHeader, found: bytes) -> ChunkReplacedError:
    other = str(uuid.UUID(bytes=found)) if len(found) == CHUNK_ID_SIZE else found.hex()
    return ChunkReplacedError(
        f"the file is not the chunk this handle read: chunk id {other}, not "
        f"{header.chunk_id} (made at {header.created_at_ns} ns); it was deleted and a new "
        "file made under its name (its topic deleted and made again, or replaced from "
        "outside)",
        file=path,
        offset=CHUNK_ID_OFFSET,
    )


def check_same_files(manager: ChunkManager, seen: ChunkHeader, directory: Path) -> None:
    """A view opened again (a new ChunkManager) over a directory it had opened before,
    whose last chunk then was ``seen``: ChunkReplacedError unless these are the same
    files. A directory's files never lose their last chunk (retention keeps it, and
    removes only older ones): so the chunk of ``seen``'s number, if listed, must be
    ``seen``, and a listing that ends before it is other files. One that starts past it
    is retention's doing, or another topic's files grown past it and removed up to it:
    the ids cannot tell, and the queue's first offset then moves past every offset the
    view read (left so)."""
    number = seen.chunk_end_number
    chunk = manager._by_number.get(number)
    if chunk is not None:
        if chunk.header.chunk_id != seen.chunk_id:
            raise replaced(chunk.path, seen, chunk.header.chunk_id.bytes)
        return
    last = manager.last_chunk
    if last is None or last.end_number < number:
        path = directory / chunk_file_name(seen.chunk_start_number)
        raise ChunkReplacedError(
            f"the chunk this handle read last (chunk id {seen.chunk_id}) is gone, and the "
            f"directory's files end before it ("
            + ("none left" if last is None else f"at chunk {last.end_number}")
            + "): they are not the files it read (its topic deleted, and made again?)",
            file=path,
        )
