"""topics.json and its journal (``topics.journal``, layout in equeue/format/topicsjournal.py).

A topic change (``create_topic``, ``delete_topic``) is one record appended to the journal
and fdatasynced: that append is its commit point. topics.json is rewritten atomically
("folded": the file, then a fresh journal) when the journal would pass
``JOURNAL_FOLD_BYTES``, at a writable open that finds records in it, and at a clean
close. Readers (the store's open, read-only handles, consumer commits, the inspector)
read topics.json, then replay the journal over it, unless the journal's generation is
below topics.json's (a fold that wrote topics.json but not yet, or never, its fresh
journal: the old journal is folded in already, and older than the file). topics.json's
generation has a checksum of its own: a damaged one is a CorruptionError, never a
journal skipped (equeue/format/topicsjson.py). A journal of generation 1 or more with
records, beside a topics.json without a generation, is refused (``_superseded``: an
equeue before the journal rewrote the file after it); this version's writers never
leave that pair (a journal starts at 1, the first change beside such a file folds).

topics.json is written from pieces encoded once per topic: ``write_json`` of the whole
body encodes every entry twice (the canonical form the checksum covers, and the file's)
on each write; here each topic's two encodings are kept until its entry changes, and a
write joins them (the bytes are exactly ``write_json``'s: tests/test_many_queues.py).
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import xxhash

from equeue.atomicfile import read_json, write_bytes
from equeue.chunks.fileops import fsync_directory, write_error
from equeue.chunks.recovery import TailCut, make_side_dir
from equeue.errors import CorruptionError, EQueueError, StoreWriteError
from equeue.format.topicsjournal import (
    HEADER_SIZE,
    RECORD_HEAD_SIZE,
    TOPICS_JOURNAL_FILE,
    TopicRecord,
    check_header,
    pack_header,
)
from equeue.format.topicsjson import HEAD_BYTES, pack_head, read_generation, without_generation
from equeue.safepath import check_file, open_fd, open_file
from equeue.store import validate
from equeue.store.meta import TOPICS_FILE
from equeue.store.topics import TopicPolicy, topics_body

if TYPE_CHECKING:
    from equeue.store.store import MessageStore

log = logging.getLogger("equeue.recovery")

# The journal is folded into topics.json before it passes this size (about 20,000
# records of short names): replaying it at an open then takes tens of ms at most.
JOURNAL_FOLD_BYTES: Final = 1 << 20
# The longest record (a name's length is a u16): a journal past the bound by more than
# one of these was not written by a writer (which folds first), and is not read.
_MAX_RECORD: Final = RECORD_HEAD_SIZE + 0xFFFF
JOURNAL_READ_LIMIT: Final = JOURNAL_FOLD_BYTES + _MAX_RECORD
# A read-only handle reads topics.json, then the journal, and accepts the pair if
# topics.json was not replaced meanwhile (by a fold); else it reads both again.
_READ_ATTEMPTS: Final = 8

# What every reader's refusal of a damaged journal tells the operator to do
# (equeue/store/topicsrebuild.py; docs/durability.md, "A damaged topics.journal").
REBUILD_REMEDY: Final = (
    "with no writer running, run 'equeue rebuild-topics STORE': it copies the journal to "
    "recovered/, replays every record that still checks out over topics.json and writes "
    "both afresh (moving the journal aside instead loses the topics that only it records "
    "and have no queue directory, and resets the others' policies)"
)
_SIZE_AND_NAME = struct.Struct("<IxxH")  # a record's size and name length (bytes 4..11)
_Key = tuple[int | None, TopicPolicy | None, int | None]
_Identity = tuple[int, int, int, int] | None
_State = tuple[dict[str, int], dict[str, TopicPolicy], dict[str, int]]  # counts, policies, deleted


def _identity(path: Path) -> _Identity:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class Journal:
    """What a read of the journal found: its records, where the valid ones end, and
    whether bytes follow them (a torn append, or junk, ``tail_reason``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[tuple[int, TopicRecord]] = []  # (file offset, record)
        self.end = HEADER_SIZE
        self.size = 0
        self.exists = False
        self.tail_reason: str | None = None
        self.generation = 0
        self.stale = False  # folded into topics.json already: its records are not replayed
        # Beside a topics.json without a generation (an equeue without the journal rewrote
        # it since, or this library's predecessors' recovery did): replay checks each record
        # against that file and refuses one that would undo it (_undoes, review4 R1).
        self.unversioned_beside = False

    def read(self) -> Journal:
        file = str(self.path)
        if not check_file(self.path):  # (a link or a directory: StorePathError)
            return self
        self.exists = True
        with open_file(self.path, "rb") as f:
            limit = JOURNAL_READ_LIMIT
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                raise CorruptionError(
                    f"a topics journal of {size} bytes, more than a writer leaves ({limit}: "
                    "it folds at JOURNAL_FOLD_BYTES)",
                    file=file,
                    offset=limit,
                    remedy=REBUILD_REMEDY,
                )
            raw = f.read(limit + 1)
        self.size = len(raw)
        try:
            self.generation, at = check_header(raw, file)
        except CorruptionError as exc:  # (its subclasses: the same class, told what to do)
            raise type(exc)(
                f"{exc.reason} (the journal's header: its generation, whether topics.json "
                "holds its records already, cannot be trusted)",
                file=exc.file,
                offset=exc.offset,
                expected=exc.expected,
                found=exc.found,
                remedy=REBUILD_REMEDY,
            ) from None
        self.end = at
        # topics.json's generation, read after the journal: a reader that saw topics.json
        # unchanged around both reads (TopicsFile.read) compares the pair it read.
        topics_path = self.path.parent / TOPICS_FILE
        head = _head(topics_path)
        self.stale = self.generation < (
            0 if head is None else read_generation(head, str(topics_path))
        )
        while at < len(raw) and not self.stale:  # a stale one's records are not replayed: not read
            try:
                record, end = TopicRecord.unpack(raw, at, file)
            except CorruptionError as exc:
                if not _torn(raw, at):
                    raise CorruptionError(
                        f"damaged topics journal record ({exc.reason}), with records after "
                        "it: not a torn append",
                        file=file,
                        offset=at,
                        remedy=REBUILD_REMEDY,
                    ) from None
                self.tail_reason = exc.reason
                break
            self.records.append((at, record))
            at = end
        self.end = at
        if self.stale:
            self.records = []
        elif self.records and head is not None and self.generation and without_generation(head):
            self.unversioned_beside = True
        return self


def _undoes(body: dict[str, Any], record: TopicRecord) -> bool:
    """Whether replaying ``record`` over topics.json's ``body`` (written by an equeue
    without the journal after the record) would undo what that version did: bring back a
    topic it deleted (its ``deleted_before`` above the record's: also a topic deleted and
    created again) or hide queues it added (its queue count above the record's). A record
    of a topic the file lacks, or one the file agrees with, undoes nothing: that is the
    pair this library's predecessors left themselves (topics.json rebuilt from the queue
    directories without a generation, a topic change journaled, a crash: review4 R1)."""
    entry = body.get(record.topic)
    if not isinstance(entry, dict):
        return False
    deleted = entry.get("deleted_before")
    if isinstance(deleted, int) and (
        record.deleted_before is None or record.deleted_before < deleted
    ):
        return True
    count = entry.get("queue_count")
    return isinstance(count, int) and record.queue_count is not None and record.queue_count < count


def _superseded(journal: Journal, topics_path: Path, undoing: list[TopicRecord]) -> CorruptionError:
    """A journal of generation 1 or more beside a topics.json without one: a writer of
    this version folded topics.json at that generation, so an equeue without the journal
    rewrote the file since (a downgrade and back), from its own view of the topics (those
    of the journal rebuilt from their queue directories, or not at all). Its changes
    after that (a topic deleted, queues added) are the newer truth; replayed, the
    journal's records would undo them without a word."""
    topics = sorted({record.topic for record in undoing})
    shown = ", ".join(repr(t) for t in topics[:10]) + (", ..." if len(topics) > 10 else "")
    return CorruptionError(
        f"topics.json has no generation, beside {journal.path} of generation "
        f"{journal.generation} holding {len(journal.records)} records, of which "
        f"{len(undoing)} would undo topics.json (topics {shown}): an "
        "equeue without the journal (before 2026-11-25 23:18) rewrote topics.json after this "
        "journal was written, and replaying the journal would undo that version's topic "
        "changes (a deleted topic back with its messages, added queues hidden)",
        file=topics_path,
        offset=0,
        remedy=f"topics.json holds the newer topics: with no writer running, move "
        f"{journal.path} out of the store (keep it: its records hold the policies of its "
        "topics, which that version reset to the defaults) and open the store again; only "
        "if no older equeue ran on the store since the journal's writer is the journal the "
        "newer side: then move topics.json out instead (the open rebuilds the topics from "
        "their queue directories, with default policies, and replays the journal over them)",
    )


def file_generation(path: Path) -> int:
    """The generation at the start of topics.json (0: none, or no file); CorruptionError
    naming the file and the field if it is damaged (equeue/format/topicsjson.py)."""
    head = _head(path)
    return 0 if head is None else read_generation(head, str(path))


def _head(path: Path) -> bytes | None:
    """topics.json's first bytes, None if there is no such file."""
    try:
        with open_file(path, "rb") as f:
            return f.read(HEAD_BYTES)
    except FileNotFoundError:
        return None


def _torn(raw: bytes, at: int) -> bool:
    """Whether the bad bytes at ``at`` are what an append a crash interrupted leaves: the
    last thing in the file (a record cut short, zeros where the size grew but the data
    never came, bytes of a record that did not all reach the disk). A valid record after
    them means something else damaged or wrote the journal (records are appended only
    after the one before is synced, and a writer's open cuts a torn one first)."""
    return not raw[at:].strip(b"\0") or next_record(raw, at + 1) is None


def next_record(raw: bytes, start: int) -> int | None:
    """Where the first record that checks out (size, checksum, flags, name) begins at or
    after ``start``; None if none does."""
    head = _SIZE_AND_NAME
    for at in range(start, len(raw) - RECORD_HEAD_SIZE + 1):
        size, n = head.unpack_from(raw, at + 4)
        if size == RECORD_HEAD_SIZE + n and at + size <= len(raw):
            try:
                TopicRecord.unpack(raw, at, "")
            except CorruptionError:
                continue
            return at
    return None


def replay(body: dict[str, Any], journal: Journal) -> dict[str, Any]:
    """topics.json's ``body`` with the journal's records applied, each checked as
    create_topic() checks its arguments (a name becomes a directory): a record that
    does not pass raises CorruptionError naming the journal and the record's offset."""
    if not journal.records:
        return body
    if journal.unversioned_beside:
        # A topic ends as its last record says (replay applies them in order): only that
        # one is held against the file, so a record the next one overrides never refuses.
        last = {record.topic: record for _, record in journal.records}
        undoing = [record for record in last.values() if _undoes(body, record)]
        if undoing:
            raise _superseded(journal, journal.path.parent / TOPICS_FILE, undoing)
    merged = dict(body)
    for at, record in journal.records:
        try:
            validate.check_topic(record.topic)
            if record.queue_count is not None:
                validate.check_queue_count(record.queue_count)
                TopicPolicy.from_json(record.to_entry(), str(journal.path))
            elif record.deleted_before is None:
                raise CorruptionError("a record with neither a queue count nor a deletion")
        except EQueueError as exc:
            raise CorruptionError(
                f"bad topics journal record for topic {record.topic[:80]!r} ({exc})",
                file=str(journal.path),
                offset=at,
                remedy=REBUILD_REMEDY,
            ) from None
        merged[record.topic] = record.to_entry()
    return merged


def read_topics_body(store_path: Path) -> Any:
    """topics.json's body with the journal replayed over it, as a reader sees the store
    (without the writer's lock): consumer commits, the inspector. Errors as read_json's
    and ``Journal.read``'s."""
    path = store_path / TOPICS_FILE
    return TopicsFile(store_path, writer=False).read(
        lambda: read_json(path) if os.path.lexists(path) else {}  # (none: a new store's)
    )


class TopicsFile:
    def __init__(self, directory: Path, *, writer: bool) -> None:
        self.path = directory / TOPICS_FILE
        self.journal_path = directory / TOPICS_JOURNAL_FILE
        self._writer = writer
        self._pieces: dict[str, tuple[_Key, str, str]] = {}  # topic: (entry, canonical, file)
        self._fd: int | None = None  # the journal, open for appends (a writer's)
        self._size = 0  # the journal's size: where the next record goes
        self._broken = False  # an append failed: the next change folds instead
        self._generation = 0  # the last fold's (topics.json's and the journal's)
        # topics.json has no generation (an older equeue's): the next change folds
        # instead of appending, so that no record this version journals ever lies beside
        # such a file (one that does was written before an older equeue rewrote it:
        # ``_superseded``). Not at the open, which writes nothing it may yet refuse.
        self._unversioned = False
        self._cached: tuple[_Identity, Any] | None = None  # a reader's topics.json
        self.cuts: list[TailCut] = []
        # A writer's open: the journal read and the body to fold it into, written only by
        # finish_open(), once nothing can refuse the open (a refused one leaves both files).
        self._at_open: tuple[Journal, Any] | None = None
        self._recovered: dict[str, Any] | None = None

    # --- reading ---------------------------------------------------------------

    def read(self, read_file: Callable[[], Any]) -> Any:
        """``read_file()`` (topics.json's body) with the journal replayed over it. A writer
        (at its open) cuts a torn tail and folds the journal at finish_open; a reader retries until
        topics.json was not replaced between its read and the journal's."""
        if self._writer:
            body = read_file()
            journal = Journal(self.journal_path).read()
            merged = replay(body, journal) if isinstance(body, dict) else body
            head = _head(self.path)
            on_file = 0 if head is None else read_generation(head, str(self.path))
            # No topics.json yet: the journal starts at generation 1 all the same, so that
            # its records are never at 0 (see _unversioned for one of an older equeue).
            self._generation = max(journal.generation, on_file, 1 if head is None else 0)
            self._unversioned = head is not None and without_generation(head)
            self._at_open = (journal, merged)
            return merged
        for attempt in range(_READ_ATTEMPTS):
            before = _identity(self.path)
            if self._cached is not None and self._cached[0] == before and before is not None:
                body = self._cached[1]
            else:
                body = read_file()
            journal = Journal(self.journal_path).read()
            if _identity(self.path) == before or attempt == _READ_ATTEMPTS - 1:
                self._cached = (before, body)
                return replay(body, journal) if isinstance(body, dict) else body
            self._cached = None
        raise AssertionError("unreachable")

    # --- writing ---------------------------------------------------------------

    def recovered_at_open(self, body: dict[str, Any]) -> None:
        """A writer's open rebuilt topics.json's body (losses.recover_topics): finish_open
        writes it."""
        self._recovered = body

    def finish_open(self) -> None:
        """The writer's open succeeded: the journal read at its start folded (or a fresh
        one started), then a body the open recovered written; the writes, in the order
        an open made them before it deferred them."""
        if self._at_open is None:
            return
        journal, merged = self._at_open
        self._at_open = None
        self._open_journal(journal, merged)
        if self._recovered is not None:
            self.write_body(self._recovered)
            self._recovered = None

    def _open_journal(self, journal: Journal, merged: Any) -> None:
        """A writer's open: a torn tail copied aside, then records folded into topics.json
        and a fresh journal started (also when there was none, or an older version's, or
        one topics.json holds already)."""
        if journal.tail_reason is not None:
            self._cut(journal)
        fresh = journal.exists and journal.end == HEADER_SIZE
        fresh = fresh and journal.generation == self._generation  # (not stale, nor 0 alone)
        if journal.records or journal.tail_reason is not None or not fresh:
            if journal.records and isinstance(merged, dict):
                self.write_body(merged)  # and _reset
            else:
                self._reset()
        else:
            self._size = journal.size
            self._open_fd()

    def _cut(self, journal: Journal) -> None:
        path = journal.path
        with open_file(path, "rb") as f:
            f.seek(journal.end)
            tail = f.read()
        side = make_side_dir(path.parent) / f"{path.name}.{journal.end}.{time.time_ns()}.cut"
        with open_file(side, "xb") as out:
            out.write(tail)
            out.flush()
            os.fsync(out.fileno())
        fsync_directory(side.parent)
        cut = TailCut(str(path), journal.end, len(tail), str(side), str(journal.tail_reason))
        log.warning("recovery: %s", cut)
        self.cuts.append(cut)

    def _open_fd(self) -> None:
        self.close_fd()
        self._fd = open_fd(self.journal_path, os.O_WRONLY | os.O_APPEND)

    def _reset(self) -> None:
        """A fresh journal (its header only), atomically: topics.json holds every record
        of the old one."""
        self.close_fd()
        write_bytes(self.journal_path, pack_header(self._generation))
        self._size = HEADER_SIZE
        self._broken = False
        self._open_fd()

    def record(
        self,
        topic: str,
        count: int | None,
        policy: TopicPolicy | None,
        deleted_at: int | None,
        state: Callable[[], _State],
    ) -> None:
        """Make ``topic``'s entry (its queue count, policy, deletion) durable: one record
        appended, or a fold of ``state()`` (every topic's) when the journal is full or an
        earlier append failed. Raises StoreWriteError with topics.json and the journal as
        they were."""
        entry = topics_body(
            {} if count is None else {topic: count},
            {} if policy is None else {topic: policy},
            {} if deleted_at is None else {topic: deleted_at},
        ).get(topic)
        if entry is None:  # (no record removes an entry)
            self.write(*state())
            return
        data = TopicRecord.from_entry(topic, entry).pack()
        full = self._size + len(data) > JOURNAL_FOLD_BYTES
        if self._fd is None or self._broken or self._unversioned or full:
            self.write(*state())
            return
        try:
            written = os.write(self._fd, data)
            if written != len(data):
                raise OSError(0, f"short write: {written} of {len(data)} bytes")
            os.fdatasync(self._fd)
        except OSError as exc:
            self._undo()
            raise write_error(exc, "appending to the topics journal", self.journal_path) from exc
        self._size += len(data)

    def _undo(self) -> None:
        """A failed append: its bytes cut off, so that the next is not behind them (else
        it could never be read); if even that fails, the next change folds."""
        assert self._fd is not None
        try:
            os.ftruncate(self._fd, self._size)
            os.fdatasync(self._fd)
        except OSError:
            self._broken = True

    def write(
        self, counts: dict[str, int], policies: dict[str, TopicPolicy], deleted: dict[str, int]
    ) -> None:
        """Fold: topics.json rewritten with every topic (and the next generation), then a
        fresh journal. Once topics.json is renamed the change is made: a fresh journal
        that cannot be written is logged, not raised (the old one, of an older
        generation, is not replayed; the next change folds again)."""
        canonical: list[str] = []
        pretty: list[str] = []
        for topic in sorted(counts.keys() | deleted.keys()):
            _, one, two = self._piece(topic, counts, policies, deleted)
            canonical.append(one)
            pretty.append(two)
        for topic in self._pieces.keys() - counts.keys() - deleted.keys():
            del self._pieces[topic]
        self._write_file("{" + ", ".join(pretty) + "}", "{" + ",".join(canonical) + "}")

    def write_body(self, body: dict[str, Any]) -> None:
        """Fold ``body`` (topics.json's, whole): the file at the next generation, then a
        fresh journal."""
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        self._write_file(json.dumps(body, sort_keys=True), canonical)

    def _write_file(self, pretty: str, canonical: str) -> None:
        """topics.json: write_json's bytes, after the writer's generation (from 1: never
        a head an older equeue writes) and its checksum (equeue/format/topicsjson.py)."""
        digest = xxhash.xxh64_hexdigest(canonical.encode())
        generation = self._generation + 1
        head = pack_head(generation)
        write_bytes(
            self.path, (head + '"body": ' + pretty + ', "xxh64": "' + digest + '"}').encode()
        )
        self._generation = generation
        self._unversioned = False
        try:  # (a journal of the old generation, even with no record, would be stale now)
            self._reset()
        except (OSError, EQueueError) as exc:
            log.warning("topics.json written, its fresh journal not (%s): next change folds", exc)
            self.close_fd()
            self._broken = True

    def _piece(
        self,
        topic: str,
        counts: dict[str, int],
        policies: dict[str, TopicPolicy],
        deleted: dict[str, int],
    ) -> tuple[_Key, str, str]:
        key = (counts.get(topic), policies.get(topic), deleted.get(topic))
        cached = self._pieces.get(topic)
        if cached is None or cached[0] != key:
            one = {topic: counts[topic]} if topic in counts else {}
            gone = {topic: deleted[topic]} if topic in deleted else {}
            entry = topics_body(one, policies, gone)[topic]
            name = json.dumps(topic)
            cached = (
                key,
                name + ":" + json.dumps(entry, sort_keys=True, separators=(",", ":")),
                name + ": " + json.dumps(entry, sort_keys=True),
            )
            self._pieces[topic] = cached
        return cached

    def rebuild(self, merged: dict[str, Any], generation: int) -> None:
        """``equeue rebuild-topics`` (a writer's, under the lock): topics.json holding
        ``merged`` at the generation after ``generation``, then a fresh journal of that
        generation; StoreWriteError if the journal could not be written (run it again)."""
        self._generation = generation
        self.write_body(merged)
        written = self._fd is not None
        self.close_fd()
        if not written:
            raise StoreWriteError(
                f"topics.json was written, its fresh journal not (see the log): run again; "
                f"{self.journal_path} is as it was"
            )

    @property
    def journal_records(self) -> bool:
        """Whether the journal holds records topics.json does not (a fold would write)."""
        return self._size > HEADER_SIZE

    def close(
        self, counts: dict[str, int], policies: dict[str, TopicPolicy], deleted: dict[str, int]
    ) -> None:
        """A writer's clean close: the journal folded (the next open replays nothing)."""
        try:
            if self._fd is not None and (self.journal_records or self._broken):
                self.write(counts, policies, deleted)
        finally:
            self.close_fd()

    def close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def topics_state(store: MessageStore) -> _State:
    """Every topic's queue count, policy and deletion: what a fold writes."""
    counts = {topic: len(queues) for topic, queues in store._queues.items()}
    return counts, store._policies, store._deleted


def save_topic(store: MessageStore, topic: str) -> None:
    """``create_topic``'s commit point (under the write lock): ``topic`` as it is now."""
    queues = store._queues.get(topic)
    store._topics_file.record(
        topic,
        len(queues) if queues else None,
        store._policies.get(topic),
        store._deleted.get(topic),
        lambda: topics_state(store),
    )
