"""The checkpoint's record of which consumer group files exist (``group_files``), so that
one deleted from outside is reported as ``committed_offsets`` reports a shrunken
``offsets.json`` (review17 R17-9: a lost ``consumers/GROUP.json`` left no trace, and the
group silently started over).

The record is a sorted list of group names, not a count: group files are made by any
process (a read-only handle's consumer loop) and only the writer writes the checkpoint,
so a count would let one group's new file hide another's loss, and a name says which
group lost what. It is taken from a listing of ``consumers/`` at each checkpoint (off the
commit path: a commit costs what it did), so it may lack a file made since, never name
one that was not there; a group file is removed legitimately only by ``delete_group``
(which drops its name from the record first: ``forget``), or moved to
``consumers/recovered/`` as damaged (its copy there says so, and holds retention). A
checkpoint without the field (an equeue before it) records nothing and reports nothing.

A reader beside a live writer reads the record, looks for the files, and reads the
record again for the names it did not find: a name in both reads whose file is still
absent after the second was lost, not deleted (the deletion drops the name before it
removes the file), nor made since (a name is recorded only after its file exists).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from equeue.atomicfile import read_json, write_json
from equeue.errors import CorruptionError, EQueueError, location
from equeue.format.chunk import RECOVERED_DIR, TEMP_SUFFIX
from equeue.store import offsets as group_offsets
from equeue.store.meta import CHECKPOINT_FILE, CONSUMERS_DIR

if TYPE_CHECKING:
    from equeue.store.store import MessageStore

GROUP_FILES_KEY = "group_files"  # checkpoint.json: the groups whose consumers/ file exists


# --- the writer: what the record says ---------------------------------------------------


def present(store_path: Path, files: group_offsets.GroupFiles | None) -> list[str] | None:
    """The groups whose file is in ``consumers/`` now, sorted (none there: []); None when
    the directory cannot be listed (a link or a file: reported by the open; a checkpoint
    then records nothing rather than a loss nobody made)."""
    try:
        dir_fd = group_offsets._open_dir(store_path / CONSUMERS_DIR)
    except CorruptionError:
        return None
    if dir_fd is None:
        return []
    known = {} if files is None else files.names
    found: dict[str, str] = {}
    try:
        for name in os.listdir(dir_fd):
            group = known.get(name) or _group_of(dir_fd, name, store_path, files)
            if group is not None:
                found[name] = group
    except OSError:
        return None
    finally:
        os.close(dir_fd)
    if files is not None:
        files.names = found  # (the names gone since dropped)
    return sorted(found.values())


def _group_of(
    dir_fd: int, name: str, store_path: Path, files: group_offsets.GroupFiles | None
) -> str | None:
    """The group whose file ``name`` is; None for an entry that is no group's file."""
    if not name.endswith(".json") or name.endswith(TEMP_SUFFIX):
        return None
    if "%%" not in name:  # file_name: the group percent-encoded, nothing cut
        group: str | None = unquote(name.removesuffix(".json"), errors="strict")
    else:  # a long name ends in a hash: the group is in the file (parsed once)
        cached = None if files is None else files._parsed.get(name)
        group = None if cached is None else cached[1]
        if group is None:
            with contextlib.suppress(FileNotFoundError, CorruptionError):
                _, group, _ = group_offsets._read_file(
                    dir_fd, name, store_path / CONSUMERS_DIR / name
                )
    try:
        if group is None or group_offsets.file_name(group_offsets.check_group(group)) != name:
            return None
    except (EQueueError, UnicodeError):  # not a name file_name() gives: reported elsewhere
        return None
    return group


def forget(store: MessageStore, group: str) -> None:
    """``delete_group``, before its commit point (the caller holds the checkpoint lock):
    the group dropped from the record, so that the file's removal is not reported as a
    loss. A crash before the removal leaves the group unrecorded, whole, and the next
    checkpoint records it again."""
    path = store.path / CHECKPOINT_FILE
    body: Any = None
    with contextlib.suppress(OSError, EQueueError):  # none or damaged: nothing recorded
        body = read_json(path)
    if isinstance(body, dict):
        recorded = body.get(GROUP_FILES_KEY)
        if isinstance(recorded, list) and group in recorded:
            write_json(path, body | {GROUP_FILES_KEY: [g for g in recorded if g != group]})


# --- the readers: what is missing -------------------------------------------------------


def recorded(checkpoint: dict[str, Any], where: Path) -> tuple[list[str] | None, str | None]:
    """The record's group names (None: no record), each checked as ``commit_offset``
    checks a group name, or None and what is wrong with it: a checksummed record equeue
    would not write, which is then ignored (nothing is looked up by it)."""
    value = checkpoint.get(GROUP_FILES_KEY)
    if value is None:
        return None, None
    try:
        if not isinstance(value, list):
            raise EQueueError(f"a {type(value).__name__}, not a list of group names")
        for group in value:
            group_offsets.check_group(group)
        if len(set(value)) != len(value):
            raise EQueueError("a group named twice")
    except EQueueError as exc:
        return None, (
            f'the checkpoint {location(where, None)} records "{GROUP_FILES_KEY}" that equeue '
            f"does not write ({exc}): ignored, so a consumer group file lost before the next "
            "checkpoint is not reported (a writer's next checkpoint records the files again)"
        )
    return value, None


def missing(
    store_path: Path, groups: list[str], reread: Callable[[], list[str] | None]
) -> list[str]:
    """The recorded ``groups`` whose file is gone, neither deleted by ``delete_group`` nor
    set aside as damaged. ``reread``: the record read again (after the files were looked
    for; None if it cannot be read: nothing is reported then)."""
    directory = store_path / CONSUMERS_DIR
    copies = _set_aside(directory)
    if copies is None:
        return []  # not a directory: the open and verify report that, once
    gone = [g for g in groups if not _here(directory, g, copies)]
    if not gone:
        return []
    again = reread()
    if again is None:
        return []
    copies = _set_aside(directory)  # (a writer's open may have moved one aside since)
    still = set(again)
    return [g for g in gone if g in still and not _here(directory, g, copies or set())]


def _set_aside(directory: Path) -> set[str] | None:
    """The group files of which ``consumers/recovered/`` holds a copy set aside as damaged
    (their group not deleted since); None if ``consumers/`` is a link or a file."""
    try:
        fd = group_offsets._open_dir(directory)
    except CorruptionError:
        return None
    copies: set[str] = set()
    if fd is None:
        return copies
    try:
        with contextlib.suppress(OSError):  # none yet (or not a directory: reported)
            side = os.open(RECOVERED_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            try:
                for entry in os.listdir(side):
                    copy = group_offsets.set_aside_copy(entry)
                    if copy is not None:
                        copies.add(copy[0])
            finally:
                os.close(side)
    finally:
        os.close(fd)
    return copies


def _here(directory: Path, group: str, copies: set[str]) -> bool:
    """Whether the group's file is in ``directory`` (never followed), or a copy of it
    was set aside as damaged."""
    name = group_offsets.file_name(group)
    if name in copies:
        return True
    try:
        os.stat(directory / name, follow_symlinks=False)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # there, but not readable: the scan of consumers/ reports that
    return True


def missing_problem(store_path: Path, group: str, where: Path) -> str:
    """What was lost with group ``group``'s file, and what to do."""
    return (
        f"{store_path / CONSUMERS_DIR / group_offsets.file_name(group)} is missing, but the "
        f"checkpoint {location(where, None)} records that consumer group {group!r} had "
        "committed offsets in it: they were lost (not by delete_group, which drops the group "
        "from that record first). Its consumers (start='committed') start again at each "
        "queue's first offset, so what it had consumed comes again, and "
        "retention_respects_consumers no longer holds messages for it; if you know how far "
        f"it got, set that with commit_offset({group!r}, topic, queue_id, offset)"
    )


def problems_at_open(store: MessageStore, checkpoint: dict[str, Any]) -> list[str]:
    """An open's report of group files lost since the checkpoint it read."""
    where = store.path / CHECKPOINT_FILE
    groups, bad = recorded(checkpoint, where)
    if groups is None:
        return [] if bad is None else [bad]

    def reread() -> list[str] | None:
        try:
            body = read_json(where)
        except (OSError, EQueueError):
            return None
        return recorded(body, where)[0] if isinstance(body, dict) else None

    return [missing_problem(store.path, g, where) for g in missing(store.path, groups, reread)]
