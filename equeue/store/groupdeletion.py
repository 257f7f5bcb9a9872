"""``delete_group``: a consumer group's committed offsets removed, crash-safe, with the
broker's retry topic of the group (and, when asked, its dead-letter topic).

A group's offsets live in two files, ``offsets.json`` (the writer's entry) and
``consumers/GROUP.json`` (commits of consumer loops and the broker), read as the larger
of the two per queue. No single write can drop both, so the group is first gathered
into its group file, and the commit point is one rename. Under the store's write lock
and the ``flock`` on ``consumers/`` (which orders every process's commits):

1. ``consumers/GROUP.json`` written with the larger of both files' offsets and the
   intent (``"deleting": {"dead_letters": bool, "topics": ..., "set_aside": [...]}``, the
   last the group's copies in ``consumers/recovered/``): every handle reads what it read
   before (a damaged or linked group file is first moved to ``consumers/recovered/``);
2. the group's entry dropped from ``offsets.json`` (the checkpoint's count of committed
   offsets lowered first, as ``delete_topic`` does): still read the same, from step 1;
3. the commit point: ``consumers/GROUP.json`` renamed to
   ``consumers/recovered/GROUP.json.<ns>.deleting``. From here on no handle reads an
   offset of the group.

Then, the locks released (``delete_topic`` takes them itself): the retry topic
``equeue.retry.GROUP`` deleted (its deletion's log position is what the retry mover
drops the group's older delayed copies by: docs/groups.md), the dead-letter topic too if
asked, copies of the group file a damage set aside renamed ``.group-deleted`` (so they
no longer hold retention), and the intent file removed. A crash before step 3 leaves the
group as it was; one after it, no group, and a writer's next open finishes the rest from
the intent file (``finish_group_deletions``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import unquote

from equeue.atomicfile import read_json, write_json
from equeue.chunks.fileops import fsync_directory, write_error
from equeue.digits import ascii_number
from equeue.errors import (
    CorruptionError,
    EQueueError,
    GroupNotFoundError,
    InvalidMessageError,
    InvalidTypeError,
    StorePathError,
    StoreWriteError,
)
from equeue.format.chunk import RECOVERED_DIR
from equeue.protocol.retries import DELAY_TOPIC, MOVER_GROUP, dead_letter_topic, retry_topic
from equeue.store import deletion, grouprecord, validate
from equeue.store import offsets as group_offsets
from equeue.store.meta import CONSUMERS_DIR, OFFSETS_FILE

if TYPE_CHECKING:
    from pathlib import Path

    from equeue.store.store import MessageStore

log = logging.getLogger("equeue.consumer")

INTENT_SUFFIX = ".deleting"  # consumers/recovered/GROUP.json.<ns>.deleting
SET_ASIDE_DELETED = ".group-deleted"  # appended to a damaged copy of a deleted group
SET_ASIDE_KEY = "set_aside"  # the intent's list of the group's copies it renames


@dataclass(frozen=True)
class DeletedGroup:
    """What ``delete_group`` removed: how many committed offsets (topic and queue pairs)
    and which topics; ``unfinished``: what is left to a later open (see below)."""

    group: str
    offsets: int
    topics: tuple[str, ...]
    # Not "" when the deletion took (no handle reads the group) but a step after its
    # commit point failed, which is then finished later (the store's, not on the wire).
    unfinished: str = ""


def _step(name: str) -> None:
    """A point between two steps of a deletion (tests stop a process here)."""


def check_deletable(group: object, delete_dead_letters: object) -> str:
    name = group_offsets.check_group(group)
    # Only the mover's own group is refused: another ``equeue.*`` group was made by a
    # store before such names were refused there (review19 R19-2), and deleting it is
    # how retention lets go of what it holds.
    if name == MOVER_GROUP:
        raise InvalidMessageError(
            f"group {name!r} is the broker's own (the retry mover's cursors); it is not deleted"
        )
    if not isinstance(delete_dead_letters, bool):
        raise InvalidTypeError(
            f"delete_dead_letters must be a bool, got {type(delete_dead_letters).__name__}"
        )
    return name


def delete_group(
    store: MessageStore, group: str, *, delete_dead_letters: bool = False
) -> DeletedGroup:
    group = check_deletable(group, delete_dead_letters)
    store._check_writable()
    # An earlier deletion of the group whose finish failed (its intent file left): done
    # first, so that delete_group again is the remedy the problem names.
    retry, dead = retry_topic(group), dead_letter_topic(group)
    present = [t for t in (retry, dead) if t in store._queues]
    acted, problems = _finish_intents(store, group) if has_intent(store, group) else (0, [])
    earlier = "; ".join(problems)
    # (reported deleted too: review8 R8-4, the remedy's call said topics=())
    done_earlier = tuple(t for t in present if t not in store._queues)
    with store._checkpoint_lock, store._lock:
        store._check_writable()
        store._check_directory()
        offsets = group_offsets.committed_group(store, group)
        count = sum(len(queues) for queues in offsets.values())
        topics = tuple(
            t for t in (retry, dead if delete_dead_letters else "") if t in store._queues
        )
        if not count and not topics and not _has_file(store, group):
            if acted:  # the rest of an earlier deletion: finished now, or still not
                return DeletedGroup(group, 0, done_earlier, earlier)
            # Intent files of the group that delete nothing (moved aside, or not movable):
            # no deletion of it to report (review7 F3); what to do with them is said.
            raise GroupNotFoundError(
                f"no consumer group {group!r} in {store.path}: it has no committed offset, "
                f"no group file and no topic {retry}"
                + ("" if delete_dead_letters else f" ({dead} is deleted only with dead letters)")
                + (f"; {earlier}" if earlier else "")
            )
        intent, copies, unfinished = _commit(store, group, delete_dead_letters, offsets)
    _step("committed")
    for attempt in (1, 2):
        try:
            _finish(store, group, delete_dead_letters, intent, copies=copies)
            break
        except (OSError, EQueueError) as exc:
            # Tried once more at once (a transient EIO): an intent left while the handle
            # runs on outlives the group, which may be made again before it is finished.
            if attempt == 2:
                # The group is deleted for every handle: the caller is told so, and the
                # intent file left in consumers/recovered/ finishes the rest at the next
                # writable open or delete_group of this group, deleting only what it
                # recorded and nothing written since (_unchanged).
                unfinished = "; ".join(filter(None, (unfinished, _unfinished(store, intent, exc))))
                topics = tuple(t for t in topics if t not in store._queues)
    topics = done_earlier + topics
    if earlier:
        log.warning("group %r: its earlier intent files: %s", group, earlier)
    if unfinished:
        log.warning("group %r deleted, not finished: %s", group, unfinished)
    log.info("group %r deleted: %d committed offsets, topics %s", group, count, list(topics))
    return DeletedGroup(group, count, topics, unfinished)


def _unfinished(store: MessageStore, intent: str, exc: OSError | EQueueError) -> str:
    side = store.path / CONSUMERS_DIR / RECOVERED_DIR
    return (
        f"finishing it (its topics, set-aside copies, the intent {side / intent}) failed: "
        f"{exc}; the next writable open or delete_group of the group finishes it"
    )


def has_intent(store: MessageStore, group: str) -> bool:
    """Whether an intent file of the group is left in consumers/recovered/."""
    name = group_offsets.file_name(group)
    try:
        entries = os.listdir(store.path / CONSUMERS_DIR / RECOVERED_DIR)
    except OSError:  # none yet, or not a directory (which the deletion refuses)
        return False
    return any(e.endswith(INTENT_SUFFIX) and _names_file(e, name) for e in entries)


def _has_file(store: MessageStore, group: str) -> bool:
    """A group file, or a damaged one set aside (which holds retention: deleting the
    group is how to release it)."""
    name = group_offsets.file_name(group)
    if os.path.lexists(store.path / CONSUMERS_DIR / name):
        return True
    return any(_set_aside_of(entry, name) for entry in store._group_files.set_aside())


def _set_aside_of(entry: str, name: str, before: int = 2**64) -> bool:
    """Whether ``entry`` of consumers/recovered/ is a damaged copy of group file ``name``
    (not an intent moved aside: review7 F5), set aside before ns stamp ``before``."""
    copy = group_offsets.set_aside_copy(entry)
    return copy is not None and copy[0] == name and copy[1] < before


def _stamp(intent: str) -> int:
    """The ns stamp of intent ``NAME.<ns>.deleting``; 0 (before every copy) if it has none
    (a name no equeue writes). Only for an intent written before round 17, which does not
    list its copies: stamps come from wall clocks, which step back (review9 R9-1)."""
    stamp = intent.removesuffix(INTENT_SUFFIX).rpartition(".json.")[2]
    return ascii_number(stamp) or 0


def _names_file(entry: str, name: str) -> bool:
    """Whether ``entry`` of consumers/recovered/ (NAME.<ns>.deleting) is named after group
    file ``name``."""
    return f"{entry.rpartition('.json.')[0]}.json" == name


def _commit(
    store: MessageStore,
    group: str,
    dead_letters: bool,
    offsets: dict[str, dict[str, int]],
) -> tuple[str, list[str], str]:
    """Steps 1 to 3 (the caller holds the write lock): the intent file's name, the group's
    set-aside copies it lists, and what went wrong after the commit point ("" if
    nothing)."""
    directory = store.path / CONSUMERS_DIR
    with group_offsets._locked_dir(store.path, create=True) as dir_fd:
        assert dir_fd is not None
        # The side directory first, before anything is written: one that is not a
        # directory (made so under an open handle) refuses the deletion with the store as
        # it was (review6 R6-6: a builtin NotADirectoryError came after offsets.json had
        # dropped the group).
        side_fd = _side_directory(dir_fd, directory / RECOVERED_DIR)
        try:
            return _commit_in(store, group, dead_letters, offsets, dir_fd, side_fd)
        finally:
            os.close(side_fd)


def _side_directory(dir_fd: int, path: Path) -> int:
    """consumers/recovered/, made if missing, opened without following a link."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(RECOVERED_DIR, dir_fd=dir_fd)
    try:
        return os.open(RECOVERED_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as exc:
        raise StorePathError(
            f"is not a directory ({exc.strerror}); the group was not deleted, nothing changed",
            file=path,
        ) from None


def _commit_in(
    store: MessageStore,
    group: str,
    dead_letters: bool,
    offsets: dict[str, dict[str, int]],
    dir_fd: int,
    side_fd: int,
) -> tuple[str, list[str], str]:
    directory = store.path / CONSUMERS_DIR
    side = directory / RECOVERED_DIR
    name = group_offsets.file_name(group)
    name_path = directory / name
    files = store._group_files
    try:
        _, _, current = group_offsets._read_file(dir_fd, name, name_path)
    except FileNotFoundError:
        current = None
    except CorruptionError:  # a link, a damaged file: kept aside, never followed
        group_offsets._move_aside(directory, dir_fd, name)
        current = None
        _step("damaged file set aside")
    gathered = group_offsets._copy(offsets)
    group_offsets._merge(gathered, current or {})
    # The group's copies set aside until now (only a writer moves a group file aside, and
    # this one holds the store's lock and consumers/' flock to the commit point): the
    # finish renames these alone, whatever any clock says (review9 R9-1: ordered by their
    # stamps against the intent's, a copy the group made again set aside with a clock
    # stepped back was renamed too, and stopped holding retention).
    copies = sorted(e for e in os.listdir(side_fd) if _set_aside_of(e, name))
    deleting = {
        "dead_letters": dead_letters,
        "topics": _scope(store, group, dead_letters),
        SET_ASIDE_KEY: copies,
    }
    body = {"group": group, "offsets": gathered, "deleting": deleting}
    before = store._offsets
    write_json(directory / name, body)  # (atomic: a failure leaves the file as it was)
    _step("gathered")
    intent = f"{name}.{time.time_ns()}{INTENT_SUFFIX}"
    try:
        if group in store._offsets:
            kept = {g: ts for g, ts in store._offsets.items() if g != group}
            deletion._lower_committed_count(
                store, sum(len(q) for ts in kept.values() for q in ts.values())
            )
            write_json(store.path / OFFSETS_FILE, kept)
            store._offsets = kept
            _step("offsets.json written")
        # The checkpoint's record of group files without it, before the file goes: its
        # removal is then no loss to a reader (grouprecord).
        grouprecord.forget(store, group)
        os.rename(name, intent, src_dir_fd=dir_fd, dst_dir_fd=side_fd)  # the commit point
    except OSError as exc:  # StoreWriteError too (write_json's, naming its file)
        undone = _undo(store, group, before, current)
        error = (
            exc
            if isinstance(exc, StoreWriteError)
            else write_error(
                exc,
                f"deleting group {group!r}: its commit point, the rename into {side}",
                name_path,
            )
        )
        raise type(error)(
            error.errno, f"{error.strerror}; the group was not deleted, {undone}"
        ) from None
    files._parsed.pop(name, None)
    try:
        os.fsync(side_fd)
        os.fsync(dir_fd)
    except OSError as exc:  # the rename is made: every handle reads the group as gone
        return (
            intent,
            copies,
            (
                f"syncing {side} and {directory} after the commit point failed "
                f"({exc.strerror or exc}): a power cut before the next sync may bring the "
                "group back whole"
            ),
        )
    return intent, copies, ""


def _scope(store: MessageStore, group: str, dead_letters: bool) -> dict[str, Any]:
    """What a later finish of the intent may delete: each topic's deletion mark (a topic
    made again has a newer one) and its queues' ends, as of the intent."""
    names = (retry_topic(group), dead_letter_topic(group) if dead_letters else "", DELAY_TOPIC)
    return {
        topic: {
            "mark": store._deleted.get(topic, -1),
            "ends": [queue.next_offset for queue in store._queues[topic]],
        }
        for topic in names
        if topic in store._queues
    }


def _unchanged(store: MessageStore, topic: str, scope: dict[str, Any] | None) -> bool:
    """Whether ``topic`` is as the intent recorded it (None: an intent of an equeue that
    recorded nothing, acted on as before): nothing was written to it since, and it was
    not made again (a group made again since its deletion may have written to it)."""
    if scope is None:
        return True
    known = scope.get(topic)  # (its shape checked by read_intent)
    queues = store._queues.get(topic)
    if queues is None:
        return known is None or store._deleted.get(topic, -1) == known["mark"]
    if known is None or store._deleted.get(topic, -1) != known["mark"]:
        return False
    ends = known["ends"]
    return len(ends) == len(queues) and all(
        q.next_offset <= end for q, end in zip(queues, ends, strict=True)
    )


def _undo(
    store: MessageStore,
    group: str,
    before: dict[str, Any],
    current: dict[str, dict[str, int]] | None,
) -> str:
    """The commit point failed: offsets.json and the group file put back as they were
    (each step keeps every handle's view of the group, as steps 1 and 2 did); what the
    error says of them."""
    directory = store.path / CONSUMERS_DIR
    name = group_offsets.file_name(group)
    try:
        if store._offsets is not before:
            write_json(store.path / OFFSETS_FILE, before)
            store._offsets = before
        if current is None:
            os.unlink(directory / name)
        else:
            write_json(directory / name, {"group": group, "offsets": current})
    except (OSError, EQueueError) as exc:
        return (
            f"and putting its files back failed too ({exc}): {directory / name} holds its "
            "offsets with the intent, which every handle reads as the group's offsets and "
            "the next writable open keeps"
        )
    finally:
        store._group_files._parsed.pop(name, None)
    return "its files are as they were"


def _finish(
    store: MessageStore,
    group: str,
    dead_letters: bool,
    intent: str,
    scope: dict[str, Any] | None = None,
    *,
    copies: list[str] | None,
) -> list[str]:
    """After the commit point: the group's topics, its set-aside copies, the intent.
    ``scope``: the intent's record, at a later finish (see _unchanged); ``copies``: the
    set-aside copies it lists (None: an intent written before the list). The topics kept
    because they changed since."""
    retry = retry_topic(group)
    marked = False
    kept = []
    for topic in (retry, dead_letter_topic(group) if dead_letters else None):
        if topic is not None and topic in store._queues:
            if not _unchanged(store, topic, scope):
                kept.append(topic)
                continue
            store.delete_topic(topic)
            marked = marked or topic == retry
            _step("topic deleted")
    # The mark drops the group's delayed copies below it: not when equeue.delay was
    # written to since the intent (copies of the group made again may be there).
    if (
        not marked
        and not kept
        and DELAY_TOPIC in store._queues
        and _is_topic(retry)
        and _unchanged(store, retry, scope)
        and _unchanged(store, DELAY_TOPIC, scope)
    ):
        # Delayed copies of the group may wait in equeue.delay: the mover drops the ones
        # below the retry topic's latest deletion, so one is recorded now (not by making
        # the topic and deleting it: a crash between left an empty topic, review8 R8-1).
        deletion.record_mark(store, retry)
    side = store.path / CONSUMERS_DIR / RECOVERED_DIR
    name = group_offsets.file_name(group)
    # Only the copies set aside before the intent (its commit point took the group file):
    # a later one is a group made again since, whose copy holds retention (review8 R8-3).
    # The intent lists them; one written before the list: those stamped before it.
    before = _stamp(intent) if copies is None else 0
    listed = None if copies is None else set(copies)  # (a list: O(entries x copies))
    for entry in sorted(os.listdir(side)):
        if entry in listed if listed is not None else _set_aside_of(entry, name, before):
            os.rename(side / entry, side / f"{entry}{SET_ASIDE_DELETED}")
    with contextlib.suppress(FileNotFoundError):  # (removed by a first try: fsync failed)
        os.unlink(side / intent)
    fsync_directory(side)
    _step("done")
    return kept


def _is_topic(name: str) -> bool:
    try:
        validate.check_topic(name)
    except EQueueError:
        return False
    return True


def finish_group_deletions(store: MessageStore, only: str | None = None) -> list[str]:
    """At a writer's open (and at ``delete_group`` for ``only`` its group): finish the
    deletions a crash or an I/O error interrupted after their commit point; what could
    not be finished (a problem of the open, tried again next time)."""
    return _finish_intents(store, only)[1]


def _finish_intents(store: MessageStore, only: str | None) -> tuple[int, list[str]]:
    """finish_group_deletions': also how many intents were a deletion's (finished, or
    failing to be), not moved aside or dropped."""
    side = store.path / CONSUMERS_DIR / RECOVERED_DIR
    try:
        entries = sorted(e for e in os.listdir(side) if e.endswith(INTENT_SUFFIX))
    except OSError:
        return 0, []
    if only is not None:
        entries = [e for e in entries if _names_file(e, group_offsets.file_name(only))]
    problems = []
    acted = 0
    for entry in entries:
        try:
            record = read_intent(side / entry, entry)
        except (EQueueError, OSError) as exc:
            problems.append(_set_aside_intent(side, entry, exc))
            continue
        try:
            group = record.group
            here = store.path / CONSUMERS_DIR / group_offsets.file_name(group)
            if _is_intent(here):  # its commit point never took (a power cut): no deletion
                os.unlink(side / entry)
                continue
            acted += 1
            kept = _finish(
                store, group, record.dead_letters, entry, record.scope, copies=record.copies
            )
            log.warning(
                "group %r: a deletion a crash or an I/O error interrupted was finished%s",
                group,
                f"; kept {kept}: written to or made again since the deletion (a group made "
                f"again under the name); delete_group({group!r}) deletes them"
                if kept
                else "",
            )
        except (EQueueError, OSError) as exc:
            problems.append(f"finishing the deletion of a consumer group ({entry}) failed: {exc}")
    return acted, problems


class IntentRecord(NamedTuple):
    """What an intent file says: ``scope`` None and ``copies`` None for one written by an
    equeue before the record or the list (acted on as then)."""

    group: str
    dead_letters: bool
    scope: dict[str, Any] | None
    copies: list[str] | None


def read_intent(path: Path, entry: str) -> IntentRecord:
    body: Any = read_json(path)
    deleting = body.get("deleting") if isinstance(body, dict) else None
    group = body.get("group") if isinstance(body, dict) else None
    if not isinstance(deleting, dict) or not isinstance(group, str):
        raise CorruptionError("is not a group deletion's intent file", file=path, offset=0)
    # The body must name the group of the file's own name, and one delete_group takes: an
    # intent copied or renamed from elsewhere would delete another group's retry topic
    # while its offsets stay (neither whole nor gone), or an equeue.* topic.
    try:
        check_deletable(group, False)
    except EQueueError as exc:
        raise CorruptionError(f"names a group delete_group refuses ({exc})", file=path) from None
    if not _names_file(entry, group_offsets.file_name(group)):
        raise CorruptionError(
            f"names group {group!r}, whose intent file would be named "
            f"{group_offsets.file_name(group)}.<ns>{INTENT_SUFFIX}",
            file=path,
        )
    dead_letters = deleting.get("dead_letters") is True
    copies = (
        _checked_copies(deleting[SET_ASIDE_KEY], group, path) if SET_ASIDE_KEY in deleting else None
    )
    if "topics" not in deleting:  # written by an equeue before the record (acted on as then)
        return IntentRecord(group, dead_letters, None, copies)
    return IntentRecord(
        group, dead_letters, _checked_scope(deleting["topics"], group, path), copies
    )


def _checked_copies(copies: object, group: str, path: Path) -> list[str]:
    """The list of set-aside copies as _commit writes it, else damage: a name that is not
    a damaged copy of this group's file (``NAME.<ns>[.<k>].damaged``) would have the
    finish rename another group's copy, or an entry no equeue made."""
    name = group_offsets.file_name(group)
    if isinstance(copies, list):
        for copy in copies:
            if not isinstance(copy, str) or not _set_aside_of(copy, name):
                raise CorruptionError(
                    f'has a bad "{SET_ASIDE_KEY}" entry {str(copy)[:80]!r} (each a '
                    f"{name}.<ns>[.<k>].damaged in consumers/{RECOVERED_DIR}/)",
                    file=path,
                )
        return copies
    raise CorruptionError(
        f'has a "{SET_ASIDE_KEY}" that is a {type(copies).__name__}, not a list', file=path
    )


def _is_count(value: object, low: int) -> bool:
    return type(value) is int and low <= value < 2**63


def _checked_scope(scope: object, group: str, path: Path) -> dict[str, Any]:
    """``"topics"`` as _scope writes it, else damage (review8 R8-2: a malformed record read
    as "none" was acted on as an old intent, or kept every topic as "made again" and
    removed the intent): the group's own names only, each with a mark (-1: none) and at
    most one end per queue a topic may have."""
    names = (retry_topic(group), dead_letter_topic(group), DELAY_TOPIC)
    if isinstance(scope, dict):
        for topic, known in scope.items():
            ends = known.get("ends") if isinstance(known, dict) else None
            if (
                topic not in names
                or not isinstance(known, dict)
                or not _is_count(known.get("mark"), -1)
                or not isinstance(ends, list)
                or len(ends) > validate.MAX_QUEUES
                or not all(_is_count(end, 0) for end in ends)
            ):
                raise CorruptionError(
                    f'has a bad "topics" entry {str(topic)[:80]!r} (each of {list(names)} '
                    'at most, as {"mark": int >= -1, "ends": [int >= 0, one a queue]})',
                    file=path,
                )
        return scope
    raise CorruptionError(f'has a "topics" that is a {type(scope).__name__}, not a dict', file=path)


def _set_aside_intent(side: Path, entry: str, exc: OSError | EQueueError) -> str:
    """An intent that cannot be acted on, renamed (never followed) ``.damaged``: nothing is
    deleted by it; the problem says how to finish the deletion if there was one."""
    moved = side / group_offsets.damaged_name(side, entry)
    try:
        os.rename(side / entry, moved)
        fsync_directory(side)
    except OSError as failed:
        kept = (
            f"moving it aside failed ({failed.strerror or failed}): remove {side / entry} "
            "yourself (every writable open and delete_group of the group reports it until then)"
        )
    else:
        kept = f"it was moved to {moved}"
    return intent_problem(entry, exc, f"nothing was deleted by it and {kept}")


def intent_problem(
    entry: str,
    exc: OSError | EQueueError,
    done: str = "the next writable open deletes nothing by it and moves it aside",
) -> str:
    """What is wrong with intent file ``entry``, what was (or will be) done, the remedy."""
    group = unquote(entry.rpartition(".json.")[0])
    return (
        f"a group deletion's intent file that cannot be acted on ({exc}); {done}; if "
        f"group {group!r} was being deleted, run delete_group({group!r}) again to finish "
        "it (GroupNotFoundError then: nothing of it is left)"
    )


def _is_intent(path: Path) -> bool:
    try:
        body = read_json(path)
    except (OSError, EQueueError):
        return False
    return isinstance(body, dict) and "deleting" in body
