"""The store's small files: the writer lock, the identity, and metadata reads.

Metadata files (store.json, topics.json, offsets.json, checkpoint.json) are
written by ``equeue.atomicfile`` and carry a checksum. A damaged one is
reported; a writer also moves it aside to ``recovered/`` (never deleting it)
and starts from the default, a read-only handle leaves it where it is.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import time
import uuid
from pathlib import Path
from typing import IO, Any

from equeue.atomicfile import read_json, write_json
from equeue.chunks.fileops import fsync_directory
from equeue.chunks.recovery import make_side_dir
from equeue.errors import (
    ConfigError,
    CorruptionError,
    EQueueError,
    NewerFormatError,
    NotAStoreError,
    StoreLockedError,
)
from equeue.format.chunk import RECOVERED_DIR
from equeue.format.livetail import LIVE_TAIL_FILE
from equeue.format.message import MAX_NAME_BYTES
from equeue.safepath import check_store, open_fd, open_file
from equeue.store import validate
from equeue.store.config import StoreConfig

STORE_FORMAT = 1
# The store directory: every name the store and the inspector use, in one place.
IDENTITY_FILE = "store.json"
LOCK_FILE = "LOCK"
TOPICS_FILE = "topics.json"
OFFSETS_FILE = "offsets.json"
CONSUMERS_DIR = "consumers"  # GROUP.json: the offsets consumer loops commit
CHECKPOINT_FILE = "checkpoint.json"
KEYS_FILE = "keys.sqlite"
MESSAGES_DIR = "messages"
QUEUES_DIR = "queues"  # then <topic>/<queue id>/
COMPACTION_DIR = "compaction"  # locks, the install marker, staging directories of jobs
# Settings that shape the files: fixed when the store is created.
_SHAPE = ("chunk_data_size", "queue_chunk_records")
# What the store keeps at its root, each checked before anything is opened (safepath).
_FILES = (
    IDENTITY_FILE, LOCK_FILE, TOPICS_FILE, OFFSETS_FILE, CHECKPOINT_FILE, LIVE_TAIL_FILE,
    KEYS_FILE, f"{KEYS_FILE}-wal", f"{KEYS_FILE}-shm", f"{KEYS_FILE}-journal",
)  # fmt: skip
# consumers/recovered/ after consumers/: where a writer moves damaged group files, at its
# open and at a commit; a file or a link there would leave a damaged one in place.
_DIRS = (
    MESSAGES_DIR, QUEUES_DIR, COMPACTION_DIR, RECOVERED_DIR, CONSUMERS_DIR,
    f"{CONSUMERS_DIR}/{RECOVERED_DIR}",
)  # fmt: skip
# How long a writer's open waits for LOCK: readers' probes hold it for microseconds, a
# writer for its lifetime.
_LOCK_WAIT = 0.2


def check_layout(directory: Path) -> None:
    """Each of the store's files and directories at its root is what the store makes
    there, or missing; StorePathError (naming it) for a link or the wrong kind."""
    check_store(directory, _FILES, _DIRS)


def take_lock(directory: Path) -> IO[str]:
    """The writer lock (flock on LOCK, holding the pid); released when the file closes.
    A store of a newer format is refused first, leaving LOCK as it is."""
    _refuse_newer_format(directory)
    handle = open_file(directory / LOCK_FILE, "a+")  # held for the store's lifetime
    deadline = time.monotonic() + _LOCK_WAIT
    while True:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            # Readers probe the lock for an instant (writer_running): wait that out.
            if time.monotonic() < deadline:
                time.sleep(0.001)
                continue
            handle.seek(0)
            holder = handle.read(64).strip() or "unknown"  # (a pid: the rest is not ours)
            handle.close()
            locked = StoreLockedError(
                f"store {directory} is open for writing by pid {holder}; open it with "
                "read_only=True or close the other handle"
            )
            locked.holder = str(holder)
            raise locked from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def _refuse_newer_format(directory: Path) -> None:
    """ConfigError for a store.json of a newer format, read before anything is written;
    a missing or damaged one is left to open_identity (which runs under the lock)."""
    path = directory / IDENTITY_FILE
    try:
        identity = read_json(path)
    except (OSError, EQueueError):
        return
    if isinstance(identity, dict):
        check_format(path, identity)


def try_writer_lock(directory: Path) -> IO[str] | None:
    """The writer lock if no writer holds it (the caller closes it soon), else None.
    Unlike ``take_lock`` it leaves the pid in LOCK as it is."""
    try:
        handle = open_file(directory / LOCK_FILE, "a+")  # returned to the caller
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def writer_running(directory: Path) -> bool:
    """Whether a writer holds the store's lock (probed with a shared lock, released at once)."""
    try:
        fd = open_fd(directory / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases a lock we took
    return False


def lost_identity(directory: Path) -> CorruptionError | None:
    """For a directory without store.json: the error that says it holds a store whose
    store.json was lost (the files only a store makes are there), else None. Every open and
    the inspector say the same (review17 R17-6: they called it "not an equeue store")."""
    found = [n for n in (MESSAGES_DIR, QUEUES_DIR, CHECKPOINT_FILE) if (directory / n).exists()]
    if not found:
        return None
    return CorruptionError(
        f"{directory / IDENTITY_FILE} is missing, but the directory holds a store "
        f"({', '.join(found)}): restore store.json (its store_id is part of every message "
        "id) rather than create a new store over it",
        file=directory / IDENTITY_FILE,
    )


def open_identity(
    directory: Path, config: StoreConfig | None, *, create: bool
) -> tuple[int, StoreConfig]:
    """(store id, the configuration to use). A new store records its id and shape.

    A layout setting left unset (None) takes the store's own (a new store's: the
    defaults); only a value set explicitly that differs from the store's is refused.
    """
    check_layout(directory)
    path = directory / IDENTITY_FILE
    if not path.exists():
        lost = lost_identity(directory)
        if lost is not None:  # a new identity would change every message id and the shape
            raise lost
        if not create:
            raise NotAStoreError(f"{directory} is not an equeue store: it has no {IDENTITY_FILE}")
        config = config or StoreConfig()
        store_id = uuid.uuid4().int & 0xFFFFFFFF
        config = dataclasses.replace(config, **config.layout._asdict())
        write_json(
            path,
            {"format": STORE_FORMAT, "store_id": store_id}
            | {name: getattr(config, name) for name in _SHAPE},
        )
        return store_id, config
    identity = _check_identity(path, read_json(path))
    config = config or StoreConfig()
    for name in _SHAPE:  # unset: the store's own; set: it must be the store's
        given = getattr(config, name)
        if given is not None and identity[name] != given:
            raise ConfigError(
                f"store {directory} was created with {name}={identity[name]}, but the "
                f"configuration says {name}={given}; leave {name} unset (None) to use "
                f"the store's, or set StoreConfig({name}={identity[name]})"
            )
    return identity["store_id"], dataclasses.replace(
        config, **{name: identity[name] for name in _SHAPE}
    )


def _check_identity(path: Path, identity: Any) -> dict[str, Any]:
    """store.json's fields; a format newer than this library's is refused before
    anything is written (an older library would rewrite what it does not understand)."""
    if not isinstance(identity, dict):
        identity = {}
    check_format(path, identity)
    found = identity.get("format", STORE_FORMAT)  # written by every version so far
    fields = ("store_id", *_SHAPE)
    bad = [name for name in fields if not _is_int(identity.get(name))]
    if bad or not _is_int(found) or found < 1:
        raise CorruptionError(
            f"{IDENTITY_FILE} must hold a format >= 1 and the integers {', '.join(fields)}; "
            f"it holds {identity!r}",
            file=path,
            offset=0,
        )
    return {name: identity[name] for name in fields}


def check_format(path: Path, identity: dict[str, Any]) -> None:
    """NewerFormatError (a ConfigError) if store.json says a format newer than this
    library's."""
    reads = f"format {STORE_FORMAT} and older"
    found = identity.get("format")
    NewerFormatError.check("store format", found, STORE_FORMAT, file=path, offset=None, reads=reads)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def read_meta(
    directory: Path, name: str, default: Any, problems: list[str], *, move_aside: bool
) -> Any:
    """A metadata file's body, or ``default`` if it is missing or damaged (reported).
    A body that checks out but holds what the API would refuse raises CorruptionError."""
    path = directory / name
    if not path.exists():
        return default
    try:
        body = read_json(path)
        if name == TOPICS_FILE and not isinstance(body, dict):  # as damaged: rebuilt
            what = type(body).__name__
            raise CorruptionError(f"its body is a {what}, not an object of topics", file=path)
    except CorruptionError as exc:
        if not move_aside:
            problems.append(str(exc))
            return default
        moved = move_to_recovered(path)
        problems.append(f"{exc}; moved to {moved}")
        return default
    return check_offsets(body, path) if name == OFFSETS_FILE else body


def move_to_recovered(path: Path, stamp: int | None = None) -> Path:
    """Move a damaged file to ``recovered/`` beside it (never deleting it), durably."""
    directory = path.parent
    stamp = time.time_ns() if stamp is None else stamp
    moved = make_side_dir(directory) / f"{path.name}.{stamp}.damaged"
    os.replace(path, moved)
    fsync_directory(moved.parent)
    fsync_directory(directory)
    return moved


def check_offsets(body: Any, path: Path) -> dict[str, dict[str, dict[str, int]]]:
    """offsets.json's body, each entry's form checked as commit_offset() checks it (names,
    a queue id below 1024, an offset in 0..2**63-1); a checksummed file with a bad entry was not
    written by equeue: the open is refused. An offset is not bounded by its queue's end,
    nor a queue id by the topic's queue count: commit_offset() writes the file before the
    log is durable (flush='async'), so a crash can leave a queue ending before an offset
    committed earlier; a pull from past the end starts at the end, losing nothing."""
    try:
        if not isinstance(body, dict):
            raise ConfigError(f"it holds {type(body).__name__}, not consumer groups")
        for group, topics in body.items():
            if not group or len(group.encode()) > MAX_NAME_BYTES or not isinstance(topics, dict):
                raise ConfigError(f"bad group {group[:80]!r}: {str(topics)[:80]}")
            for topic, queues in topics.items():
                validate.check_topic(topic)
                if not isinstance(queues, dict):
                    raise ConfigError(f"bad queues of {topic!r}: {str(queues)[:80]}")
                for queue_id, offset in queues.items():
                    if not (queue_id.isdecimal() and queue_id.isascii() and int(queue_id) < 1024):
                        raise ConfigError(f"bad queue id {queue_id[:80]!r} of topic {topic!r}")
                    if not _is_int(offset) or not 0 <= offset <= validate.MAX_FILE_OFFSET:
                        raise ConfigError(f"bad offset {offset!r} of {topic!r}/{queue_id}")
    except (EQueueError, UnicodeEncodeError) as exc:
        raise CorruptionError(f"bad consumer offsets ({exc})", file=path, offset=0) from None
    return body
