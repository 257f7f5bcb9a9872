"""Removing chunks: retention's removal of the oldest completed chunks, and the cut of
every record past a position (recovery of a derived index). Apart from the rest: the
only places where the writer deletes or shortens its own chunk files."""

from __future__ import annotations

import logging
import os
import time

from equeue.chunks.chunk import Chunk
from equeue.chunks.fileops import fsync_directory
from equeue.chunks.opening import ChunkOpening
from equeue.chunks.recovery import TailCut, cut_range, make_side_dir
from equeue.errors import WriterExistsError
from equeue.format.chunk import FOOTER_SIZE, HEADER_SIZE, RECOVERED_DIR, chunk_file_size
from equeue.safepath import open_fd

log = logging.getLogger("equeue.chunks")


class ChunkRemoval(ChunkOpening):
    def remove_chunks_before(self, number: int) -> list[Chunk]:
        """Delete completed chunks that end before chunk ``number``, oldest first.

        The last chunk is never removed. Readers that already hold a removed
        chunk's mapping finish reading it; later reads raise ChunkRemovedError.
        """
        removed: list[Chunk] = []
        with self._lock:
            self._check_writable()
            while (
                len(self._chunks) > 1
                and self._chunks[0].end_number < number
                and self._chunks[0].is_completed
            ):
                chunk = self._chunks.pop(0)
                for n in range(chunk.start_number, chunk.end_number + 1):
                    self._by_number.pop(n, None)
                removed.append(chunk)
            for chunk in removed:
                chunk.kept = False  # (before the unlink: a reader holding it is told why)
                chunk.release_mapping()
                chunk.path.unlink(missing_ok=True)
                log.info("removed chunk %s", chunk.path)
            if removed:
                fsync_directory(self.directory)
        return removed

    def truncate_after(self, position: int) -> list[TailCut]:
        """Cut every record at or after ``position`` (recovery of a derived index only).

        Whole chunks past it are moved to ``recovered/``; the chunk holding it
        loses its footer (it is ongoing again) and its data from there on, each
        cut copied to a side file first. Writers must be created afterwards.
        """
        cuts: list[TailCut] = []
        with self._lock:
            self._check_writable()
            if self._writer is not None:
                raise WriterExistsError("truncate_after() needs a manager without a writer")
            if position >= self.committed_position:
                return cuts
            number = max(position // self.config.chunk_data_size, self.first_chunk.start_number)  # type: ignore[union-attr]
            side_dir = self.directory / RECOVERED_DIR
            moved = False
            while self._chunks and self._chunks[-1].start_number > number:
                chunk = self._chunks.pop()
                for n in range(chunk.start_number, chunk.end_number + 1):
                    self._by_number.pop(n, None)
                chunk.kept = False
                chunk.close()
                side_dir = make_side_dir(self.directory)
                side = side_dir / f"{chunk.path.name}.{time.time_ns()}.cut"
                os.rename(chunk.path, side)
                moved = True
                cut = TailCut(
                    str(chunk.path), 0, chunk.file_size, str(side), "whole chunk past the cut"
                )
                log.warning("recovery: %s", cut)
                cuts.append(cut)
            chunk = self._chunks[-1]
            local = max(0, position - chunk.start_position)
            chunk.close()
            fd = open_fd(chunk.path, os.O_RDWR)
            try:
                full = chunk_file_size(chunk.header.chunk_data_size)
                for start, stop, reason in (
                    (full - FOOTER_SIZE, full, "footer of a chunk reopened by a cut"),
                    (HEADER_SIZE + local, full - FOOTER_SIZE, "records past the cut"),
                ):
                    zeroed = cut_range(chunk.path, fd, start, stop, reason)
                    if zeroed is not None:
                        cuts.append(zeroed)
            finally:
                os.close(fd)
            chunk.footer = None
            chunk.data_end = chunk.record_count = 0  # rescan from the start
            self._rescan_tail(chunk)
            chunk.open_for_write()
            fsync_directory(self.directory)
            if moved:
                fsync_directory(side_dir)
            self.recovery_cuts.extend(cuts)
        return cuts
