"""Consumer offsets: the writer's ``offsets.json`` and the group files of consumers in
other processes (``consumers/``), read together as one view.

Only the writer rewrites ``offsets.json`` (``commit_offset``, from its memory, under
its lock), so the consumer loop, which also runs on ``read_only`` handles in other
processes, commits to a file of its group instead, ``consumers/<group>.json``,
replaced atomically (``write_json``) under an ``flock`` on the ``consumers/``
directory, which orders every process's commits (and keeps the fsyncs of a commit off
the writer's send lock). Every handle reads a group's committed offset on a queue as
the larger of the two files' values, so a commit from any process is seen by all, and
a group's offset never moves back through a consumer's commit (two consumers of one
group each commit how far they got, and the farther one wins). ``commit_offset`` sets
an offset explicitly, also lower: it writes ``offsets.json``, then drops the group
file's higher entry.

Nothing here follows a symbolic link: the directory and its files are opened with
``O_NOFOLLOW``. A file that is a link, not a regular file, not named as its group's
file would be, or whose checksum or entries do not check out is reported and ignored;
a writable open moves it to ``consumers/recovered/``, and so does the writer's commit
onto it at run time, which writes the offsets the writer last read of it with the commit
(``GroupFiles._recover``); a read-only handle's commit onto it raises ``CorruptionError``.
``committed_offset`` reads one group's file (``GroupFiles.group``), not all of them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import xxhash

from equeue.atomicfile import decode_json, write_json
from equeue.chunks.fileops import fsync_directory, write_error
from equeue.digits import ascii_number
from equeue.errors import CorruptionError, EQueueError, InvalidMessageError
from equeue.format.chunk import RECOVERED_DIR, TEMP_SUFFIX
from equeue.format.message import MAX_NAME_BYTES
from equeue.store import validate
from equeue.store.meta import CONSUMERS_DIR, OFFSETS_FILE, read_meta
from equeue.store.topics import deletions
from equeue.store.topicsfile import read_topics_body

if TYPE_CHECKING:
    from equeue.store.store import MessageStore

log = logging.getLogger("equeue.consumer")

# group -> topic -> queue id (decimal str, as in offsets.json) -> committed offset
Offsets = dict[str, dict[str, dict[str, int]]]
# A file name longer than this (a long group name, percent-encoded) ends in a hash.
_LONG_NAME = 160
# A temp file older than this was left by a process killed while committing.
_STALE_TEMP_SECONDS = 60.0
# Far above any group's offsets (a few dozen bytes per queue): a larger file is not ours.
_MAX_FILE_BYTES = 64 << 20
_IDENTITY = tuple[int, int, int]


def check_group(group: object) -> str:
    """A group name as ``commit_offset`` takes it: a non-empty str of at most 255 bytes."""
    if (
        not isinstance(group, str)
        or not group
        or len(validate.utf8(group, "group")) > MAX_NAME_BYTES
    ):
        raise InvalidMessageError(f"group must be a non-empty str of at most 255 bytes: {group!r}")
    return group


def file_name(group: str) -> str:
    """The group's file in ``consumers/``: its name percent-encoded (any group name is a
    safe file name), a hash in place of the end of a long one."""
    quoted = quote(group, safe="")
    if len(quoted) > _LONG_NAME:  # "%%" never occurs in quote()'s output
        quoted = f"{quoted[:100]}%%{xxhash.xxh64_hexdigest(group.encode())}"
    return quoted + ".json"


# --- reading ---------------------------------------------------------------------------


def _identity(st: os.stat_result) -> _IDENTITY:
    return st.st_ino, st.st_size, st.st_mtime_ns


def _check_body(body: Any, name: str, path: Path) -> tuple[str, dict[str, dict[str, int]]]:
    """(group, its offsets) of a group file's body; CorruptionError naming the file."""
    try:
        if not isinstance(body, dict) or not isinstance(body.get("offsets"), dict):
            raise InvalidMessageError("it holds no {'group': ..., 'offsets': {...}}")
        group = check_group(body.get("group"))
        if file_name(group) != name:
            raise InvalidMessageError(f"it holds group {group!r}, whose file is {file_name(group)}")
        offsets: dict[str, dict[str, int]] = body["offsets"]
        for topic, queues in offsets.items():
            validate.check_topic(topic)
            if not isinstance(queues, dict):
                raise InvalidMessageError(f"the queues of {topic!r} are not a mapping")
            for queue_id, offset in queues.items():
                # (ascii_number: past 4,300 digits int() raises a builtin ValueError, which
                # this function's except would not catch: R11-7)
                number = ascii_number(queue_id)
                if number is None or number >= validate.MAX_QUEUES:
                    raise InvalidMessageError(f"bad queue id {queue_id[:40]!r} of {topic!r}")
                if (
                    not isinstance(offset, int)
                    or isinstance(offset, bool)
                    or not 0 <= offset <= validate.MAX_FILE_OFFSET
                ):
                    raise InvalidMessageError(f"bad offset {offset!r} of {topic}/{queue_id}")
    except EQueueError as exc:
        raise CorruptionError(f"bad consumer group file ({exc})", file=path, offset=0) from None
    return group, offsets


def _read_file(dir_fd: int, name: str, path: Path) -> tuple[_IDENTITY, str, dict[str, Any]]:
    """(identity, group, offsets) of one group file, opened without following a link;
    FileNotFoundError if it is gone, CorruptionError if it is not a group file."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CorruptionError(
                "is a symbolic link, not a consumer group file (equeue follows no link "
                "inside a store)",
                file=path,
            ) from None
        if exc.errno == errno.ENOENT:
            raise
        raise CorruptionError(f"cannot be read ({exc.strerror})", file=path) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptionError("is not a regular file, not a consumer group file", file=path)
        if st.st_size > _MAX_FILE_BYTES:
            raise CorruptionError(
                f"is {st.st_size} bytes, more than a consumer group file holds ({_MAX_FILE_BYTES})",
                file=path,
            )
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read()
    finally:
        os.close(fd)
    group, offsets = _check_body(decode_json(raw, path), name, path)
    return _identity(st), group, offsets


def _open_dir(directory: Path) -> int | None:
    """A descriptor of ``consumers/``; None if there is none. CorruptionError if it is a
    link or not a directory."""
    try:
        return os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise CorruptionError(
                "is a symbolic link or a file where the store keeps its consumer group "
                "files (a directory); they are ignored",
                file=directory,
            ) from None
        raise CorruptionError(f"cannot be read ({exc.strerror})", file=directory) from None


class GroupFiles:
    """A handle's view of ``consumers/``: each group file parsed once per version
    (inode, size, mtime), so a lookup costs a directory listing."""

    def __init__(self, store_path: Path, problems: list[str], *, writer: bool) -> None:
        self.store_path = store_path
        self.directory = store_path / CONSUMERS_DIR
        self.writer = writer
        self._parsed: dict[str, tuple[_IDENTITY, str, dict[str, Any]]] = {}
        self._reported: set[str] = set()
        self._offsets_identity: _IDENTITY | None = None
        # What the last scan found wrong: (the error, what was done about it).
        self.found: list[tuple[CorruptionError, str]] = []
        # Group files the last scan could not read and of which this handle knows no
        # offsets (never read whole): retention holds while there are any (reviewf F9).
        self.unknown: list[CorruptionError] = []
        # File name -> group, as the checkpoint's listing last found them (a name's group
        # never changes): each checkpoint parses only the names new since (grouprecord).
        self.names: dict[str, str] = {}
        self.scan(move_aside=writer)
        problems.extend(self.problems)

    @property
    def problems(self) -> list[str]:
        return [f"{exc}; {done}" for exc, done in self.found]

    def scan(self, *, move_aside: bool = False) -> Offsets:
        """Every readable group file's offsets; what is wrong goes to ``problems`` (logged
        once) and, with ``move_aside`` (a writer's open), to ``consumers/recovered/``."""
        problems: list[tuple[CorruptionError, str]] = []
        groups: Offsets = {}
        self.unknown = []
        try:
            dir_fd = _open_dir(self.directory)
        except CorruptionError as exc:
            self._report([(exc, "ignored")])
            return groups
        if dir_fd is None:
            self._report([])
            return groups
        try:
            with _dir_lock(dir_fd) if move_aside else contextlib.nullcontext():
                for entry in os.scandir(dir_fd):
                    found = self._entry(dir_fd, entry, move_aside, problems)
                    if found is not None:
                        groups[found[0]] = found[1]
        finally:
            os.close(dir_fd)
        self._report(problems)
        return groups

    def _entry(
        self,
        dir_fd: int,
        entry: os.DirEntry[str],
        move_aside: bool,
        problems: list[tuple[CorruptionError, str]],
    ) -> tuple[str, dict[str, Any]] | None:
        name = entry.name
        path = self.directory / name
        if name == RECOVERED_DIR:
            return None
        if name.endswith(TEMP_SUFFIX):  # a commit in flight, or one a kill interrupted
            if move_aside:
                with contextlib.suppress(OSError):
                    if time.time() - entry.stat(follow_symlinks=False).st_mtime > (
                        _STALE_TEMP_SECONDS
                    ):
                        os.unlink(name, dir_fd=dir_fd)
            return None
        try:
            if not name.endswith(".json"):
                raise CorruptionError("is not a consumer group file (GROUP.json)", file=path)
            st = entry.stat(follow_symlinks=False)
            cached = self._parsed.get(name)
            if cached is not None and cached[0] == _identity(st) and stat.S_ISREG(st.st_mode):
                return cached[1], cached[2]
            parsed = _read_file(dir_fd, name, path)
        except FileNotFoundError:  # replaced or moved aside meanwhile
            return None
        except CorruptionError as exc:
            if not move_aside:  # the last good parse stays: a writer's commit restores it
                return self._last_good(name, exc, problems)
            self._parsed.pop(name, None)
            try:
                moved = _move_aside(self.directory, dir_fd, name)
            except OSError as failed:
                problems.append((exc, f"ignored (moving it aside failed: {failed})"))
            else:
                problems.append((exc, f"moved to {moved}"))
            return None
        self._parsed[name] = parsed
        return parsed[1], parsed[2]

    def _last_good(
        self,
        name: str,
        exc: CorruptionError,
        problems: list[tuple[CorruptionError, str]],
        *,
        scanning: bool = True,
    ) -> tuple[str, dict[str, Any]] | None:
        """A damaged group file read by a scan that leaves it in place: the offsets this
        handle last read or wrote of it stand for it (what the group's next commit writes
        over it), so that neither retention nor a committed offset acts on the group as if
        it had committed nothing (reviewf F9: retention removed 361 messages the group had
        not consumed). Never read whole here: it is unknown (retention holds)."""
        cached = self._parsed.get(name)
        if cached is None:
            problems.append((exc, "ignored; retention holds until it is readable or moved"))
            if scanning:  # (what retention reads: set by each scan)
                self.unknown.append(exc)
            return None
        problems.append((exc, "its offsets as last read are used until the group commits"))
        return cached[1], cached[2]

    def set_aside(self) -> list[str]:
        """Group files moved to ``consumers/recovered/`` (damaged: by a writer's open or a
        commit) whose group has not committed since (no ``consumers/NAME`` again): their
        offsets are unknown to every handle, across restarts too, so retention with
        ``retention_respects_consumers`` holds while there are any (review3 R5). The
        recovered copies' names, oldest first."""
        try:
            here = set(os.listdir(self.directory))
            moved = os.listdir(self.directory / RECOVERED_DIR)
        except OSError:  # no consumers/ or no recovered/ (or not readable: said elsewhere)
            return []
        found = []
        for entry in moved:
            copy = set_aside_copy(entry)
            if copy is not None and copy[0] not in here:
                found.append((copy[1], entry))
        return [entry for _, entry in sorted(found)]

    def forget_topic(self, name: str, topic: str) -> None:
        """``topic`` deleted: its offsets gone from the last good parse of group file
        ``name``, which stands for the file while it cannot be read (``_last_good``), so a
        topic created again under the name is not read from the old one's offsets."""
        cached = self._parsed.get(name)
        if cached is not None and topic in cached[2]:
            kept = {t: qs for t, qs in cached[2].items() if t != topic}
            self._parsed[name] = (cached[0], cached[1], kept)

    def _report(self, found: list[tuple[CorruptionError, str]]) -> None:
        self.found = found
        for problem in self.problems:
            self._say(problem)

    def _say(self, problem: str) -> None:
        if problem not in self._reported:
            self._reported.add(problem)
            log.warning("consumer offsets: %s", problem)

    def group(self, group: str) -> dict[str, dict[str, int]]:
        """One group's file's offsets as ``scan`` reads them (a damaged file reported once
        and ignored), at the cost of one stat while the file is unchanged: what
        ``committed_offset`` reads, rather than every group's file. The dict is the
        cache's: not to be changed."""
        name = file_name(group)
        try:
            dir_fd = _open_dir(self.directory)
        except CorruptionError as exc:
            self._say(f"{exc}; ignored")
            return {}
        if dir_fd is None:
            return {}
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            cached = self._parsed.get(name)
            if cached is not None and cached[0] == _identity(st) and stat.S_ISREG(st.st_mode):
                return cached[2]
            parsed = _read_file(dir_fd, name, self.directory / name)
        except FileNotFoundError:
            return {}
        except CorruptionError as exc:
            found: list[tuple[CorruptionError, str]] = []
            last = self._last_good(name, exc, found, scanning=False)
            self._say(f"{exc}; {found[0][1]}")
            return {} if last is None else last[1]
        finally:
            os.close(dir_fd)
        self._parsed[name] = parsed
        return parsed[2]

    def _remember(self, dir_fd: int, group: str, offsets: dict[str, dict[str, int]]) -> None:
        """What this handle just wrote to the group's file (under the directory's lock):
        the last good offsets a later commit onto a damaged file starts from."""
        name = file_name(group)
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            self._parsed.pop(name, None)
            return
        self._parsed[name] = (_identity(st), group, _copy(offsets))

    def _recover(
        self, dir_fd: int, group: str, damage: CorruptionError
    ) -> dict[str, dict[str, int]]:
        """A writer's commit onto a damaged group file, under the directory's lock: the
        file moved to ``consumers/recovered/`` (as the writer's open moves it), and the
        offsets this handle last read of it returned, for the commit to be written over."""
        name = file_name(group)
        try:
            moved = _move_aside(self.directory, dir_fd, name)
        except OSError as exc:
            raise CorruptionError(
                f"{damage.reason}; moving it to {CONSUMERS_DIR}/{RECOVERED_DIR}/ failed "
                f"({exc}), so no commit of group {group!r} can be written until it is moved",
                file=damage.file,
                offset=damage.offset,
            ) from None
        last = self._parsed.pop(name, None)
        offsets = {} if last is None else _copy(last[2])
        count = sum(len(queues) for queues in offsets.values())
        self._say(
            f"{damage}; moved to {moved} by a commit of its group, which wrote the file "
            f"again from the {count} offsets this handle last read or wrote there"
        )
        return offsets

    def writer_offsets(self, store: MessageStore) -> Offsets:
        """``offsets.json`` as the writer keeps it; a read-only handle re-reads it when
        it changed (one stat), so its view follows the writer's commits."""
        if store.read_only:
            path = store.path / OFFSETS_FILE
            try:
                identity: _IDENTITY | None = _identity(os.stat(path, follow_symlinks=False))
            except OSError:
                identity = None
            if identity != self._offsets_identity:
                problems: list[str] = []  # the open reported them already
                store._offsets = read_meta(store.path, OFFSETS_FILE, {}, problems, move_aside=False)
                self._offsets_identity = identity
        return store._offsets


def _copy(offsets: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {topic: dict(queues) for topic, queues in offsets.items()}


def _merge(into: dict[str, dict[str, int]], offsets: dict[str, dict[str, int]]) -> None:
    for topic, queues in offsets.items():
        mine = into.setdefault(topic, {})
        for queue_id, offset in queues.items():
            if offset > mine.get(queue_id, -1):
                mine[queue_id] = offset


def committed(store: MessageStore) -> Offsets:
    """Every group's committed offsets as this handle sees them: per queue, the larger of
    ``offsets.json``'s and the group file's value."""
    store._check_open()
    files = store._group_files
    merged = {g: _copy(ts) for g, ts in files.writer_offsets(store).items()}
    for group, topics in files.scan().items():
        _merge(merged.setdefault(group, {}), topics)
    return merged


def committed_group(store: MessageStore, group: str) -> dict[str, dict[str, int]]:
    """One group's committed offsets as ``committed`` merges them, from ``offsets.json``'s
    entry and that group's file only (one stat of each while they are unchanged)."""
    store._check_open()
    files = store._group_files
    mine = _copy(files.writer_offsets(store).get(group, {}))
    _merge(mine, files.group(group))
    return mine


def by_queue_id(offsets: Offsets) -> dict[str, dict[str, dict[int, int]]]:
    return {
        g: {t: {int(q): o for q, o in qs.items()} for t, qs in ts.items()}
        for g, ts in offsets.items()
    }


# --- writing ---------------------------------------------------------------------------


@contextlib.contextmanager
def _dir_lock(dir_fd: int) -> Iterator[None]:
    """The ``flock`` that orders commits to ``consumers/`` across processes (released
    when the descriptor closes, also by a kill)."""
    fcntl.flock(dir_fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(dir_fd, fcntl.LOCK_UN)


@contextlib.contextmanager
def _locked_dir(store_path: Path, *, create: bool) -> Iterator[int | None]:
    """``consumers/`` opened and locked; None if there is none (and not ``create``), or,
    unless ``create``, if it is no directory (every reader ignores it then)."""
    directory = store_path / CONSUMERS_DIR
    try:
        dir_fd = _open_dir(directory)
    except CorruptionError:
        if create:
            raise
        dir_fd = None
    if dir_fd is None and create:
        try:
            directory.mkdir(exist_ok=True)
            fsync_directory(store_path)
        except OSError as exc:
            raise write_error(exc, "creating", directory) from exc
        dir_fd = _open_dir(directory)
    if dir_fd is None:
        yield None
        return
    try:
        with _dir_lock(dir_fd):
            yield dir_fd
    finally:
        os.close(dir_fd)


def _current(
    dir_fd: int, directory: Path, group: str, files: GroupFiles | None
) -> tuple[dict[str, dict[str, int]], bool]:
    """The group file's offsets (none yet: empty), to be changed, and whether the file
    was damaged and moved aside (then it is to be written whatever changes). A damaged
    file: ``files._recover``'s offsets (a writer's handle), else CorruptionError."""
    name = file_name(group)
    try:
        identity, _, offsets = _read_file(dir_fd, name, directory / name)
    except FileNotFoundError:
        return {}, False
    except CorruptionError as exc:
        if files is None or not files.writer:
            raise CorruptionError(
                f"{exc.reason}; the writer's next commit of this group, or a writable open "
                f"of the store, moves it to {RECOVERED_DIR}/, then commits go on",
                file=exc.file,
                offset=exc.offset,
            ) from None
        return files._recover(dir_fd, group, exc), True
    if files is not None:
        files._parsed[name] = (identity, group, _copy(offsets))
    return offsets, False


def _write(
    directory: Path,
    dir_fd: int,
    group: str,
    offsets: dict[str, dict[str, int]],
    files: GroupFiles | None,
) -> None:
    write_json(directory / file_name(group), {"group": group, "offsets": offsets})
    if files is not None:
        files._remember(dir_fd, group, offsets)


def commit_group_file(
    store_path: Path,
    group: str,
    positions: dict[tuple[str, int], int],
    deleted: dict[str, int | None] | None = None,
    *,
    files: GroupFiles | None = None,
) -> None:
    """A consumer's commit: each queue's offset raised to ``positions``' (never
    lowered), under the directory's lock. ``deleted`` is each topic's deletion marker
    as the consumer knew it: a topic deleted since (topics.json says otherwise) is left
    out, as its offsets belong to the old topic (delete_topic drops them from the files
    under the same lock, after its topics.json write). ``files``: the committing
    handle's; a writer's moves a damaged file aside and writes the offsets it last read
    of it with this commit (``GroupFiles._recover``)."""
    directory = store_path / CONSUMERS_DIR
    with _locked_dir(store_path, create=True) as dir_fd:
        assert dir_fd is not None
        if deleted is not None:
            now = _deletions(store_path)
            positions = {k: v for k, v in positions.items() if now.get(k[0]) == deleted.get(k[0])}
        offsets, changed = _current(dir_fd, directory, group, files)
        for (topic, queue_id), offset in positions.items():
            queues = offsets.setdefault(topic, {})
            if offset > queues.get(str(queue_id), -1):
                queues[str(queue_id)] = offset
                changed = True
        if changed:
            _write(directory, dir_fd, group, offsets, files)


def commit_group(
    store: MessageStore,
    group: str,
    positions: dict[tuple[str, int], int],
    deleted: dict[str, int | None] | None = None,
) -> None:
    """``commit_group_file`` by a handle: a writer's moves a damaged group file aside and
    goes on from what it last read of it."""
    store._check_directory()
    commit_group_file(store.path, group, positions, deleted, files=store._group_files)


def drop_topic(store_path: Path, topic: str, files: GroupFiles | None = None) -> None:
    """``delete_topic``'s: ``topic``'s offsets dropped from every group file, under the
    directory's lock (a file that cannot be read is left to a writable open, which moves
    it aside); run again by the open that finishes an interrupted deletion."""
    directory = store_path / CONSUMERS_DIR
    with _locked_dir(store_path, create=False) as dir_fd:
        if dir_fd is None:
            return
        for name in sorted(os.listdir(dir_fd)):
            if not name.endswith(".json"):
                continue
            try:
                _, group, offsets = _read_file(dir_fd, name, directory / name)
            except FileNotFoundError:
                continue
            except CorruptionError:
                if files is not None:  # its last good offsets stand for it: not the topic's
                    files.forget_topic(name, topic)  # (review3 R3)
                continue
            if topic in offsets:
                kept = {t: qs for t, qs in offsets.items() if t != topic}
                # Remembered: a later commit onto a damaged file must not bring them back.
                _write(directory, dir_fd, group, kept, files)


def _deletions(store_path: Path) -> dict[str, int]:
    """topics.json's deletion markers; none when it cannot be read (a writable open
    rebuilds it, and reports that)."""
    try:
        return deletions(read_topics_body(store_path))
    except (OSError, EQueueError):
        return {}


def set_offset(store: MessageStore, group: str, topic: str, queue_id: int, offset: int) -> None:
    """``commit_offset``'s write (the caller holds the write lock): ``offsets.json`` set
    to ``offset``, then a higher value in the group's file dropped, so the explicit offset
    is what every handle reads (a reset). In that order: a kill between the two writes
    leaves the offset committed before (the group file's higher value still wins), not
    ``offsets.json``'s older value. A failure leaves both files as they were, but for a
    damaged group file, which is moved aside and written again first (as by a commit)."""
    store._check_directory()
    offsets = {g: _copy(ts) for g, ts in store._offsets.items()}
    offsets.setdefault(group, {}).setdefault(topic, {})[str(queue_id)] = offset
    directory, files = store.path / CONSUMERS_DIR, store._group_files
    with _locked_dir(store.path, create=False) as dir_fd:
        current: dict[str, dict[str, int]] = {}
        if dir_fd is not None:
            try:
                current, recovered = _current(dir_fd, directory, group, files)
            except CorruptionError:  # damaged, and not movable aside: every reader ignores it
                current, recovered = {}, False
            if recovered:
                _write(directory, dir_fd, group, current, files)
        write_json(store.path / OFFSETS_FILE, offsets)
        if dir_fd is not None and current.get(topic, {}).get(str(queue_id), -1) > offset:
            try:
                _write(directory, dir_fd, group, _without(current, topic, str(queue_id)), files)
            except BaseException:
                write_json(store.path / OFFSETS_FILE, store._offsets)
                raise
    store._offsets = offsets


def _without(
    offsets: dict[str, dict[str, int]], topic: str, queue_id: str
) -> dict[str, dict[str, int]]:
    kept = _copy(offsets)
    del kept[topic][queue_id]
    return kept


def _move_aside(directory: Path, dir_fd: int, name: str) -> Path:
    """``consumers/recovered/NAME.<ns>.damaged`` (the entry renamed, never followed)."""
    side = directory / RECOVERED_DIR
    with contextlib.suppress(FileExistsError):
        os.mkdir(RECOVERED_DIR, dir_fd=dir_fd)
    moved = side / damaged_name(side, f"{name}.{time.time_ns()}")
    side_fd = os.open(RECOVERED_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
    try:
        os.rename(name, moved.name, src_dir_fd=dir_fd, dst_dir_fd=side_fd)
        os.fsync(side_fd)
        os.fsync(dir_fd)
    finally:
        os.close(side_fd)
    return moved


def damaged_name(side: Path, stem: str) -> str:
    """The name in consumers/recovered/ (``side``) for an entry moved aside as damaged:
    ``STEM.damaged``, or ``STEM.<k>.damaged`` when that is taken, so that the evidence an
    earlier move left is never overwritten (review7 F4). STEM is ``NAME.<ns>`` for a group
    file, ``NAME.<ns>.deleting`` for a group deletion's intent."""
    for k in range(_DAMAGED_TRIES):
        name = f"{stem}.{k}.damaged" if k else f"{stem}.damaged"
        if not os.path.lexists(side / name):
            return name
    return f"{stem}.{time.time_ns()}.damaged"  # (a thousand taken: hostile; still unique)


_DAMAGED_TRIES = 1000


def set_aside_copy(entry: str) -> tuple[str, int] | None:
    """(group file name, ns stamp) when ``entry`` of consumers/recovered/ is a group
    file a damage set aside, ``NAME.<ns>[.<k>].damaged`` (``damaged_name``); None for
    anything else, an intent moved aside (``NAME.<ns>.deleting[.<k>].damaged``) too.
    The one definition for retention (``set_aside``) and ``delete_group``."""
    name, _, rest = entry.rpartition(".json.")
    parts = rest.split(".")
    if not name or parts[-1] != "damaged" or len(parts) not in (2, 3):
        return None
    # ASCII digits, at most a u64's 20: "\u00b2".isdigit() is true and int() refuses it,
    # and 4,301 digits too (builtin ValueErrors out of every writable open, delete_group
    # and retention turn: review10 F3/F4, R11-7, an intent's list is not bounded by NAME_MAX)
    numbers = [ascii_number(part) for part in parts[:-1]]
    stamp = numbers[0]
    if stamp is None or None in numbers:
        return None
    return f"{name}.json", stamp
