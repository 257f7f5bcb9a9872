"""``equeue rebuild-topics STORE``: what an operator runs when every open refuses the
store because ``topics.journal`` is damaged (its header, or a record with records after
it: not a torn append, which a writer's open cuts by itself).

A damaged header loses the journal's generation (whether topics.json holds its records
already) and, if the version field is the damage, where its records start; each record
still has its own checksum. So the rebuild, under the writer lock:

1. copies the whole journal to ``recovered/topics.journal.<ns>.damaged`` (fsynced);
2. reads every record that checks out, from where a version 2 header ends (24) or a
   version 1 one (16), whichever a record starts at, stepping over bytes that are no
   record (each span reported: offset, length);
3. replays them in file order over topics.json, each checked as ``create_topic`` checks
   its arguments (one that fails is reported and not replayed). Always replayed, the
   generation being unknown: a journal topics.json already holds (a fold cut between its
   two writes) replays to the same entries, but for the topic of the change that caused
   the fold, whose older record wins; not replaying a journal topics.json does not hold
   would lose every topic change since the last fold. Each record's effect on
   topics.json's entry is reported, so the operator sees either case;
4. writes topics.json (the next generation) and a fresh journal of that generation.

The next writable open then rebuilds, as for any topics.json, the topics whose queue
directories hold chunks and that have no entry (default policies, reported). A sound
journal is left as it is.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from equeue.atomicfile import read_json
from equeue.chunks.fileops import fsync_directory
from equeue.chunks.recovery import make_side_dir
from equeue.errors import CorruptionError, NotAStoreError
from equeue.format.topicsjournal import (
    HEADER_SIZE,
    TOPICS_JOURNAL_FILE,
    TopicRecord,
    check_header,
)
from equeue.safepath import check_file, open_file
from equeue.store.meta import IDENTITY_FILE, TOPICS_FILE, check_layout, take_lock
from equeue.store.topicsfile import (
    JOURNAL_READ_LIMIT,
    Journal,
    TopicsFile,
    file_generation,
    next_record,
    replay,
)

log = logging.getLogger("equeue.recovery")

_V1_HEADER_SIZE = 16  # (equeue/format/topicsjournal.py: version 1 had no generation)


@dataclass(frozen=True, slots=True)
class Replayed:
    topic: str
    offset: int
    effect: str  # what it did to topics.json's entry, in words


@dataclass(frozen=True, slots=True)
class Skipped:
    offset: int
    length: int
    reason: str


@dataclass
class RebuildReport:
    journal: str
    damage: str | None = None  # None: the journal is sound, nothing was changed
    side_file: str | None = None
    journal_bytes: int = 0
    records_from: int | None = None
    replayed: list[Replayed] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    generation: int | None = None  # topics.json's and the fresh journal's
    topics: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "journal": self.journal,
            "damage": self.damage,
            "rebuilt": self.damage is not None,
            "side_file": self.side_file,
            "journal_bytes": self.journal_bytes,
            "records_from": self.records_from,
            "replayed": [
                {"topic": r.topic, "offset": r.offset, "effect": r.effect} for r in self.replayed
            ],
            "skipped": [
                {"offset": s.offset, "length": s.length, "reason": s.reason} for s in self.skipped
            ],
            "generation": self.generation,
            "topics": self.topics,
        }


def rebuild_topics(store: str | os.PathLike[str]) -> RebuildReport:
    """Rebuild topics.json and topics.journal from topics.json and the journal's readable
    records (above). StoreLockedError while a writer runs; NotAStoreError without a
    store.json; topics.json's own damage raised as its reader raises it (with its remedy)."""
    path = Path(store).absolute()
    if not os.path.lexists(path / IDENTITY_FILE):
        raise NotAStoreError(f"no store at {path} (no {IDENTITY_FILE})")
    check_layout(path)
    journal_path = path / TOPICS_JOURNAL_FILE
    report = RebuildReport(str(journal_path))
    lock = take_lock(path)
    try:
        if not check_file(journal_path):  # (none: the next writable open makes one)
            return report
        with open_file(journal_path, "rb") as f:
            raw = f.read(JOURNAL_READ_LIMIT)  # (a larger one: its rest is copied, not read)
            report.journal_bytes = os.fstat(f.fileno()).st_size
        try:
            # Sound (or a torn tail, which the writer's open cuts), and every record one
            # create_topic would accept (a check of each record alone: any body will do).
            journal = Journal(journal_path).read()
            # (beside a topics.json without a generation, checked against it: _undoes)
            replay(_topics_body(path) if journal.unversioned_beside else {}, journal)
            return report
        except CorruptionError as exc:
            if exc.file != str(journal_path):  # topics.json's generation: its own remedy
                raise
            report.damage = exc.problem
        topics_path = path / TOPICS_FILE
        generation = file_generation(topics_path)
        try:
            body = read_json(topics_path) if os.path.lexists(topics_path) else {}
            if not isinstance(body, dict):
                raise CorruptionError("topics.json's body is not an object", file=topics_path)
        except CorruptionError as exc:
            raise type(exc)(
                f"{exc.reason} (topics.json, beside a damaged {TOPICS_JOURNAL_FILE})",
                file=exc.file,
                offset=exc.offset,
                expected=exc.expected,
                found=exc.found,
                remedy="move topics.json out of the store and run rebuild-topics again: the "
                "journal's records are then replayed over nothing, and the next writable open "
                "adds the topics whose queue directories hold chunks, with default policies",
            ) from None
        records, report.records_from, report.skipped = _salvage(raw)
        if report.journal_bytes > len(raw):
            report.skipped.append(
                Skipped(
                    len(raw),
                    report.journal_bytes - len(raw),
                    "past the largest journal a writer leaves: not read",
                )
            )
        merged = dict(body)
        for at, record in records:
            single = Journal(journal_path)
            single.records = [(at, record)]
            try:
                after = replay(merged, single)
            except CorruptionError as exc:
                report.skipped.append(Skipped(at, len(record.pack()), exc.reason))
                continue
            report.replayed.append(Replayed(record.topic, at, _effect(merged, after, record)))
            merged = after
        report.side_file = _keep_copy(journal_path)
        log.warning(
            "rebuild-topics: %s copied to %s (%s)", journal_path, report.side_file, report.damage
        )
        TopicsFile(path, writer=True).rebuild(merged, generation)
        report.generation = generation + 1
        report.topics = sum(
            1 for e in merged.values() if isinstance(e, dict) and "queue_count" in e
        )
        return report
    finally:
        lock.close()


def _salvage(raw: bytes) -> tuple[list[tuple[int, TopicRecord]], int, list[Skipped]]:
    """The records of ``raw`` that check out, where the first was looked for, and the spans
    between them that are no record."""
    try:
        check_header(raw, "")
        start = _V1_HEADER_SIZE if len(raw) >= 12 and raw[8:12] == b"\1\0\0\0" else HEADER_SIZE
    except CorruptionError:
        # The version may be the damage: records start where one does at 16 or 24.
        start = HEADER_SIZE
        for candidate in (HEADER_SIZE, _V1_HEADER_SIZE):
            if next_record(raw, candidate) == candidate:
                start = candidate
                break
    records: list[tuple[int, TopicRecord]] = []
    skipped: list[Skipped] = []
    at = start
    while at < len(raw):
        found = next_record(raw, at)
        if found is None:
            rest = raw[at:]
            skipped.append(
                Skipped(at, len(rest), "zeros" if not rest.strip(b"\0") else "no record")
            )
            break
        if found > at:
            skipped.append(Skipped(at, found - at, "no record"))
        record, at = TopicRecord.unpack(raw, found, "")
        records.append((found, record))
    return records, start, skipped


def _effect(before: dict[str, Any], after: dict[str, Any], record: TopicRecord) -> str:
    old, new = before.get(record.topic), after[record.topic]
    if old == new:
        return "as topics.json has it"
    if record.queue_count is None:
        return f"deleted (before log position {record.deleted_before})"
    if not isinstance(old, dict) or "queue_count" not in old:
        queues = "1 queue" if record.queue_count == 1 else f"{record.queue_count} queues"
        return f"created with {queues} (topics.json had no such topic)"
    return f"entry replaced: {old} -> {new}"


def _keep_copy(journal: Path) -> str:
    """The whole journal copied to recovered/ (fsynced, with its directory entry)."""
    side = make_side_dir(journal.parent) / f"{journal.name}.{time.time_ns()}.damaged"
    with open_file(journal, "rb") as source, open_file(side, "xb") as out:
        while block := source.read(1 << 20):
            out.write(block)
        out.flush()
        os.fsync(out.fileno())
    fsync_directory(side.parent)
    return str(side)


def _topics_body(store: Path) -> dict[str, Any]:
    body = read_json(store / TOPICS_FILE) if os.path.lexists(store / TOPICS_FILE) else {}
    return body if isinstance(body, dict) else {}
