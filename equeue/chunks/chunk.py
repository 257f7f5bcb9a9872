"""One chunk file: the Chunk class, its creation and its closing.

The rest of what a chunk does lives in its parts, each a base class of Chunk:
chunkstate.py (the fields and identity), mapping.py (the maps, the prefault window,
block allocation), appends.py (the per-record writes), completion.py (flush and the
footer) and reads.py (reads and iteration). The names others import from here
(fsync_directory, write_error, Records) are re-exported."""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Callable
from pathlib import Path

from equeue.chunks.ahead import AheadFile
from equeue.chunks.appends import ChunkAppends
from equeue.chunks.chunkstate import _MIN_STEP, _round_page
from equeue.chunks.completion import ChunkCompletion
from equeue.chunks.fileops import fsync_directory, write_error
from equeue.chunks.reads import ChunkReads, Records
from equeue.chunks.space import allocate as _allocate  # (patched by tests, by that name)
from equeue.format.chunk import (
    HEADER_SIZE,
    TEMP_SUFFIX,
    ChunkHeader,
    chunk_file_name,
    chunk_file_size,
)
from equeue.safepath import open_fd

__all__ = ["Chunk", "Records", "fsync_directory", "write_error"]


class Chunk(ChunkAppends, ChunkCompletion, ChunkReads):
    """A chunk file and what is known of it in memory (the fields: chunkstate.py)."""

    # --- creation ------------------------------------------------------------

    @classmethod
    def create(
        cls,
        directory: Path,
        header: ChunkHeader,
        *,
        version: int,
        max_record_size: int,
        on_map: Callable[[Chunk], None],
        alloc_step: int = 0,
    ) -> Chunk:
        """Temp file, preallocate (the first step), header, fsync, rename, fsync the
        directory."""
        final = directory / chunk_file_name(header.chunk_start_number, version)
        temp = directory / f"{final.name}.{uuid.uuid4().hex}{TEMP_SUFFIX}"
        size = chunk_file_size(header.chunk_data_size)
        renamed = False
        chunk = cls(
            final,
            header,
            None,
            version=version,
            data_end=0,
            record_count=0,
            max_record_size=max_record_size,
            on_map=on_map,
            alloc_step=alloc_step,
        )
        # Full size from the start, so positions and the footer's place never change; the
        # blocks past the first step are allocated as the writer nears them (reserve()).
        first = size
        if alloc_step:
            first = min(_round_page(HEADER_SIZE + min(alloc_step, _MIN_STEP)), size)
        try:
            fd = open_fd(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL)
            try:
                if not _allocate(fd, 0, first):
                    first = size  # no fallocate here: a sparse file, as before
                    os.ftruncate(fd, size)
                elif first < size:
                    os.ftruncate(fd, size)
                os.pwrite(fd, header.pack(), 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            if final.exists():
                raise FileExistsError(errno.EEXIST, "chunk file exists already", str(final))
            os.rename(temp, final)
            renamed = True
            fsync_directory(directory)
            chunk.open_for_write()
            chunk.writable_end = min(first - HEADER_SIZE, chunk.data_size)
        except OSError as exc:
            # Undo it all, so that a retry (once space is freed) starts from nothing:
            # a chunk file left behind would block the next creation.
            chunk.close()
            (final if renamed else temp).unlink(missing_ok=True)
            raise write_error(exc, "creating a chunk", final) from exc
        return chunk

    @classmethod
    def install_made_ahead(
        cls,
        ahead: AheadFile,
        *,
        max_record_size: int,
        on_map: Callable[[Chunk], None],
        alloc_step: int = 0,
    ) -> Chunk:
        """``create`` for a file made ahead (ahead.py), checked by the caller: the rename
        and the mapping. The header stays the one written ahead (its ``created_at_ns`` is
        when the file was made: rewritten, its page would be at risk until the first
        fdatasync). The directory's fsync is left to the first fdatasync
        (``make_name_durable``). OSError if the rename or the mapping fails, the file
        then removed under whichever name it has."""
        header = ahead.header
        directory = ahead.path.parent
        final = directory / chunk_file_name(header.chunk_start_number, 0)
        chunk = cls(
            final,
            header,
            None,
            version=0,
            data_end=0,
            record_count=0,
            max_record_size=max_record_size,
            on_map=on_map,
            alloc_step=alloc_step,
        )
        renamed = False
        try:
            if final.exists():
                raise FileExistsError(errno.EEXIST, "chunk file exists already", str(final))
            os.rename(ahead.path, final)
            renamed = True
            chunk._name_renamed(True)
            chunk.open_for_write()
            chunk.writable_end = min(ahead.allocated - HEADER_SIZE, chunk.data_size)
        except OSError:
            chunk.close()
            (final if renamed else ahead.path).unlink(missing_ok=True)
            raise
        return chunk

    def close(self) -> None:
        if self.name_pending:  # (a chunk closed unflushed: none of its data was vouched for)
            self._name_renamed(False)
        mm, self._mm = self._mm, None
        self._end_writing()
        self._close_fd()
        if mm is not None:
            # A reader may still hold a view; then the mapping dies with it.
            with contextlib.suppress(BufferError):
                mm.close()
