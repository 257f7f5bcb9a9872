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
from equeue.chunks.chunk import fsync_directory
from equeue.chunks.recovery import make_side_dir
from equeue.errors import ConfigError, CorruptionError, NotAStoreError, StoreLockedError
from equeue.store.config import StoreConfig

STORE_FORMAT = 1
# The store directory: every name the store and the inspector use, in one place.
IDENTITY_FILE = "store.json"
LOCK_FILE = "LOCK"
TOPICS_FILE = "topics.json"
OFFSETS_FILE = "offsets.json"
CONSUMERS_DIR = "consumers"  # GROUP.json: offsets committed by read-only handles
CHECKPOINT_FILE = "checkpoint.json"
KEYS_FILE = "keys.sqlite"
MESSAGES_DIR = "messages"
QUEUES_DIR = "queues"  # then <topic>/<queue id>/
COMPACTION_DIR = "compaction"  # locks, the install marker, staging directories of jobs
# Settings that shape the files: fixed when the store is created.
_SHAPE = ("chunk_data_size", "queue_chunk_records")


def take_lock(directory: Path) -> IO[str]:
    """The writer lock (flock on LOCK, holding the pid); released when the file closes."""
    handle = open(directory / LOCK_FILE, "a+")  # noqa: SIM115 - held for the store's lifetime
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise StoreLockedError(
            f"store {directory} is open for writing by pid {holder}; open it with "
            "read_only=True or close the other handle"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle


def try_writer_lock(directory: Path) -> IO[str] | None:
    """The writer lock if no writer holds it (the caller closes it soon), else None.
    Unlike ``take_lock`` it leaves the pid in LOCK as it is."""
    try:
        handle = open(directory / LOCK_FILE, "a+")  # noqa: SIM115 - returned to the caller
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
        fd = os.open(directory / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # closing releases a lock we took
    return False


def open_identity(
    directory: Path, config: StoreConfig | None, *, create: bool
) -> tuple[int, StoreConfig]:
    """(store id, the configuration to use). A new store records its id and shape.

    Without a configuration, an existing store opens with the shape it was
    created with; a configuration that disagrees with it is refused.
    """
    path = directory / IDENTITY_FILE
    if not path.exists():
        if not create:
            raise NotAStoreError(f"{directory} is not an equeue store: it has no {IDENTITY_FILE}")
        config = config or StoreConfig()
        store_id = uuid.uuid4().int & 0xFFFFFFFF
        write_json(
            path,
            {"format": STORE_FORMAT, "store_id": store_id}
            | {name: getattr(config, name) for name in _SHAPE},
        )
        return store_id, config
    identity = read_json(path)
    if config is None:
        return int(identity["store_id"]), StoreConfig(**{name: identity[name] for name in _SHAPE})
    for name in _SHAPE:
        if identity[name] != getattr(config, name):
            raise ConfigError(
                f"store {directory} was created with {name}={identity[name]}, but the "
                f"configuration says {name}={getattr(config, name)}; open it with "
                f"StoreConfig({name}={identity[name]}) or without a configuration"
            )
    return int(identity["store_id"]), dataclasses.replace(config)


def read_meta(
    directory: Path, name: str, default: Any, problems: list[str], *, move_aside: bool
) -> Any:
    """A metadata file's body, or ``default`` if it is missing or damaged (reported)."""
    path = directory / name
    if not path.exists():
        return default
    try:
        return read_json(path)
    except CorruptionError as exc:
        if not move_aside:
            problems.append(str(exc))
            return default
        moved = make_side_dir(directory) / f"{name}.{time.time_ns()}.damaged"
        os.replace(path, moved)
        fsync_directory(moved.parent)
        fsync_directory(directory)
        problems.append(f"{exc}; moved to {moved}")
        return default
