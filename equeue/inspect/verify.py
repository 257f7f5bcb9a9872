"""``equeue verify``: every checksum, every record and every queue entry of a store.

Frames are read here rather than through Chunk.iter_records, which stops at the
first bad record: a verifier reports it and goes on. Every problem names its file
and file offset. On a live store the writer may be half-way through a frame or a
footer at the moment it is read, so a problem in the last chunk of a directory is
only reported if it is still there when the chunk is read again.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from equeue.chunks.recovery import TailHint, scan_start
from equeue.errors import CorruptionError, NewerFormatError
from equeue.format.chunk import (
    FOOTER_SIZE,
    FRAME_OVERHEAD,
    FRAME_PREFIX,
    FRAME_PREFIX_SIZE,
    HEADER_SIZE,
    MAP_ENTRY_SIZE,
    ChunkType,
    PositionMapEntry,
    chunk_file_size,
    frame_problem,
)
from equeue.format.message import (
    MESSAGE_HEAD,
    MESSAGE_HEAD_SIZE,
    QUEUE_RECORD_SIZE,
    STORED_TIME_OFFSET,
    MessageLogRecord,
    tag_hash,
)
from equeue.inspect import verifyqueues
from equeue.inspect.frames import frame_reason, map_lookup, resync, suffix_length
from equeue.inspect.intents import intent_problems
from equeue.inspect.layout import (
    ChunkDir,
    ChunkFile,
    Problem,
    Progress,
    StoreFiles,
    chunk_paths,
    data_checksum,
    describe,
    load_chunk_file,
    map_file,
    newer_problem,
    open_store,
    resolve,
    trailing_bytes,
)
from equeue.inspect.offsetends import past_end_problems
from equeue.inspect.staging import staging_problems
from equeue.inspect.traces import missing_problems
from equeue.inspect.verifyqueues import CheckResult, Unreadable

_RETRIES = 3  # re-reads of a live directory's last chunk before a problem there is believed
_RETRY_DELAY = 0.05
_TICK = 1 << 20  # progress every MiB of data walked


@dataclass(frozen=True, slots=True)
class _Head:
    topic: str
    queue_id: int
    queue_offset: int
    tag_hash: int


def verify_store(path: Path, progress: Progress | None = None) -> list[Problem]:
    """Every problem found in the store at ``path``; empty when it is healthy."""
    return Verifier(path, progress).run()


class Verifier:
    def __init__(self, path: Path, progress: Progress | None = None) -> None:
        self.path = path
        self.progress = progress
        self.message_chunks = 0
        self.records = 0
        self.queue_chunks = 0
        self.queue_entries = 0
        self.bytes_total = 0  # the chunk files' sizes, for progress: each is a full chunk's
        self.bytes_read = 0  # what was checked: headers, data, position maps, footers
        self._done = 0
        self._store = StoreFiles(path)
        self._maps: dict[Path, mmap.mmap] = {}
        self._messages: dict[int, ChunkFile] = {}  # message chunk by every number it covers
        self._message_size: int | None = None
        self._first_number: int | None = None
        self._absent: set[int] = set()  # message chunk numbers looked for and not found
        # Listed chunks found gone later: why that is a problem (None: it is not).
        self._vanished: dict[Path, str | None] = {}
        self._dirs: dict[Path, ChunkDir] = {}  # each directory as it was checked
        # each queue's lowest offset in the log, and the log chunk that held it
        self._lowest: dict[tuple[str, int], tuple[int, Path]] = {}
        # each queue's offset after its last message in the log (offsetends.py)
        self._log_next: dict[tuple[str, int], int] = {}
        # per queue: (chunk number, last message position before that chunk, after it)
        self._previous: dict[tuple[str, int], tuple[int, int | None, int | None]] = {}

    # --- the run -------------------------------------------------------------------

    def run(self) -> list[Problem]:
        store = self._store = open_store(self.path)
        problems = list(store.problems)
        message_paths = store.chunk_paths(store.messages_dir)
        queue_paths = {key: store.chunk_paths(store.queue_dir(*key)) for key in store.queues()}
        for _, _, path in message_paths:
            with contextlib.suppress(FileNotFoundError):
                self.bytes_total += path.stat().st_size
        # Queue chunks at their nominal size, not stat'ed one by one (10,000 stats): what
        # progress needs is their share, and a torn one only moves the bar a little.
        records = store.queue_chunk_records
        nominal = None if records is None else chunk_file_size(records * QUEUE_RECORD_SIZE)
        for paths in queue_paths.values():
            for _, _, path in paths:
                if nominal is not None:
                    self.bytes_total += nominal
                    continue
                with contextlib.suppress(FileNotFoundError):
                    self.bytes_total += path.stat().st_size
        try:
            problems += self._check_dir(
                store.messages_dir, message_paths, self._message_chunk, queue=False
            )
            for (topic, queue_id), paths in queue_paths.items():
                check = self._queue_checker(topic, queue_id)
                problems += self._check_dir(
                    store.queue_dir(topic, queue_id), paths, check, queue=True
                )
            problems += missing_problems(store, self._dirs, store.checkpoint, self._lowest)
            problems += past_end_problems(store, self._dirs, self._log_next)
            problems += staging_problems(self.path)
            problems += intent_problems(self.path)
        except NewerFormatError as exc:
            # A newer equeue's chunk: the opens refuse the store, and what this version
            # would derive from it (the log's end, entries into it) is no problem of it.
            return [*store.problems, newer_problem(exc)]
        finally:
            for mm in self._maps.values():
                mm.close()
            self._maps.clear()
        self._tick(self.bytes_total)
        return problems

    def _check_dir(
        self,
        directory: Path,
        paths: list[tuple[int, int, Path]],
        check: Callable[[ChunkFile, bool], CheckResult],
        *,
        queue: bool,
    ) -> list[Problem]:
        loaded = []
        for i, (_, _, path) in enumerate(paths):
            try:
                loaded.append(load_chunk_file(path, last=i == len(paths) - 1))
            except FileNotFoundError:
                continue  # removed by retention since the listing
        chunks = self._dirs[directory] = resolve(directory, loaded)
        problems = list(chunks.problems)
        for i, cf in enumerate(chunks.files):
            last = i == len(chunks.files) - 1
            try:
                result = check(cf, last)
                for _ in range(_RETRIES if last else 0):
                    if not result.problems:
                        break
                    time.sleep(_RETRY_DELAY)  # a live writer may be mid-frame or mid-footer
                    cf = load_chunk_file(cf.path, last=True)
                    result = check(cf, last)
            except FileNotFoundError as exc:
                if exc.filename is None or os.fspath(exc.filename) != os.fspath(cf.path):
                    raise  # not this chunk: no guess about what else vanished
                # Loaded, then gone before (or while) it was checked: as at the load.
                if self._gone(directory, cf) is not None:
                    problems.append(self._gone_problem(cf))
                continue
            problems += sorted(result.problems, key=lambda p: -1 if p.offset is None else p.offset)
            if cf.header is not None:
                footer = FOOTER_SIZE if cf.footer is not None else 0
                self.bytes_read += HEADER_SIZE + cf.data_end + cf.map_bytes + footer
            cf.content = None  # checked: the bytes of 10,000 queues are not kept
            if queue:
                self.queue_chunks += 1
                self.queue_entries += result.records
            else:
                self.message_chunks += 1
                self.records += result.records
            self._done += cf.size
            self._tick(self._done)
        return problems

    def _tick(self, done: int) -> None:
        if self.progress is not None:
            self.progress(min(done, self.bytes_total), self.bytes_total)

    # --- message chunks --------------------------------------------------------------

    def _message_chunk(self, cf: ChunkFile, last: bool) -> CheckResult:
        result = CheckResult(list(cf.problems))
        if self._first_number is None:
            self._first_number = cf.start_number  # the log starts here (retention removed less)
        for n in range(cf.start_number, cf.end_number + 1):
            self._messages[n] = cf  # a damaged one too: entries into it are reported as such
        header = cf.header
        if header is None:
            return result
        if self._message_size is None:
            self._message_size = self._store.chunk_data_size or header.chunk_data_size
        self._check_header(
            cf, result, ChunkType.VARIABLE, self._store.chunk_data_size, 0, STORED_TIME_OFFSET
        )
        self._check_data_checksum(cf, result)
        if cf.size <= HEADER_SIZE or (header.compacted and cf.footer is None):
            # Without its footer a compacted chunk's map cannot be found: its frames read
            # as if logical offsets were physical gave thousands of derived problems, the
            # footer's own buried among them (review f F2). The footer problem is listed.
            return result
        mm = map_file(cf.path)
        try:
            if header.compacted and cf.footer is not None:
                self._walk_map(cf, mm, result)
            else:
                self._walk_frames(cf, mm, result, last)
        finally:
            mm.close()
        footer = cf.footer
        if (
            footer is not None
            and not result.frames_damaged
            and result.records != footer.record_count
        ):
            result.problems.append(
                Problem(
                    str(cf.path),
                    cf.size - FOOTER_SIZE,
                    "footer",
                    f"footer says {footer.record_count} records, the data holds {result.records}",
                )
            )
        return result

    def _walk_frames(self, cf: ChunkFile, mm: mmap.mmap, result: CheckResult, last: bool) -> None:
        header = cf.header
        assert header is not None
        path, base = str(cf.path), header.start_position
        max_length = header.chunk_data_size - FRAME_OVERHEAD
        ongoing = cf.footer is None
        end = HEADER_SIZE + cf.data_limit
        p = HEADER_SIZE
        ticked = p
        # Recovery scans the last ongoing chunk from where a tail hint says its records
        # ended (the checkpoint's, or this boot's live tail): damage before that is not
        # cut, and the records past it stay. Predict what it will do, not more.
        kept_to = HEADER_SIZE + self._scan_start(cf, mm) if ongoing and last else HEADER_SIZE
        while p < end:
            if p - ticked >= _TICK:
                self._tick(self._done + p)
                ticked = p
            found = frame_problem(mm, p, end, max_length)
            if found is None:
                (length,) = FRAME_PREFIX.unpack_from(mm, p)
                self._check_message(cf, mm, p, length, base + p - HEADER_SIZE, result)
                result.records += 1
                p += length + FRAME_OVERHEAD
                continue
            position = base + p - HEADER_SIZE
            reason = frame_reason(found)
            if p < kept_to:
                reason += (
                    f"; recovery keeps the records around it, as the tail hint says records "
                    f"end at position {base + kept_to - HEADER_SIZE} (it scans from there)"
                )
            elif ongoing:
                # The valid data of an ongoing chunk ends at the first invalid frame; what
                # lies past it is a torn tail unless valid records follow (then it is damage
                # that recovery would turn into lost records).
                stop = HEADER_SIZE + trailing_bytes(cf, p - HEADER_SIZE)
                if stop <= p:
                    return  # the clean end: nothing but zeros follows
                if frame_problem(mm, p, end, max_length) is None:
                    continue  # a live writer completed the frame meanwhile
                following = resync(mm, p + 1, stop, base, max_length)
                if following is None:
                    kind = "torn tail" if last else "record"
                    cut = ", which recovery would cut" if last else ""
                    result.problems.append(
                        Problem(
                            path,
                            p,
                            kind,
                            f"{reason} at position {position}: {stop - p} bytes after the last "
                            f"valid record{cut}",
                        )
                    )
                    return
                result.frames_damaged = True
                result.problems.append(
                    Problem(
                        path,
                        p,
                        "record",
                        f"invalid record at position {position}: {reason}; valid records "
                        f"follow from position {base + following - HEADER_SIZE}, but the chunk "
                        "is ongoing, so recovery would cut them all as a torn tail",
                    )
                )
                p = following
                continue
            result.frames_damaged = True
            length = FRAME_PREFIX.unpack_from(mm, p)[0] if p + FRAME_PREFIX_SIZE <= end else 0
            after = p + FRAME_OVERHEAD + length
            if length > 0 and after <= end and suffix_length(mm, p, length) == length:
                # The length prefix and suffix agree, so the frame's extent is known and
                # the walk goes on with the next frame.
                result.problems.append(
                    Problem(path, p, "checksum", f"invalid record at position {position}: {reason}")
                )
                result.records += 1
                p = after
                continue
            following = resync(mm, p + 1, end, base, max_length)
            skipped = (following if following is not None else end) - p
            where = (
                f"the next valid record is at position {base + following - HEADER_SIZE}"
                if following is not None
                else "no valid record follows"
            )
            result.problems.append(
                Problem(
                    path,
                    p,
                    "record",
                    f"invalid record at position {position}: {reason}; {where} "
                    f"({skipped} bytes unreadable)",
                )
            )
            if following is None:
                return
            p = following

    def _scan_start(self, cf: ChunkFile, mm: mmap.mmap) -> int:
        """The data offset where a writable open's recovery scan of ``cf`` (the last,
        ongoing message chunk) starts: chunks/recovery.py's scan_start."""
        header = cf.header
        assert header is not None
        live = self._store.live_tail
        hints = [
            None if live is None else TailHint(live.chunk_id, live.data_end, live.record_count),
            self._store.log_tail,
        ]
        available = max(0, min(header.chunk_data_size, cf.size - HEADER_SIZE))
        start = scan_start(hints, header.chunk_id, mm, available, header.chunk_data_size)
        return 0 if start is None else start.data_end

    def _walk_map(self, cf: ChunkFile, mm: mmap.mmap, result: CheckResult) -> None:
        """A compacted chunk: every position-map entry must lead to its own record."""
        header, footer = cf.header, cf.footer
        assert header is not None and footer is not None
        path = str(cf.path)
        data_end = HEADER_SIZE + footer.physical_data_size
        max_length = header.chunk_data_size - FRAME_OVERHEAD
        previous = -1
        for i in range(footer.map_entry_count):
            at = data_end + i * MAP_ENTRY_SIZE
            entry = PositionMapEntry.unpack(mm[at : at + MAP_ENTRY_SIZE], file=path, offset=at)
            position = header.start_position + entry.logical_offset
            if entry.logical_offset <= previous or entry.logical_offset >= footer.logical_data_size:
                result.problems.append(
                    Problem(
                        path,
                        at,
                        "position map",
                        f"entry {i} names logical offset {entry.logical_offset}, out of order or "
                        f"past the logical size {footer.logical_data_size}",
                    )
                )
            previous = entry.logical_offset
            p = HEADER_SIZE + entry.physical_offset
            found = frame_problem(mm, p, data_end, max_length)
            if found is not None:
                result.frames_damaged = True
                result.problems.append(
                    Problem(
                        path,
                        p,
                        "record",
                        f"invalid record at position {position}: {frame_reason(found)}",
                    )
                )
                continue
            (length,) = FRAME_PREFIX.unpack_from(mm, p)
            self._check_message(cf, mm, p, length, position, result)
            result.records += 1

    def _check_message(
        self, cf: ChunkFile, mm: mmap.mmap, p: int, length: int, position: int, result: CheckResult
    ) -> None:
        path = str(cf.path)
        start = p + FRAME_PREFIX_SIZE
        try:
            message = MessageLogRecord.unpack(mm[start : start + length], file=path, offset=p)
        except CorruptionError as exc:
            result.problems.append(
                Problem(
                    path, p, "record", f"message record at position {position}: {describe(exc)}"
                )
            )
            return
        # A deleted topic's record stays until retention, in no queue (as recovery skips it).
        deleted = position < self._store.deleted.get(message.topic, 0)
        queue = (message.topic, message.queue_id)
        if not deleted and message.queue_offset < self._lowest.get(queue, (1 << 63,))[0]:
            self._lowest[queue] = (message.queue_offset, cf.path)
        if not deleted and message.queue_offset >= self._log_next.get(queue, 0):
            self._log_next[queue] = message.queue_offset + 1
        why = None
        if message.log_position != position:
            why = f"names position {message.log_position}"
        elif MESSAGE_HEAD.unpack_from(mm, start)[6] != tag_hash(message.tag):
            why = f"has a tag hash that does not match its tag {message.tag!r}"
        elif not deleted and not self._has_queue(message.topic, message.queue_id, position):
            why = f"belongs to queue {message.topic}/{message.queue_id}, which the store lacks"
        if why is not None:
            result.problems.append(
                Problem(path, p, "record", f"the message record at position {position} {why}")
            )

    def _has_queue(self, topic: str, queue_id: int, position: int) -> bool:
        store = self._store
        if not store.topics_known:
            return True  # topics.json is damaged (reported): nothing to compare with
        if 0 <= queue_id < store.topics.get(topic, 0):
            return True
        # A live writer may have created (or deleted) the topic after we read topics.json.
        now = open_store(self.path)
        store.topics.update(now.topics)
        store.deleted.update(now.deleted)
        return position < store.deleted.get(topic, 0) or 0 <= queue_id < store.topics.get(topic, 0)

    # --- queue chunks: equeue/inspect/verifyqueues.py ----------------------------------

    _queue_checker = verifyqueues.queue_checker
    _queue_chunk = verifyqueues.queue_chunk
    _tail_problem = verifyqueues.tail_problem
    _check_entry = verifyqueues.check_entry

    def _message_at(self, position: int) -> tuple[_Head | None, str | None]:
        """The head of the message record at ``position``; (None, why) if there is none;
        (None, None) if compaction removed it or retention its chunk since the listing;
        Unreadable if its chunk cannot be read."""
        size = self._message_size
        if size is None:
            if not self._absent:
                self._list_messages()
                self._absent.add(-1)
            size = self._message_size
            if size is None:
                raise Unreadable("a store without message chunks")
        number = position // size
        cf = self._messages.get(number)
        if cf is None and number not in self._absent:
            # A live writer may have added the chunk since the listing; a queue entry is
            # written after its message, so the chunk is on disk now if it ever will be.
            self._list_messages()
            cf = self._messages.get(number)
            if cf is None:
                self._absent.add(number)  # list once per absent chunk, not once per entry
        if cf is None:
            raise Unreadable(f"message chunk {number}, which is missing")
        header = cf.header
        if header is None:
            raise Unreadable(f"message chunk {cf.path.name}, whose header is damaged")
        if header.compacted and cf.footer is None:
            raise Unreadable(
                f"compacted message chunk {cf.path.name}, whose footer is damaged (its "
                "position map cannot be found)"
            )
        mm = self._map(cf)
        if mm is None:
            return None, None  # its chunk was removed by retention since the listing
        local = position - header.start_position
        if header.compacted and cf.footer is not None:
            physical = map_lookup(mm, cf, local)
            if physical is None:
                return None, None
            local = physical
        limit = HEADER_SIZE + cf.data_limit
        p = HEADER_SIZE + local
        found = frame_problem(mm, p, limit, header.chunk_data_size - FRAME_OVERHEAD)
        if found is not None:
            return None, f"where no valid message record starts ({frame_reason(found)})"
        start = p + FRAME_PREFIX_SIZE
        (stored, _, _, qoff, qid, _, hashed, _, tl, *_) = MESSAGE_HEAD.unpack_from(mm, start)
        if stored != position:
            return None, f"but the record there names position {stored}"
        raw = mm[start + MESSAGE_HEAD_SIZE : start + MESSAGE_HEAD_SIZE + tl]
        return _Head(raw.decode(errors="replace"), qid, qoff, hashed), None

    def _list_messages(self) -> None:
        for number, _, path in chunk_paths(self._store.messages_dir):
            if number in self._messages:
                continue
            try:
                cf = load_chunk_file(path, last=True)
            except FileNotFoundError:
                continue
            if cf.header is not None and self._message_size is None:
                self._message_size = cf.header.chunk_data_size
            for n in range(cf.start_number, cf.end_number + 1):
                self._messages[n] = cf

    def _map(self, cf: ChunkFile) -> mmap.mmap | None:
        """The message chunk mapped; None if retention removed it since the listing."""
        mm = self._maps.get(cf.path)
        if mm is None:
            try:
                mm = self._maps[cf.path] = map_file(cf.path)
            except FileNotFoundError:
                found = self._gone(self._store.messages_dir, cf)
                if found is None:
                    return None
                raise Unreadable(
                    f"message chunk {cf.path.name}, which was removed while verify ran ({found})"
                ) from None
        return mm

    def _gone(self, directory: Path, cf: ChunkFile) -> str | None:
        """Why a listed chunk that is gone now is a problem; None if that is how a live
        store moves on: retention removed it (no chunk before it is left) or compaction
        replaced it (a later version of it is there). Once per file."""
        if cf.path not in self._vanished:
            number, version = cf.name_number, cf.name_version or 0
            now = chunk_paths(directory)
            before = [p.name for n, _, p in now if number is None or n < number]
            replaced = any(n == number and v > version for n, v, _ in now)
            self._vanished[cf.path] = (
                None
                if replaced or not before
                else f"chunk {before[0]} before it is still there; retention removes the "
                "oldest chunks first"
            )
        return self._vanished[cf.path]

    def _gone_problem(self, cf: ChunkFile) -> Problem:
        return Problem(
            str(cf.path),
            None,
            "missing chunk",
            f"removed while verify ran ({self._vanished[cf.path]})",
        )

    # --- shared checks ---------------------------------------------------------------

    def _check_header(
        self,
        cf: ChunkFile,
        result: CheckResult,
        chunk_type: ChunkType,
        data_size: int | None,
        record_size: int,
        timestamp_offset: int | None,
    ) -> None:
        header = cf.header
        assert header is not None
        expected = (
            ("chunk type", chunk_type.name.lower(), header.chunk_type.name.lower()),
            ("chunk data size", data_size, header.chunk_data_size),
            ("record size", record_size, header.record_size),
            ("timestamp offset", timestamp_offset, header.timestamp_offset),
            ("start number (from the file name)", cf.name_number, header.chunk_start_number),
        )
        for what, want, found in expected:
            if want is not None and want != found:
                result.problems.append(
                    Problem(str(cf.path), 0, "header", f"{what} is {found}, expected {want}")
                )

    def _check_data_checksum(self, cf: ChunkFile, result: CheckResult) -> None:
        footer = cf.footer
        if footer is None:
            return
        computed = data_checksum(cf)
        if computed != footer.checksum:
            result.problems.append(
                Problem(
                    str(cf.path),
                    cf.size - FOOTER_SIZE,
                    "checksum",
                    "footer data checksum (header, data and position map) mismatch: expected "
                    f"0x{footer.checksum:x}, found 0x{computed:x}",
                )
            )
