"""What ``equeue inspect`` shows: a store summary, or every field of one chunk file.

Both are plain dataclasses with raw numbers (bytes, ns); render.py makes them human.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import xxhash

from equeue.errors import CorruptionError, UsageError
from equeue.format.chunk import (
    _CHECKED_PREFIX,
    FOOTER_SIZE,
    HEADER_MAGIC,
    HEADER_SIZE,
    ChunkFooter,
    ChunkHeader,
    ChunkType,
)
from equeue.format.message import QUEUE_RECORD_SIZE, STORED_TIME_OFFSET
from equeue.inspect.layout import (
    ChunkDir,
    ChunkFile,
    Problem,
    Progress,
    StoreFiles,
    data_checksum,
    load_chunk_dir,
    load_chunk_file,
    open_store,
    read_queue_entry,
)
from equeue.inspect.traces import missing_problems


@dataclass
class ChunkSummary:
    file: str
    state: str  # ongoing, completed, compacted, damaged
    start_number: int
    end_number: int
    start_position: int | None  # None when the header is damaged
    end_position: int | None
    physical_size: int
    logical_size: int
    file_size: int
    records: int
    first_stored_ns: int | None
    last_stored_ns: int | None


@dataclass
class QueueSummary:
    queue_id: int
    first_offset: int
    next_offset: int
    chunk_count: int

    @property
    def messages(self) -> int:
        return self.next_offset - self.first_offset


@dataclass
class TopicSummary:
    topic: str
    queues: list[QueueSummary]


@dataclass
class GroupLag:
    group: str
    topic: str
    queue_id: int
    committed_offset: int
    next_offset: int | None  # None when the store has no such queue
    lag: int | None


@dataclass
class StoreSummary:
    store: str
    store_id: int | None
    chunk_data_size: int | None
    queue_chunk_records: int | None
    checkpoint_position: int | None
    # Where recovery after a killed writer would start (tail.live of this boot), if it
    # names a chunk of the log.
    live_tail_position: int | None
    first_position: int
    end_position: int
    records: int
    message_chunks: list[ChunkSummary]
    topics: list[TopicSummary]
    groups: list[GroupLag]
    apparent_bytes: int
    allocated_bytes: int
    file_count: int
    # What the files hold: each chunk's header, data, position map and footer, and the
    # other files whole; allocated_bytes less this is the room allocated ahead of writers.
    data_bytes: int = 0
    journal_records: int = 0  # topics.journal's records not yet folded into topics.json
    problems: list[Problem] = field(default_factory=list)  # noticed in passing; see verify

    def to_json(self) -> dict[str, Any]:
        doc = dataclasses.asdict(self)
        for topic, summary in zip(doc["topics"], self.topics, strict=True):
            for queue, q in zip(topic["queues"], summary.queues, strict=True):
                queue["messages"] = q.messages
        doc["problems"] = [p.to_json() for p in self.problems]
        return doc


def _live_tail_position(store: StoreFiles, files: list[ChunkFile]) -> int | None:
    live = store.live_tail
    if live is None:
        return None
    for cf in files:
        if cf.header is not None and cf.header.chunk_id == live.chunk_id:
            return cf.header.start_position + live.data_end
    return None


def chunk_summary(cf: ChunkFile) -> ChunkSummary:
    header = cf.header
    return ChunkSummary(
        file=str(cf.path),
        state=cf.state,
        start_number=cf.start_number,
        end_number=cf.end_number,
        start_position=header.start_position if header is not None else None,
        end_position=header.end_position if header is not None else None,
        physical_size=cf.data_end,
        logical_size=cf.logical_size,
        file_size=cf.size,
        records=cf.records,
        first_stored_ns=cf.first_ns,
        last_stored_ns=cf.last_ns,
    )


def summarize_store(path: Path, progress: Progress | None = None) -> StoreSummary:
    """``progress``: called with (queues read, queues in all) as the queues are read."""
    store = open_store(path)
    problems = list(store.problems)
    # Queues before messages: on a live store every entry then points at a message
    # written before the message files are read.
    keys = list(store.queues())
    queue_dirs = {}
    for i, key in enumerate(keys):
        directory = store.queue_dir(*key)
        queue_dirs[key] = load_chunk_dir(directory, store.listings.pop(directory, None))
        if progress is not None and (i % 256 == 0 or i == len(keys) - 1):
            progress(i + 1, len(keys))
    messages = load_chunk_dir(store.messages_dir, store.listings.pop(store.messages_dir, None))
    problems += messages.problems
    for cf in messages.files:
        problems += cf.problems
    topics: dict[str, list[QueueSummary]] = {}
    next_offsets: dict[tuple[str, int], int] = {}
    for (topic, queue_id), chunks in queue_dirs.items():
        problems += chunks.problems
        for cf in chunks.files:
            problems += cf.problems
        summary = _queue_summary(queue_id, chunks, messages.first_position)
        topics.setdefault(topic, []).append(summary)
        next_offsets[topic, queue_id] = summary.next_offset
    dirs = {store.messages_dir: messages}
    dirs |= {store.queue_dir(*key): chunks for key, chunks in queue_dirs.items()}
    problems += missing_problems(store, dirs, store.checkpoint, check_key_index=False)
    chunk_files = [*messages.files, *(cf for chunks in queue_dirs.values() for cf in chunks.files)]
    apparent, allocated, files, held = disk_use(path, chunk_files)
    return StoreSummary(
        store=str(path),
        store_id=store.store_id,
        chunk_data_size=store.chunk_data_size,
        queue_chunk_records=store.queue_chunk_records,
        checkpoint_position=store.checkpoint,
        live_tail_position=_live_tail_position(store, messages.files),
        first_position=messages.first_position,
        end_position=messages.end_position,
        records=sum(cf.records for cf in messages.files),
        message_chunks=[chunk_summary(cf) for cf in messages.files],
        topics=[TopicSummary(t, topics[t]) for t in sorted(topics)],
        groups=_group_lags(store, next_offsets),
        apparent_bytes=apparent,
        allocated_bytes=allocated,
        file_count=files,
        data_bytes=held,
        journal_records=store.journal_records,
        problems=problems,
    )


def disk_use(path: Path, chunk_files: Iterable[ChunkFile]) -> tuple[int, int, int, int]:
    """(apparent bytes, allocated bytes, file count, data bytes) of everything under
    ``path``, in one walk. Data bytes (StoreSummary.data_bytes) are what the files hold,
    not their nominal size: a chunk file is as large as a full chunk from its creation
    on. The chunk files already read are not stat'ed again."""
    chunks = {str(cf.path): cf for cf in chunk_files}
    apparent = allocated = files = data = 0
    pending = [str(path)]
    while pending:
        try:
            entries = list(os.scandir(pending.pop()))
        except (FileNotFoundError, NotADirectoryError):
            continue  # removed by the writer (retention) meanwhile
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                pending.append(entry.path)
                continue
            cf = chunks.get(entry.path)
            if cf is not None:
                size, blocks = cf.size, cf.allocated
            else:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed by the writer (retention, a temp file) meanwhile
                size, blocks = st.st_size, st.st_blocks * 512  # 512-byte units (POSIX)
            apparent += size
            allocated += blocks
            files += 1
            if cf is None:
                data += size
            elif cf.header is not None:
                footer = FOOTER_SIZE if cf.footer is not None else 0
                data += HEADER_SIZE + cf.data_end + cf.map_bytes + footer
    return apparent, allocated, files, data


def _queue_summary(queue_id: int, chunks: ChunkDir, first_message: int) -> QueueSummary:
    first = chunks.first_position // QUEUE_RECORD_SIZE
    following = chunks.end_position // QUEUE_RECORD_SIZE
    if first_message > 0:
        # As the store does after retention: the first offset whose message still exists.
        lo, hi = first, following
        while lo < hi:
            mid = (lo + hi) // 2
            try:
                entry = read_queue_entry(chunks, mid)
            except FileNotFoundError:
                # Retention removed that queue chunk since the listing, which it does only
                # once its entries all point below the log (review17 R17-3: the errno's
                # text ended `equeue inspect` beside a retaining writer).
                lo = mid + 1
                continue
            if entry is not None and entry[0] < first_message:
                lo = mid + 1
            else:
                hi = mid
        first = lo
    return QueueSummary(queue_id, first, following, len(chunks.files))


def _group_lags(store: StoreFiles, next_offsets: dict[tuple[str, int], int]) -> list[GroupLag]:
    lags = []
    for group in sorted(store.offsets):
        topics = store.offsets[group]
        if not isinstance(topics, dict):
            continue
        for topic in sorted(topics):
            queues = topics[topic]
            if not isinstance(queues, dict):
                continue
            for queue_id in sorted(queues, key=lambda q: int(q) if q.isdigit() else -1):
                committed = queues[queue_id]
                if not queue_id.isdigit() or not isinstance(committed, int):
                    continue
                following = next_offsets.get((topic, int(queue_id)))
                lag = None if following is None else following - committed
                lags.append(GroupLag(group, topic, int(queue_id), committed, following, lag))
    return lags


# --- one chunk file --------------------------------------------------------------------


@dataclass
class Checksum:
    stored: int
    computed: int

    @property
    def ok(self) -> bool:
        return self.stored == self.computed

    def to_json(self) -> dict[str, Any]:
        return {"stored": self.stored, "computed": self.computed, "ok": self.ok}


@dataclass
class FileSummary:
    file: str
    file_size: int
    allocated_bytes: int
    kind: str  # message chunk, queue chunk, or the bare chunk type
    state: str
    header: dict[str, Any] | None
    header_checksum: Checksum
    footer: dict[str, Any] | None  # None when the footer area is blank or undecodable
    footer_blank: bool  # the all-zero footer area of an ongoing chunk
    footer_checksum: Checksum | None
    data_checksum: Checksum | None  # completed chunks: xxh3_64 of header + data + map
    position_map_entries: int
    position_map_bytes: int
    data_used: int
    records: int
    first_timestamp_ns: int | None
    last_timestamp_ns: int | None
    scan_problem: str | None
    problems: list[Problem]

    def to_json(self) -> dict[str, Any]:
        doc = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("header_checksum", "footer_checksum", "data_checksum"):
            value = getattr(self, name)
            doc[name] = value.to_json() if value is not None else None
        doc["problems"] = [p.to_json() for p in self.problems]
        return doc


T = TypeVar("T")


def _unverified(raw: bytes, unpack: Callable[[bytes], T]) -> tuple[T | None, Checksum]:
    """Decode a self-checked block even when its checksum fails (an operator wants to see
    the damaged fields), by unpacking a copy that carries the computed checksum.

    Header and footer are both 128 bytes checked the same way (format.chunk: xxh32 of
    the first _CHECKED_PREFIX bytes, stored after them), so one function serves both.
    """
    stored = int.from_bytes(raw[_CHECKED_PREFIX:HEADER_SIZE], "little")
    computed = xxhash.xxh32_intdigest(raw[:_CHECKED_PREFIX])
    patched = raw[:_CHECKED_PREFIX] + computed.to_bytes(HEADER_SIZE - _CHECKED_PREFIX, "little")
    try:
        return unpack(patched), Checksum(stored, computed)
    except CorruptionError:
        return None, Checksum(stored, computed)


def summarize_file(path: Path) -> FileSummary:
    if not path.exists():
        raise UsageError(f"{path}: no such file or directory")
    if not path.is_file():
        raise UsageError(f"{path} is not a regular file")
    with open(path, "rb") as f:
        raw_header = f.read(HEADER_SIZE)
        if len(raw_header) < HEADER_SIZE or raw_header[: len(HEADER_MAGIC)] != HEADER_MAGIC:
            raise UsageError(
                f"{path} is not a chunk file (no chunk header magic {HEADER_MAGIC!r} at its start)"
            )
        size = f.seek(0, 2)
        raw_footer = b""
        if size >= HEADER_SIZE + FOOTER_SIZE:
            f.seek(size - FOOTER_SIZE)
            raw_footer = f.read(FOOTER_SIZE)
    cf = load_chunk_file(path, last=True)
    header, header_sum = _unverified(raw_header, lambda b: ChunkHeader.unpack(b, file=str(path)))
    footer: ChunkFooter | None = None
    footer_sum = None
    if raw_footer and not ChunkFooter.is_blank(raw_footer):
        footer, footer_sum = _unverified(raw_footer, ChunkFooter.unpack)
    data_sum = None
    if cf.footer is not None:
        data_sum = Checksum(cf.footer.checksum, data_checksum(cf))
        if not data_sum.ok:
            cf.problems.append(
                Problem(
                    str(path),
                    size - FOOTER_SIZE,
                    "checksum",
                    f"footer data checksum mismatch: expected 0x{data_sum.stored:x}, "
                    f"found 0x{data_sum.computed:x}",
                )
            )
    map_entries = cf.footer.map_entry_count if cf.footer and cf.map_bytes else 0
    return FileSummary(
        file=str(path),
        file_size=size,
        allocated_bytes=cf.allocated,
        kind=_kind(header),
        state=cf.state,
        header=_header_fields(header) if header is not None else None,
        header_checksum=header_sum,
        footer=_footer_fields(footer) if footer is not None else None,
        footer_blank=bool(raw_footer) and ChunkFooter.is_blank(raw_footer),
        footer_checksum=footer_sum,
        data_checksum=data_sum,
        position_map_entries=map_entries,
        position_map_bytes=cf.map_bytes,
        data_used=cf.data_end,
        records=cf.records,
        first_timestamp_ns=cf.first_ns,
        last_timestamp_ns=cf.last_ns,
        scan_problem=cf.scan_problem,
        problems=cf.problems,
    )


def _kind(header: ChunkHeader | None) -> str:
    if header is None:
        return "unknown"
    if header.chunk_type == ChunkType.FIXED:
        return "queue chunk" if header.record_size == QUEUE_RECORD_SIZE else "fixed-size chunk"
    return "message chunk" if header.timestamp_offset == STORED_TIME_OFFSET else "variable chunk"


def _header_fields(h: ChunkHeader) -> dict[str, Any]:
    return {
        "magic": HEADER_MAGIC.decode(),
        "version": h.version,
        "chunk_type": h.chunk_type.name.lower(),
        "compacted": h.compacted,
        "has_timestamps": h.timestamp_offset is not None,
        "record_size": h.record_size,
        "timestamp_offset": h.timestamp_offset,
        "chunk_start_number": h.chunk_start_number,
        "chunk_end_number": h.chunk_end_number,
        "chunk_data_size": h.chunk_data_size,
        "chunk_id": str(h.chunk_id),
        "created_at_ns": h.created_at_ns,
        "start_position": h.start_position,
        "end_position": h.end_position,
    }


def _footer_fields(f: ChunkFooter) -> dict[str, Any]:
    return {
        "completed": f.completed,
        "physical_data_size": f.physical_data_size,
        "logical_data_size": f.logical_data_size,
        "map_entry_count": f.map_entry_count,
        "record_count": f.record_count,
        "first_timestamp_ns": f.first_timestamp,
        "last_timestamp_ns": f.last_timestamp,
        "checksum": f.checksum,
    }
