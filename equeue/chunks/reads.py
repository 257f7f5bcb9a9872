"""Reading a chunk: a record by position (through the compacted chunk's map), several
for a pull, and iteration from a position, each checked against its frame and
checksum. Apart from the writing parts: readers (a read-only view, the inspector)
use this and the mapping only."""

from __future__ import annotations

import mmap
from collections.abc import Generator

import xxhash

from equeue.chunks.chunkstate import _ticks
from equeue.chunks.mapping import ChunkMapping
from equeue.chunks.posmap import REMEDY as POSITION_MAP_REMEDY
from equeue.chunks.posmap import check_position_map
from equeue.errors import (
    CompactedAwayError,
    CorruptionError,
    CorruptRecordError,
    PositionNotFoundError,
)
from equeue.format.chunk import (
    CHECKSUM_MASK,
    FRAME_OVERHEAD,
    FRAME_PREFIX,
    FRAME_PREFIX_SIZE,
    FRAME_SUFFIX,
    HEADER_SIZE,
    MAP_ENTRY,
    MAP_ENTRY_SIZE,
    frame_problem,
    record_checksum,
)
from equeue.format.message import RECORD_POSITION

_xxh3 = xxhash.xxh3_64_intdigest  # record_checksum() inlined on the hot paths
_unpack_prefix = FRAME_PREFIX.unpack_from
_unpack_suffix = FRAME_SUFFIX.unpack_from
_unpack_position = RECORD_POSITION.unpack_from
Records = Generator[tuple[int, bytes], None, int]


def _stored_position(payload: bytes) -> int:
    """The position a message record names (its head's first field); -1 if too short."""
    return RECORD_POSITION.unpack_from(payload)[0] if len(payload) >= RECORD_POSITION.size else -1


class ChunkReads(ChunkMapping):
    def physical_offset(self, local: int) -> int:
        """Where the record at chunk-relative logical offset ``local`` starts in the data area."""
        if not self.header.compacted:
            if not 0 <= local < self.data_end:
                raise PositionNotFoundError(
                    f"position {self.start_position + local} lies past the end of the data "
                    f"({self.start_position + self.data_end}) in {self.path}"
                )
            size = self.header.record_size
            if size and local % size:
                # A position off the record grid names no record; reading there would
                # return bytes straddling two records (or past data_end).
                raise PositionNotFoundError(
                    f"position {self.start_position + local} is not at a record boundary "
                    f"(record_size={size}) in {self.path}"
                )
            return local
        return self._map_lookup(local)

    def checked_map(self) -> mmap.mmap:
        """The mapping of a compacted chunk, its position map checked on first use."""
        mm = self.mapping()
        if not self.map_checked:
            assert self.footer is not None, "compacted chunks are always completed"
            check_position_map(mm, self.footer, self.path)
            self.map_checked = True
        return mm

    def _map_lookup(self, local: int) -> int:
        footer = self.footer
        assert footer is not None, "compacted chunks are always completed"
        if not 0 <= local < footer.logical_data_size:
            raise PositionNotFoundError(
                f"position {self.start_position + local} lies outside compacted chunk {self.path}"
            )
        mm = self._mm
        if mm is None or not self.map_checked:
            mm = self.checked_map()
        base = HEADER_SIZE + footer.physical_data_size
        lo, hi = 0, footer.map_entry_count
        while lo < hi:
            mid = (lo + hi) // 2
            logical, physical = MAP_ENTRY.unpack_from(mm, base + mid * MAP_ENTRY_SIZE)
            if logical < local:
                lo = mid + 1
            elif logical > local:
                hi = mid
            else:
                # The map led here: the record must say it is the one (its head's first
                # field), checked before its frame is (the caller's read checks that).
                at = HEADER_SIZE + physical + FRAME_PREFIX_SIZE
                if at + RECORD_POSITION.size <= HEADER_SIZE + footer.physical_data_size:
                    (stored,) = _unpack_position(mm, at)
                    if stored != self.base + local:
                        raise self._misplaced(base + mid * MAP_ENTRY_SIZE, local, stored)
                return int(physical)
        # A gap. It is one only if the entries on either side name their own records and
        # those are adjacent in the data (survivors are copied contiguously): else a
        # damaged entry (one that still passed the map check) has moved a survivor out of
        # the way of its own position, which would read as removed.
        count = footer.map_entry_count
        for index in (lo - 1, lo):
            if 0 <= index < count:
                self._check_entry(mm, base, index)
        if lo > 0:  # inside the survivor before it: not a record start, never a record
            logical, physical = MAP_ENTRY.unpack_from(mm, base + (lo - 1) * MAP_ENTRY_SIZE)
            (length,) = _unpack_prefix(mm, HEADER_SIZE + physical)
            after = (
                MAP_ENTRY.unpack_from(mm, base + lo * MAP_ENTRY_SIZE)[1]
                if lo < count
                else footer.physical_data_size
            )
            if physical + length + FRAME_OVERHEAD != after:
                raise CorruptionError(
                    f"position map entry {lo - 1} leads to a record of {length} bytes at "
                    f"physical offset {physical}, which does not end where the next "
                    f"survivor starts ({after})",
                    file=self.path,
                    offset=base + (lo - 1) * MAP_ENTRY_SIZE,
                    remedy=POSITION_MAP_REMEDY,
                )
            if local < logical + length + FRAME_OVERHEAD:
                raise PositionNotFoundError(
                    f"position {self.start_position + local} lies inside the record at "
                    f"{self.start_position + logical} in {self.path}"
                )
        # The map keeps survivors only, so a position in a gap is reported as removed
        # even if it was inside a removed record rather than at its start.
        raise CompactedAwayError(
            f"the record at position {self.start_position + local} was removed by compaction "
            f"(chunk {self.path})"
        )

    def _check_entry(self, mm: mmap.mmap, map_at: int, index: int) -> None:
        """CorruptionError if map entry ``index``'s frame names another position."""
        logical, physical = MAP_ENTRY.unpack_from(mm, map_at + index * MAP_ENTRY_SIZE)
        at = HEADER_SIZE + physical + FRAME_PREFIX_SIZE
        if at + RECORD_POSITION.size <= HEADER_SIZE + self.physical_end:
            (stored,) = RECORD_POSITION.unpack_from(mm, at)
            if stored != self.start_position + logical:
                raise self._misplaced(map_at + index * MAP_ENTRY_SIZE, logical, stored)

    def _misplaced(self, entry_at: int, logical: int, stored: int) -> CorruptionError:
        return CorruptionError(
            f"the position map entry for position {self.start_position + logical} leads "
            f"to the record of position {stored}",
            file=self.path,
            offset=entry_at,
            remedy=POSITION_MAP_REMEDY,
        )

    def read_at(self, local: int) -> bytes:
        """The payload of the record at chunk-relative logical offset ``local``."""
        physical = self.physical_offset(local)
        self.last_used = next(_ticks)
        mm = self._mm or self.mapping()
        size = self.header.record_size
        if size:
            return mm[HEADER_SIZE + physical : HEADER_SIZE + physical + size]
        return self._read_frame(mm, physical)

    def read_many(self, offsets: list[int]) -> list[bytes]:
        """``read_at`` for several records (a pull's run of queue entries) in one loop.

        Any record that is not a valid, checksummed frame at its offset is read
        again through ``read_at``, which raises the precise error.
        """
        if self.header.compacted or self.header.record_size:
            return [self.read_at(local) for local in offsets]
        self.last_used = next(_ticks)
        mm = self._mm or self.mapping()
        end = HEADER_SIZE + self.physical_end
        unpack_prefix, unpack_suffix, xxh3 = _unpack_prefix, _unpack_suffix, _xxh3
        payloads = []
        for local in offsets:
            p = HEADER_SIZE + local
            if local >= 0 and p + FRAME_OVERHEAD <= end:
                (n,) = unpack_prefix(mm, p)
                q = p + FRAME_PREFIX_SIZE + n
                if n > 0 and q + FRAME_SUFFIX.size <= end:
                    payload = mm[p + FRAME_PREFIX_SIZE : q]
                    checksum, suffix = unpack_suffix(mm, q)
                    if suffix == n and xxh3(payload) & CHECKSUM_MASK == checksum:
                        payloads.append(payload)
                        continue
            payloads.append(self.read_at(local))  # raises what is wrong there
        return payloads

    @property
    def physical_end(self) -> int:
        """Bytes of the data area in use: the footer's, or what the writer published."""
        return self.footer.physical_data_size if self.footer is not None else self.data_end

    def corrupt_record(self, physical: int) -> CorruptRecordError:
        mm = self._mm or self.mapping()
        end = HEADER_SIZE + self.physical_end
        problem = frame_problem(mm, HEADER_SIZE + physical, end, self._max_record_size)
        reason, expected, found = problem or ("no record starts here", None, None)
        return CorruptRecordError(
            f"invalid record at position {self.start_position + physical}: {reason}",
            file=self.path,
            offset=HEADER_SIZE + physical,
            expected=expected,
            found=found,
        )

    def iter_records(self, local: int, base: int = 0) -> Records:
        """(``base`` + logical offset, payload) from chunk-relative ``local`` on, up to the
        committed end; returns the chunk-relative offset after the last record yielded.

        Yielding ``base``-shifted positions lets ChunkReader delegate with ``yield from``
        instead of re-yielding every record through a second generator.
        """
        self.last_used = next(_ticks)
        if self.header.compacted:
            return (yield from self._iter_compacted(local, base))
        if self.header.record_size:
            return (yield from self._iter_fixed(local, base))
        return (yield from self._iter_variable(local, base))

    def _iter_variable(self, local: int, base: int) -> Records:
        mm = self._mm or self.mapping()
        unpack_prefix, unpack_suffix, xxh3 = _unpack_prefix, _unpack_suffix, _xxh3
        completed = self.footer is not None
        limit = HEADER_SIZE + self.data_end
        p = HEADER_SIZE + local
        shift = base - HEADER_SIZE
        while p < limit or (not completed and p < HEADER_SIZE + self.data_end):
            if not completed:
                limit = HEADER_SIZE + self.data_end  # the writer may have committed more
            (n,) = unpack_prefix(mm, p)
            q = p + 4 + n
            if n == 0 or q + 8 > limit:
                raise self.corrupt_record(p - HEADER_SIZE)
            payload = mm[p + 4 : q]
            checksum, suffix = unpack_suffix(mm, q)
            if suffix != n or xxh3(payload) & CHECKSUM_MASK != checksum:
                raise self.corrupt_record(p - HEADER_SIZE)
            yield p + shift, payload
            p = q + 8
        return p - HEADER_SIZE

    def _iter_fixed(self, local: int, base: int) -> Records:
        mm = self._mm or self.mapping()
        size = self.header.record_size
        # Round a position off the record grid up, not down: iteration yields records
        # at or after ``local``, never the one that starts before it.
        offset = -(-local // size) * size
        while offset < self.data_end:
            p = HEADER_SIZE + offset
            yield base + offset, mm[p : p + size]
            offset += size
        return offset

    def _iter_compacted(self, local: int, base: int) -> Records:
        footer = self.footer
        assert footer is not None
        mm = self.checked_map()
        map_at = HEADER_SIZE + footer.physical_data_size  # not ``base``: the positions' base
        lo, hi = 0, footer.map_entry_count
        while lo < hi:  # first entry at or after `local`
            mid = (lo + hi) // 2
            if MAP_ENTRY.unpack_from(mm, map_at + mid * MAP_ENTRY_SIZE)[0] < local:
                lo = mid + 1
            else:
                hi = mid
        size = self.header.record_size
        for index in range(lo, footer.map_entry_count):
            logical, physical = MAP_ENTRY.unpack_from(mm, map_at + index * MAP_ENTRY_SIZE)
            if size:
                yield base + logical, mm[HEADER_SIZE + physical : HEADER_SIZE + physical + size]
            else:
                payload = self._read_frame(mm, physical)
                stored = _stored_position(payload)
                if stored != self.base + logical:
                    raise self._misplaced(map_at + index * MAP_ENTRY_SIZE, logical, stored)
                yield base + logical, payload
        return footer.logical_data_size

    def _read_frame(self, mm: mmap.mmap, physical: int) -> bytes:
        p = HEADER_SIZE + physical
        (n,) = _unpack_prefix(mm, p)
        q = p + FRAME_PREFIX_SIZE + n
        if n > 0 and q + FRAME_SUFFIX.size <= HEADER_SIZE + self.physical_end:
            payload = mm[p + FRAME_PREFIX_SIZE : q]
            checksum, suffix = _unpack_suffix(mm, q)
            if suffix == n and record_checksum(payload) == checksum:
                return payload
        raise self.corrupt_record(physical)
