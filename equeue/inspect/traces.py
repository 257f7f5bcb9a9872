"""``equeue verify``'s checks of what is missing: files deleted or replaced from outside,
found against the traces the checkpoint keeps (equeue/store/losses.py says which), and
the key index, derived data that SQLite checks.

On a live store each comparison reads its two sides in an order that cannot report a
loss that is not one: the checkpoint's starts after the chunk listing (retention notes
the new start before it deletes), its log position before it (the log only grows).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
from pathlib import Path
from typing import Any

from equeue.atomicfile import read_json
from equeue.errors import CorruptionError, EQueueError
from equeue.format.livetail import LIVE_TAIL_FILE
from equeue.format.message import QUEUE_RECORD_SIZE
from equeue.format.topicsjournal import TOPICS_JOURNAL_FILE
from equeue.inspect.layout import ChunkDir, Problem, StoreFiles, chunk_paths
from equeue.store import grouprecord
from equeue.store.keysread import keys_state, keys_uri, wal_unread
from equeue.store.meta import (
    CHECKPOINT_FILE,
    CONSUMERS_DIR,
    IDENTITY_FILE,
    KEYS_FILE,
    LOCK_FILE,
    MESSAGES_DIR,
    OFFSETS_FILE,
    QUEUES_DIR,
    TOPICS_FILE,
    check_offsets,
)
from equeue.store.offsets import file_name
from equeue.store.topicsfile import read_topics_body

_FILES = (IDENTITY_FILE, TOPICS_FILE, OFFSETS_FILE, CHECKPOINT_FILE, LOCK_FILE)
_FILES_MORE = (LIVE_TAIL_FILE, KEYS_FILE)


def _body(path: Path) -> Any:
    """A metadata file's body; None if it is missing or damaged (open_store reports that)."""
    try:
        return read_json(path)
    except (OSError, EQueueError):
        return None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def missing_problems(
    store: StoreFiles,
    dirs: dict[Path, ChunkDir],
    checkpoint_before: int | None,
    lowest: dict[tuple[str, int], tuple[int, Path]] | None = None,
    *,
    check_key_index: bool = True,
) -> list[Problem]:
    """What the checkpoint, topics.json and the key index say is missing.
    ``checkpoint_before``: the checkpoint's log position, read before the chunk listing;
    ``lowest``: each queue's lowest offset among the log's records and the log chunk that
    held it, when the log was walked;
    ``check_key_index``: run SQLite's integrity check (else only look for the file)."""
    path = store.path
    problems: list[Problem] = []
    checkpoint_path = path / CHECKPOINT_FILE
    checkpoint = _body(checkpoint_path)
    log = dirs.get(store.messages_dir)
    has_log = log is not None and bool(log.files)
    if not os.path.lexists(checkpoint_path) and has_log:
        problems.append(
            Problem(
                str(checkpoint_path),
                None,
                "missing file",
                "the store holds message chunks but no checkpoint (every writer's open "
                "writes one): it was deleted, and with it what tells a deletion from retention",
            )
        )
    if isinstance(checkpoint, dict) and log is not None:
        problems += _log_problems(log, checkpoint, checkpoint_before, checkpoint_path)
        problems += _queue_problems(store, dirs, checkpoint, checkpoint_path)
        problems += _offset_problems(path, checkpoint, checkpoint_path)
    if isinstance(checkpoint, dict):
        problems += _group_file_problems(path, checkpoint, checkpoint_path)
    problems += _unindexed(store, dirs, lowest or {}, {p.file for p in problems})
    problems += _topic_problems(store)
    problems += not_regular_problems(path)
    problems += key_index_problems(
        path, has_checkpoint=os.path.lexists(checkpoint_path), check=check_key_index
    )
    return problems


def _log_problems(
    log: ChunkDir, checkpoint: dict[str, Any], before: int | None, checkpoint_path: Path
) -> list[Problem]:
    problems = []
    start = _int(checkpoint.get("log_start"))
    first, end = log.first_position, log.end_position
    if start is not None and log.files and first > start:
        problems.append(
            Problem(
                str(log.directory),
                None,
                "missing chunk",
                f"the log starts at position {first} ({log.files[0].path.name}), but "
                f"{checkpoint_path} records that it starts at {start}: the chunks holding "
                f"positions {start}..{first - 1} were deleted (retention records the new "
                "start before it deletes)",
            )
        )
    if before is not None and end < before and (start is None or before > start):
        problems.append(
            Problem(
                str(log.directory),
                None,
                "missing records",
                f"the log ends at position {end}, but {checkpoint_path} records durable "
                f"records up to {before}",
            )
        )
    return problems


def _queue_problems(
    store: StoreFiles, dirs: dict[Path, ChunkDir], checkpoint: dict[str, Any], where: Path
) -> list[Problem]:
    problems = []
    starts = checkpoint.get("queue_starts")
    for topic, offsets in (starts if isinstance(starts, dict) else {}).items():
        for queue_id, recorded in enumerate(offsets if isinstance(offsets, list) else []):
            chunks = dirs.get(store.queue_dir(str(topic), queue_id))
            if chunks is None or not isinstance(recorded, int):
                continue
            if not chunks.files:
                on_disk = None if recorded == 0 else 0
            else:
                on_disk = chunks.first_position // QUEUE_RECORD_SIZE
            ends = checkpoint.get("queues")
            queue_ends = ends.get(topic) if isinstance(ends, dict) else None
            ended = (
                queue_ends[queue_id]
                if isinstance(queue_ends, list) and queue_id < len(queue_ends)
                else None
            )
            if not chunks.files and isinstance(ended, int) and ended > recorded:
                problems.append(
                    Problem(
                        str(chunks.directory),
                        None,
                        "missing chunk",
                        f"queue {topic}/{queue_id} has no chunk files, but {where} records "
                        f"entries {recorded}..{ended - 1}",
                    )
                )
            elif on_disk is not None and on_disk > recorded:
                problems.append(
                    Problem(
                        str(chunks.directory),
                        None,
                        "missing chunk",
                        f"queue {topic}/{queue_id} starts at offset {on_disk}, but {where} "
                        f"records its first offset as {recorded}: the entries "
                        f"{recorded}..{on_disk - 1} were deleted",
                    )
                )
    return problems


def _unindexed(
    store: StoreFiles,
    dirs: dict[Path, ChunkDir],
    lowest: dict[tuple[str, int], tuple[int, Path]],
    reported: set[str],
) -> list[Problem]:
    """Queues whose entries start after an offset whose message the log still holds:
    retention removes a queue chunk only once every entry in it points below the log."""
    problems = []
    for (topic, queue_id), (offset, log_chunk) in sorted(lowest.items()):
        chunks = dirs.get(store.queue_dir(topic, queue_id))
        if chunks is None or str(chunks.directory) in reported:
            continue  # a queue the store lacks (reported per record), or reported above
        if not os.path.lexists(log_chunk):
            # Retention removed that log chunk since the walk, and then (log first, queues
            # after) the queue chunks whose entries all pointed into it, before this
            # queue's directory was loaded: what the log held is no longer held (review17
            # R17-2: verify beside a retaining writer reported it as a deletion).
            continue
        first = chunks.first_position // QUEUE_RECORD_SIZE if chunks.files else None
        if first is not None and offset >= first:
            continue
        if first is None and chunk_paths(chunks.directory):
            continue  # a live writer's first entry, written since the listing
        held = f"offsets {offset}..{first - 1}" if first is not None else f"offset {offset} on"
        problems.append(
            Problem(
                str(chunks.directory),
                None,
                "missing chunk",
                f"the log holds messages of queue {topic}/{queue_id} at {held}, but the "
                "queue has no entries for them: its chunks were deleted",
            )
        )
    return problems


def _offset_problems(path: Path, checkpoint: dict[str, Any], where: Path) -> list[Problem]:
    recorded = _int(checkpoint.get("committed_offsets"))
    offsets_path = path / OFFSETS_FILE
    offsets = _body(offsets_path)  # after the checkpoint: offsets only ever become more
    if recorded is None or recorded == 0:
        return []
    if offsets is None and os.path.lexists(offsets_path):
        return []  # damaged: open_store reported it
    have = 0
    if offsets is not None:
        try:
            checked = check_offsets(offsets, offsets_path)
        except CorruptionError:
            return []  # an entry the open refuses: open_store reported it
        have = sum(len(queues) for topics in checked.values() for queues in topics.values())
    if have >= recorded:
        return []
    state = "is missing" if offsets is None else f"holds {have}"
    return [
        Problem(
            str(offsets_path),
            None,
            "missing file" if offsets is None else "metadata",
            f"{where} records {recorded} committed consumer offsets, but {offsets_path.name} "
            f"{state}: committed offsets were lost",
        )
    ]


def _group_file_problems(path: Path, checkpoint: dict[str, Any], where: Path) -> list[Problem]:
    """Consumer group files the checkpoint records and ``consumers/`` no longer holds
    (equeue/store/grouprecord.py: read again after the look, beside a live writer)."""
    groups, bad = grouprecord.recorded(checkpoint, where)
    if groups is None:
        return [] if bad is None else [Problem(str(where), None, "metadata", bad)]

    def reread() -> list[str] | None:
        body = _body(where)
        return grouprecord.recorded(body, where)[0] if isinstance(body, dict) else None

    return [
        Problem(
            str(path / CONSUMERS_DIR / file_name(group)),
            None,
            "missing file",
            grouprecord.missing_problem(path, group, where),
        )
        for group in grouprecord.missing(path, groups, reread)
    ]


def _topic_problems(store: StoreFiles) -> list[Problem]:
    # The directories as open_store listed them: before topics.json is read again here.
    path = store.path
    found = {t: max(ids) + 1 for t, (ids, chunks) in store.dir_topics.items() if ids and chunks}
    skipped = [f"{where}: {why}" for where, why in store.dir_skipped]
    topics_path = path / TOPICS_FILE
    journal = path / TOPICS_JOURNAL_FILE  # (its records: topics not yet in topics.json)
    try:  # after the directories: a new topic is listed first
        exists = os.path.lexists(topics_path) or os.path.lexists(journal)
        listed = read_topics_body(path) if exists else None
    except (OSError, EQueueError):
        return []  # damaged: open_store reported it
    names = set(listed) if isinstance(listed, dict) else set()
    absent = f"{TOPICS_FILE} " + (
        "does not list it" if os.path.lexists(topics_path) else "is missing"
    )
    if os.path.lexists(journal):
        absent += f" and {TOPICS_JOURNAL_FILE} does not list it"
    problems = [
        Problem(
            str(path / QUEUES_DIR / topic),
            None,
            "missing topic",
            f"topic {topic!r} has queue directories with chunk files, but "
            f"{absent}: "
            "a writer's open rebuilds it from the directories (its cleanup policy is lost)",
        )
        for topic in sorted(set(found) - names)
    ]
    problems += [Problem(str(path / QUEUES_DIR), None, "metadata", why) for why in skipped]
    return problems


def key_index_problems(path: Path, *, has_checkpoint: bool, check: bool = True) -> list[Problem]:
    """SQLite's integrity check of keys.sqlite (it checks the index against the table)."""
    keys = path / KEYS_FILE
    if not os.path.lexists(keys):
        if not has_checkpoint:
            return []
        return [
            Problem(
                str(keys),
                None,
                "missing file",
                "the key index is missing (every writer's open creates it); a writer's open "
                "re-indexes every key from the log",
            )
        ]
    if not check:
        return []
    # Opened as a read-only handle opens it (nothing written), whatever the writer did.
    state = keys_state(keys)
    uri = keys_uri(keys, state)
    try:
        rows = _integrity(uri, tables=not wal_unread(state, uri))
    except sqlite3.Error:
        # A -shm SQLite cannot use read-only (e.g. the writer started or stopped): the
        # database file alone, as a read-only handle falls back to it.
        uri = keys_uri(keys, state, fallback=True)
        try:
            rows = _integrity(uri, tables=not wal_unread(state, uri))
        except sqlite3.Error as exc:
            rows = [(f"unreadable: {exc}",)]
    bad = [str(row[0]) for row in rows if row and row[0] != "ok"]
    if not bad:
        return []
    more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
    unread = (
        f" (the database file alone: {keys.name}-wal cannot be read without creating its -shm)"
        if wal_unread(state, uri)
        else ""
    )
    return [
        Problem(
            str(keys),
            None,
            "key index",
            f"SQLite's integrity check fails: {'; '.join(bad[:3])}{more}{unread}; move it "
            "out of the store and a writer's open re-indexes every key from the log (one "
            "SQLite cannot open, the open moves to recovered/ itself)",
        )
    ]


def _integrity(uri: str, *, tables: bool) -> list[tuple[str]]:
    """SQLite's integrity check of ``uri``; ``tables``: the index's tables must be there
    (not when a WAL that is not read may be what creates them)."""
    db = sqlite3.connect(uri, uri=True)
    try:
        rows: list[tuple[str]] = db.execute("PRAGMA integrity_check").fetchall()
        names = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        for table in ("keys", "meta"):
            if tables or table in names:
                db.execute(f"SELECT count(*) FROM {table}").fetchone()
    finally:
        db.close()
    return rows


def not_regular_problems(path: Path) -> list[Problem]:
    """Store files that are not regular files, store directories that are not directories,
    and symlinks among either: the store creates none of them, and writes through none."""
    problems = []
    expected = [(path / name, False) for name in _FILES + _FILES_MORE]
    expected += [(path / MESSAGES_DIR, True), (path / QUEUES_DIR, True)]
    with contextlib.suppress(OSError):
        expected += [(p, True) for p in (path / QUEUES_DIR).iterdir()]
    for entry, directory in expected:
        try:
            st = os.lstat(entry)
        except FileNotFoundError:
            continue
        what = None
        if stat.S_ISLNK(st.st_mode):
            what = f"is a symlink (to {os.readlink(entry)}), which the store never creates"
        elif directory and not stat.S_ISDIR(st.st_mode):
            what = "is not a directory"
        elif not directory and not stat.S_ISREG(st.st_mode):
            what = "is not a regular file"
        if what is not None:
            problems.append(Problem(str(entry), None, "file type", f"{entry.name} {what}"))
    return problems
