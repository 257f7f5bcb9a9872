"""The writer's per-record path into a chunk open for writing: one record, a batch's
frames then their publication, a fixed-size entry. Apart from the rest of the chunk
because it is the hot path (the C Sender does the same steps: equeue/cext/sender.c):
what it looks up stays a module global or a local, never another module's attribute."""

from __future__ import annotations

import xxhash

from equeue.chunks.mapping import ChunkMapping
from equeue.format.chunk import (
    _FRAME_PACKERS,
    CHECKSUM_MASK,
    FRAME_OVERHEAD,
    HEADER_SIZE,
    frame_packer,
)

_xxh3 = xxhash.xxh3_64_intdigest  # record_checksum() inlined on the hot paths


class ChunkAppends(ChunkMapping):
    def try_append(self, record: bytes) -> int:
        """Append one variable-size record; its chunk-relative offset, or -1 if it does not fit.

        Only for a chunk open for writing; the caller (ChunkWriter) has checked the record.
        """
        n = len(record)
        offset = self.data_end
        end = offset + n + FRAME_OVERHEAD
        if end > self.writable_end:
            if end > self.data_size:
                return -1
            self.reserve(end)
        pack = _FRAME_PACKERS.get(n) or frame_packer(n)
        pack(self._mm, HEADER_SIZE + offset, n, record, _xxh3(record) & CHECKSUM_MASK, n)
        self.record_count += 1
        self.data_end = end  # publish last: readers check data_end first
        if end > self._prefault_mark:
            self._prefault(end)
        return offset

    def write_frame_at(self, offset: int, record: bytes) -> int:
        """Batch appends, step 1: frame ``record`` at data offset ``offset`` (at or past
        ``data_end``) without publishing it; returns the offset after it. The caller
        (holding the write lock) has checked that it fits."""
        n = len(record)
        pack = _FRAME_PACKERS.get(n) or frame_packer(n)
        pack(self._mm, HEADER_SIZE + offset, n, record, _xxh3(record) & CHECKSUM_MASK, n)
        return offset + n + FRAME_OVERHEAD

    def publish(self, end: int, count: int) -> None:
        """Batch appends, step 2: make the ``count`` records written up to ``end`` visible."""
        self.record_count += count
        self.data_end = end
        if end > self._prefault_mark:
            self._prefault(end)

    def try_append_fixed(self, record: bytes) -> int:
        offset = self.data_end
        end = offset + len(record)
        if end > self.writable_end:
            if end > self.data_size:
                return -1
            self.reserve(end)
        self._mm[HEADER_SIZE + offset : HEADER_SIZE + end] = record  # type: ignore[index]
        self.record_count += 1
        self.data_end = end
        if end > self._prefault_mark:  # as try_append: the window ahead, and release behind
            self._prefault(end)
        return offset
