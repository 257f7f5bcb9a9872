"""ChunkReader: reads records by global position, never past the committed end."""

from __future__ import annotations

from collections.abc import Iterator

from equeue.chunks.manager import ChunkManager
from equeue.errors import ChunkRemovedError, PositionNotFoundError


class ChunkReader:
    """Safe to use from any number of threads while one ChunkWriter appends."""

    def __init__(self, manager: ChunkManager) -> None:
        self.manager = manager

    def read(self, position: int) -> bytes:
        manager = self.manager
        chunk = manager.get_chunk_for(position)
        try:
            return chunk.read_at(position - chunk.base)
        except ChunkRemovedError:
            # Its file went away while we held it: retention removed it, or compaction
            # replaced it (the writer swaps first; a read-only view adopts now).
            if manager.read_only:
                manager.adopt_replacements()
            again = manager.get_chunk_for(position)
            if again is chunk:
                raise
            return again.read_at(position - again.base)

    def iter_from(self, position: int = 0) -> Iterator[tuple[int, bytes]]:
        """(position, payload) for every record at or after ``position``, across chunks.

        A position inside a chunk's unused tail moves on to the next chunk; a
        position before the first retained chunk starts at that chunk.
        """
        manager = self.manager
        if position < manager.first_position:
            position = manager.first_position
        while True:
            try:
                chunk = manager.get_chunk_for(position)
            except PositionNotFoundError:
                return
            except ChunkRemovedError:
                first = manager.first_position
                if first <= position:
                    # nothing retained past it: a read-only view that retention left
                    # empty (its first position 0) would otherwise spin here (review13 F1)
                    return
                position = first
                continue
            base = chunk.base
            if chunk.is_completed:
                yield from chunk.iter_records(position - base, base)
                position = chunk.end_position
                continue
            # The chunk was ongoing when we started. The writer may append more
            # records and complete it between our reaching its committed end and our
            # is_completed check below; moving straight on to the next chunk would then skip
            # those records. So track where we stopped and, if the chunk completed meanwhile,
            # read it again from there before moving on.
            resume = yield from chunk.iter_records(position - base, base)
            if not chunk.is_completed:
                return  # the ongoing chunk: we have read up to the committed end
            position = base + resume
