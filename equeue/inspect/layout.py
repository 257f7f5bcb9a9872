"""Read-only access to a store directory and its chunk files.

Nothing here takes the writer's LOCK, creates a file or opens one for writing, so
the inspector is safe beside a running writer and on a copy of a store. Damage is
recorded as a ``Problem`` instead of raised, so one bad file does not hide the rest.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

from equeue.atomicfile import read_json
from equeue.chunks.recovery import TailHint, nonzero_extent, scan_fixed, scan_variable
from equeue.errors import CorruptionError, NewerFormatError, UsageError
from equeue.format.chunk import (
    FOOTER_SIZE,
    FRAME_OVERHEAD,
    FRAME_PREFIX,
    FRAME_PREFIX_SIZE,
    HEADER_SIZE,
    MAP_ENTRY_SIZE,
    TIMESTAMP,
    ChunkFooter,
    ChunkHeader,
    chunk_file_size,
    parse_chunk_file_name,
)
from equeue.format.livetail import LiveTail
from equeue.format.message import QUEUE_RECORD, QUEUE_RECORD_SIZE
from equeue.format.topicsjournal import TOPICS_JOURNAL_FILE
from equeue.inspect.leading import read_leading
from equeue.safepath import check_chunk_dir, check_dir
from equeue.store.livetail import current_boot_id, read_live_tail
from equeue.store.losses import scan_topic_dir
from equeue.store.meta import (
    CHECKPOINT_FILE,
    CONSUMERS_DIR,
    IDENTITY_FILE,
    MESSAGES_DIR,
    OFFSETS_FILE,
    QUEUES_DIR,
    TOPICS_FILE,
    check_format,
    check_layout,
    check_offsets,
    lost_identity,
)
from equeue.store.offsets import GroupFiles
from equeue.store.recovery import tail_hint
from equeue.store.topics import deletions, topic_entries
from equeue.store.topicsfile import Journal, replay

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)


@dataclass(frozen=True, slots=True)
class Problem:
    file: str
    offset: int | None  # file offset; None when the problem is not at one place in a file
    kind: str  # "header", "footer", "checksum", "record", "torn tail", "queue entry", ...
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "offset": self.offset, "kind": self.kind, "reason": self.reason}


def describe(exc: CorruptionError) -> str:
    """The error's reason and values, without its file and offset (a Problem has those)."""
    text = exc.reason
    if exc.expected is not None or exc.found is not None:
        text += f": expected {_hex(exc.expected)}, found {_hex(exc.found)}"
    if exc.remedy is not None:
        text += f"; {exc.remedy}"
    return text


def _hex(value: int | bytes | None) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, bytes):
        return "0x" + value.hex() if value else "no bytes"
    return f"0x{value:x}"


def problem_from(exc: CorruptionError, kind: str, file: Path | str) -> Problem:
    return Problem(exc.file or str(file), exc.offset, kind, describe(exc))


def newer_problem(exc: NewerFormatError) -> Problem:
    """A file of a newer equeue: one problem, and nothing derived from what it holds."""
    return Problem(exc.file, exc.offset, "newer format", exc.reason)


# --- the store directory ---------------------------------------------------------


@dataclass
class StoreFiles:
    """What a store's metadata files say; a damaged file is in ``problems``, not raised."""

    path: Path
    store_id: int | None = None
    chunk_data_size: int | None = None
    queue_chunk_records: int | None = None
    topics: dict[str, int] = field(default_factory=dict)  # topic -> queue count
    topics_known: bool = True  # False when topics.json or topics.journal was unreadable
    deleted: dict[str, int] = field(default_factory=dict)  # topic: its deletion's position
    journal_records: int = 0  # topics.journal's records, not yet folded into topics.json
    offsets: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    checkpoint: int | None = None
    live_tail: LiveTail | None = None  # tail.live, if this boot wrote it
    log_tail: TailHint | None = None  # the checkpoint's, where recovery's scan may start
    problems: list[Problem] = field(default_factory=list)
    # The topic directories as found (queue ids, whether one holds chunk files), and the
    # names skipped with why: listed once, for open_store and verify's topic checks.
    dir_topics: dict[str, tuple[list[int], bool]] = field(default_factory=dict)
    dir_skipped: list[tuple[Path, str]] = field(default_factory=list)
    # Chunk directories' listings taken by open_store's checks, each handed out once by
    # chunk_paths (a reader that must see the directory as it is now lists it again).
    listings: dict[Path, list[str]] = field(default_factory=dict)
    _queue_dirs: dict[tuple[str, int], Path] = field(default_factory=dict)

    @property
    def messages_dir(self) -> Path:
        return self.path / MESSAGES_DIR

    def queue_dir(self, topic: str, queue_id: int) -> Path:
        key = (topic, queue_id)
        found = self._queue_dirs.get(key)
        if found is None:
            # One parse of a string, not three joins: 10,000 of these per command.
            found = self._queue_dirs[key] = Path(f"{self.path}/{QUEUES_DIR}/{topic}/{queue_id}")
        return found

    def chunk_paths(self, directory: Path) -> list[tuple[int, int, Path]]:
        """chunk_paths(directory), from open_store's listing the first time."""
        return chunk_paths(directory, self.listings.pop(directory, None))

    def queues(self) -> Iterator[tuple[str, int]]:
        for topic in sorted(self.topics):
            for queue_id in range(self.topics[topic]):
                yield topic, queue_id


def open_store(path: Path) -> StoreFiles:
    """The metadata of the store at ``path``; UsageError if it is not a store."""
    if not path.exists():
        raise UsageError(f"{path}: no such file or directory")
    if not path.is_dir():
        raise UsageError(f"{path} is not a store directory (inspect a chunk file with 'inspect')")
    check_layout(path)  # a link or a file of the wrong kind: StorePathError, nothing read
    if not (path / IDENTITY_FILE).is_file():
        lost = lost_identity(path)
        if lost is not None:
            raise lost
        hint = ""
        if any(parse_chunk_file_name(name) for name in os.listdir(path)):
            hint = "; it holds chunk files: inspect one with 'equeue inspect FILE'"
        elif (path.parent / IDENTITY_FILE).is_file() or (
            path.parent.parent / IDENTITY_FILE
        ).is_file():
            hint = "; the store is a directory above it"
        raise UsageError(f"{path} is not an equeue store: it has no {IDENTITY_FILE}{hint}")
    store = StoreFiles(path)
    identity = _read_meta(store, IDENTITY_FILE)
    if isinstance(identity, dict):
        check_format(path / IDENTITY_FILE, identity)  # the layout below may not be ours
        store.store_id = _int_or_none(identity.get("store_id"))
        store.chunk_data_size = _int_or_none(identity.get("chunk_data_size"))
        store.queue_chunk_records = _int_or_none(identity.get("queue_chunk_records"))
    topics = _with_journal(store, _read_meta(store, TOPICS_FILE, default={}))
    if isinstance(topics, dict):
        store.deleted = deletions(topics)  # the log keeps their records until retention
        for topic, info in topics.items():
            try:  # as the store checks it at open: a bad name is reported, never followed
                entries = topic_entries({topic: info}, path)  # none: a deleted topic
            except CorruptionError as exc:
                store.problems.append(problem_from(exc, "metadata", path / TOPICS_FILE))
            else:
                for _, count, _ in entries:
                    store.topics[str(topic)] = count
    else:
        store.topics_known = False
        if topics is not None:  # checksummed, but not written by equeue
            why = f"its body is a {type(topics).__name__}, not an object of topics"
            store.problems.append(Problem(str(path / TOPICS_FILE), None, "metadata", why))
    _add_queue_directories(store)
    for topic in store.topics:  # before anything under them is looked at
        check_dir(path / QUEUES_DIR / topic)
    # A queue directory the topic scan found is a directory, not a link (scan_topic_dir
    # skips those): only the others are checked again, as safepath.check_chunk_dirs does.
    seen = {(t, q) for t, (ids, _) in store.dir_topics.items() for q in ids}
    for key in [None, *store.queues()]:
        directory = store.messages_dir if key is None else store.queue_dir(*key)
        if key in seen or check_dir(directory):
            names = store.listings[directory] = os.listdir(directory)
            check_chunk_dir(directory, names)
    offsets = _read_meta(store, OFFSETS_FILE, default={})
    if isinstance(offsets, dict):
        store.offsets = offsets
    _add_group_files(store)
    checkpoint = _read_meta(store, CHECKPOINT_FILE, default={})
    if isinstance(checkpoint, dict):
        store.checkpoint = _int_or_none(checkpoint.get("log_position"))
        store.log_tail = tail_hint(checkpoint)
    boot = current_boot_id()
    store.live_tail = None if boot is None else read_live_tail(path, boot)
    return store


def _with_journal(store: StoreFiles, topics: Any) -> Any:
    """topics.json's body with topics.journal replayed over it, as the store's open does
    (equeue/store/topicsfile.py); a torn tail (a writer killed in an append: its open
    cuts it) and a damaged or hostile journal are problems."""
    path = store.path / TOPICS_JOURNAL_FILE
    try:
        journal = Journal(path).read()
        store.journal_records = len(journal.records)
        if journal.tail_reason is not None:
            why = (
                f"{journal.size - journal.end} bytes of a torn append ({journal.tail_reason}); "
                "a writer's open cuts them (copied to recovered/)"
            )
            store.problems.append(Problem(str(path), journal.end, "metadata", why))
        return replay(topics, journal) if isinstance(topics, dict) else topics
    except (CorruptionError, NewerFormatError) as exc:
        problem = (
            newer_problem(exc)
            if isinstance(exc, NewerFormatError)
            else problem_from(exc, "metadata", path)
        )
        store.problems.append(problem)
        # the topics it created or deleted are unknown: a record of a topic it deleted is
        # no problem of the log's (review 38e E12: verify named one as a second problem)
        store.topics_known = False
        return topics


def _read_meta(store: StoreFiles, name: str, default: Any = None) -> Any:
    path = store.path / name
    try:
        body = read_json(path)
        # offsets.json's entries are checked as the store's open checks them: one it
        # refuses is a problem here too
        return check_offsets(body, path) if name == OFFSETS_FILE else body
    except FileNotFoundError:
        return default
    except CorruptionError as exc:
        store.problems.append(problem_from(exc, "metadata", path))
        return None


def _add_group_files(store: StoreFiles) -> None:
    """The offsets read-only consumers committed (consumers/), as every handle reads them:
    per queue, the larger value; a file that is not a group's is a problem."""
    files = GroupFiles(store.path, [], writer=False)
    for group, topics in files.scan().items():
        mine = store.offsets.setdefault(group, {})
        for topic, queues in topics.items():
            into = mine.setdefault(topic, {})
            for queue_id, offset in queues.items():
                if not isinstance(into.get(queue_id), int) or offset > into[queue_id]:
                    into[queue_id] = offset
    for exc, done in files.found:
        where = exc.file or str(store.path / CONSUMERS_DIR)
        store.problems.append(Problem(where, exc.offset, "metadata", f"{describe(exc)}; {done}"))


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _add_queue_directories(store: StoreFiles) -> None:
    """Queues on disk that topics.json does not list (it may be damaged, or a topic is
    being created right now: its directories appear before topics.json is rewritten)."""
    root = store.path / QUEUES_DIR
    if not root.is_dir():
        return
    for topic in sorted(os.listdir(root)):
        if (root / topic).is_symlink():
            check_dir(root / topic)  # raises: a link is never followed
        if not (root / topic).is_dir():
            continue
        # Names checked as the store checks them, which never opens the others (verify
        # reports them: traces._topic_problems).
        bad: list[tuple[Path, str]] = []
        ids, _ = store.dir_topics[topic] = scan_topic_dir(root / topic, bad)
        store.dir_skipped += bad
        if ids:
            store.topics[topic] = max(store.topics.get(topic, 0), max(ids) + 1)


# --- chunk files -------------------------------------------------------------------


@dataclass
class ChunkFile:
    """One chunk file as found on disk: header, footer, and where its data ends."""

    path: Path
    size: int
    allocated: int
    name_number: int | None
    name_version: int | None
    header: ChunkHeader | None = None
    footer: ChunkFooter | None = None
    footer_blank: bool = False
    data_end: int = 0  # physical bytes of the data area in use
    records: int = 0
    first_ns: int | None = None
    last_ns: int | None = None
    scan_problem: str | None = None  # why the scan of an ongoing chunk stopped early
    problems: list[Problem] = field(default_factory=list)
    # The file's leading bytes, past which it holds only zeros, when it was read that way
    # (leading.py); a reader drops it once done with the chunk.
    content: bytes | None = None

    @property
    def state(self) -> str:
        if self.header is None:
            return "damaged"
        if self.footer is None:
            # A compacted chunk is never ongoing: without its footer its map is lost.
            return "damaged" if self.header.compacted else "ongoing"
        return "compacted" if self.header.compacted else "completed"

    @property
    def start_number(self) -> int:
        if self.header is not None:
            return self.header.chunk_start_number
        return self.name_number if self.name_number is not None else -1

    @property
    def end_number(self) -> int:
        return self.header.chunk_end_number if self.header is not None else self.start_number

    @property
    def start_position(self) -> int:
        return self.header.start_position if self.header is not None else 0

    @property
    def logical_size(self) -> int:
        return self.footer.logical_data_size if self.footer is not None else self.data_end

    @property
    def map_bytes(self) -> int:
        footer = self.footer
        if footer is None or self.header is None or not self.header.compacted:
            return 0
        return footer.map_entry_count * MAP_ENTRY_SIZE

    @property
    def available(self) -> int:
        """Bytes of the data area the file really holds (a torn file may be short)."""
        if self.header is None:
            return 0
        return max(0, min(self.header.chunk_data_size, self.size - HEADER_SIZE))

    @property
    def data_limit(self) -> int:
        """End of the data a reader may look at: the footer's size, or the whole area."""
        return self.footer.physical_data_size if self.footer is not None else self.available


def map_file(path: Path) -> mmap.mmap:
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def load_chunk_file(path: Path, *, last: bool = True) -> ChunkFile:
    """Read a chunk file's header and footer; scan an ongoing chunk for its valid end.

    ``last``: the file is the last of its directory, so a missing or torn footer means
    "ongoing" (recovery would cut it) rather than damage. FileNotFoundError if the file
    was removed meanwhile (retention on a live store).
    """
    lead = read_leading(path)
    st = lead.stat
    parsed = parse_chunk_file_name(path.name)
    cf = ChunkFile(
        path,
        st.st_size,
        st.st_blocks * 512,
        parsed[0] if parsed else None,
        parsed[1] if parsed else None,
    )
    if lead.content is not None and _load_leading(cf, lead.content, last=last):
        return cf
    with open(path, "rb") as f:
        raw_header = f.read(HEADER_SIZE)
        try:
            cf.header = ChunkHeader.unpack(raw_header, file=str(path))
        except CorruptionError as exc:
            cf.problems.append(problem_from(exc, "header", path))
            return cf
        _read_footer(cf, f, last=last)
    if cf.footer is None:
        if not cf.header.compacted:  # a compacted one's frames are not at their positions
            _scan(cf)
    else:
        cf.data_end = cf.footer.physical_data_size
        cf.records = cf.footer.record_count
        cf.first_ns, cf.last_ns = cf.footer.first_timestamp, cf.footer.last_timestamp
    return cf


def _load_leading(cf: ChunkFile, content: bytes, *, last: bool) -> bool:
    """An ongoing fixed-size chunk (a queue's) from its leading bytes: what the general
    path finds for it, with no other read. False when the file is of another kind or
    shape, which the general path reads (and reports on)."""
    if len(content) < HEADER_SIZE:
        return False
    try:
        header = ChunkHeader.unpack(content[:HEADER_SIZE], file=str(cf.path))
    except CorruptionError:
        return False
    record_size = header.record_size
    if not last or not record_size or header.compacted:
        return False  # a blank footer is a problem there, or a map to read, or frames
    if cf.size != chunk_file_size(header.chunk_data_size) or len(content) > cf.size - FOOTER_SIZE:
        return False  # a torn file size, or a footer (partly) written
    cf.header = header
    cf.footer_blank = True  # the footer area lies in the hole: ongoing, as _read_footer says
    # Zeros after the content are the file's own bytes (the hole): one empty slot past the
    # data, so that the scan and the readers find the end inside the buffer.
    used = len(content) - HEADER_SIZE
    upto = min(cf.available, (used // record_size + 2) * record_size)
    if upto > used:
        content += bytes(upto - used)
    result = scan_fixed(content, cf.available, record_size)
    cf.data_end, cf.records, cf.scan_problem = result.data_end, result.record_count, result.problem
    cf.content = content
    return True


def _read_footer(cf: ChunkFile, f: BinaryIO, *, last: bool) -> None:
    # Mirrors equeue.chunks.footer.read_footer: a non-compacted chunk has its footer only at
    # full size; a short or long last chunk is ongoing and recovery would resize it.
    header = cf.header
    assert header is not None
    full = chunk_file_size(header.chunk_data_size)
    path = str(cf.path)
    tail = "torn tail" if last and not header.compacted else "file size"
    if cf.size < HEADER_SIZE + FOOTER_SIZE or (not header.compacted and cf.size != full):
        cf.problems.append(
            Problem(path, cf.size, tail, f"chunk file is {cf.size} bytes, expected {full}")
        )
        return
    at = cf.size - FOOTER_SIZE
    f.seek(at)
    raw = f.read(FOOTER_SIZE)
    if ChunkFooter.is_blank(raw):
        cf.footer_blank = True
        if not last or header.compacted:
            cf.problems.append(
                Problem(path, at, "footer", "no footer, but the chunk is not the last one")
            )
        return
    try:
        footer = ChunkFooter.unpack(raw, file=path, offset=at)
    except CorruptionError as exc:
        kind = "torn tail" if tail == "torn tail" else "footer"
        cf.problems.append(problem_from(exc, kind, path))
        return
    if not footer.completed:
        cf.problems.append(Problem(path, at, "footer", "footer without the completed flag"))
        return
    capacity = header.chunk_data_size * (header.chunk_end_number - header.chunk_start_number + 1)
    if footer.physical_data_size > capacity:
        cf.problems.append(
            Problem(
                path,
                at,
                "footer",
                f"footer physical data size {footer.physical_data_size} exceeds the data "
                f"area ({capacity})",
            )
        )
        return
    cf.footer = footer


def _scan(cf: ChunkFile) -> None:
    """The valid end of an ongoing chunk, found the way recovery finds it."""
    header = cf.header
    assert header is not None
    if cf.size <= HEADER_SIZE:
        return
    mm = map_file(cf.path)
    try:
        if header.record_size:
            result = scan_fixed(mm, cf.available, header.record_size)
        else:
            result = scan_variable(mm, cf.available, header.chunk_data_size - FRAME_OVERHEAD)
        cf.data_end, cf.records, cf.scan_problem = (
            result.data_end,
            result.record_count,
            result.problem,
        )
        ts = header.timestamp_offset
        if ts is not None and cf.records and not header.record_size:
            # The last frame's length suffix says where that frame starts.
            end = HEADER_SIZE + cf.data_end
            (length,) = FRAME_PREFIX.unpack_from(mm, end - FRAME_PREFIX_SIZE)
            last = end - length - FRAME_OVERHEAD
            (cf.first_ns,) = TIMESTAMP.unpack_from(mm, HEADER_SIZE + FRAME_PREFIX_SIZE + ts)
            (cf.last_ns,) = TIMESTAMP.unpack_from(mm, last + FRAME_PREFIX_SIZE + ts)
    finally:
        mm.close()


def data_checksum(cf: ChunkFile, progress: Callable[[int], None] | None = None) -> int:
    """xxh3_64 of header + data + position map, as the footer's checksum field covers."""
    assert cf.footer is not None
    stop = HEADER_SIZE + cf.footer.physical_data_size + cf.map_bytes
    hasher = xxhash.xxh3_64()
    mm = map_file(cf.path)
    try:
        with memoryview(mm) as view:
            block = 1 << 20
            for start in range(0, stop, block):
                hasher.update(view[start : min(stop, start + block)])
                if progress is not None:
                    progress(min(stop, start + block))
    finally:
        mm.close()
    return int(hasher.intdigest())


def trailing_bytes(cf: ChunkFile, start: int) -> int:
    """One past the last non-zero byte of the data area from data offset ``start`` on
    (``start`` itself when the rest is zero): bytes past an ongoing chunk's valid end."""
    content = cf.content
    if content is not None:
        at = HEADER_SIZE + start
        if at >= len(content) or content[at:] == bytes(len(content) - at):  # a memcmp
            return start
        return len(content.rstrip(b"\0")) - HEADER_SIZE
    fd = os.open(cf.path, os.O_RDONLY)
    try:
        stop = HEADER_SIZE + cf.available
        return nonzero_extent(fd, HEADER_SIZE + start, stop) - HEADER_SIZE
    finally:
        os.close(fd)


# --- chunk directories ---------------------------------------------------------------


@dataclass
class ChunkDir:
    """The chunk files of one directory, resolved as ChunkManager would load them."""

    directory: Path
    files: list[ChunkFile] = field(default_factory=list)  # winners, by chunk number
    superseded: list[ChunkFile] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)  # version overlaps and gaps

    @property
    def first_position(self) -> int:
        return self.files[0].start_position if self.files else 0

    @property
    def end_position(self) -> int:
        """Just past the last committed record, as ChunkManager.committed_position."""
        if not self.files:
            return 0
        last = self.files[-1]
        if last.header is None:
            return 0
        if last.footer is not None:
            return last.header.end_position
        return last.start_position + last.data_end


def chunk_paths(directory: Path, names: list[str] | None = None) -> list[tuple[int, int, Path]]:
    """(start number, version, path) of every chunk file, in that order; temp files skipped.
    ``names``: the directory's listing, if the caller has it."""
    if names is None:
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return []
    found = []
    for name in names:
        parsed = parse_chunk_file_name(name)
        if parsed is not None:
            found.append((parsed[0], parsed[1], directory / name))
    return sorted(found)


def load_chunk_dir(directory: Path, names: list[str] | None = None) -> ChunkDir:
    paths = chunk_paths(directory, names)
    loaded: list[ChunkFile] = []
    for i, (_, _, path) in enumerate(paths):
        with contextlib.suppress(FileNotFoundError):  # removed by retention meanwhile
            cf = load_chunk_file(path, last=i == len(paths) - 1)
            cf.content = None  # a summary of 10,000 queues keeps what it found, not the bytes
            loaded.append(cf)
    return resolve(directory, loaded)


def resolve(directory: Path, loaded: list[ChunkFile]) -> ChunkDir:
    """Keep, for every chunk number, the highest version covering it (as the loader does);
    record partly replaced files and gaps instead of raising."""
    result = ChunkDir(directory)
    claimed: dict[int, ChunkFile] = {}
    for cf in sorted(loaded, key=lambda c: -(c.name_version or 0)):
        numbers = range(cf.start_number, cf.end_number + 1)
        taken = [n in claimed for n in numbers]
        if not any(taken):
            for n in numbers:
                claimed[n] = cf
            result.files.append(cf)
        elif not all(taken):
            result.problems.append(
                Problem(
                    str(cf.path),
                    None,
                    "header",
                    f"chunk file covers chunks {numbers.start}..{numbers.stop - 1}, only partly "
                    "replaced by a newer version",
                )
            )
        else:
            result.superseded.append(cf)
    result.files.sort(key=lambda c: c.start_number)
    for prev, cf in zip(result.files, result.files[1:], strict=False):
        if cf.start_number != prev.end_number + 1:
            result.problems.append(
                Problem(
                    str(directory),
                    None,
                    "missing chunk",
                    f"chunks {prev.end_number + 1}..{cf.start_number - 1} are missing between "
                    f"{prev.path.name} and {cf.path.name}",
                )
            )
    return result


def read_queue_entry(chunks: ChunkDir, offset: int) -> tuple[int, int] | None:
    """(message position, tag hash) at a queue offset, or None if nothing valid is there;
    FileNotFoundError if its chunk was removed since ``chunks`` was loaded."""
    position = offset * QUEUE_RECORD_SIZE
    for cf in chunks.files:
        if cf.header is None or not cf.start_position <= position < cf.header.end_position:
            continue
        local = position - cf.start_position
        if local + QUEUE_RECORD_SIZE > cf.data_end:
            return None
        if cf.content is not None:
            at = HEADER_SIZE + local
            stored, tag = QUEUE_RECORD.unpack_from(cf.content, at)
            return (stored - 1, tag) if stored > 0 else None
        fd = os.open(cf.path, os.O_RDONLY)
        try:
            raw = os.pread(fd, QUEUE_RECORD_SIZE, HEADER_SIZE + local)
        finally:
            os.close(fd)
        if len(raw) < QUEUE_RECORD_SIZE:
            return None
        stored, tag = QUEUE_RECORD.unpack(raw)
        return (stored - 1, tag) if stored > 0 else None
    return None
