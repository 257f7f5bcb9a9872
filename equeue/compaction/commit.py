"""Installing compacted chunks atomically, in plain Python (no Spark).

The store's ``compaction/`` directory::

    JOB.lock              flock held by a running job: one compaction at a time
    COMMIT.lock           flock held while replacements are installed, and by the
                          store's writer while it adopts them or retention deletes chunks
    installed             a small JSON file rewritten after every install; a running
                          store watches it to adopt the new chunks
    <job id>/             staging: the job's compacted chunks, under their final names
    <job id>/manifest.json   the commit record, written last (atomically)

Protocol (a crash at any moment leaves the old chunks or the new ones, never a mix):

1. pass 2 writes and fsyncs each replacement in the staging directory;
2. under COMMIT.lock the driver checks that every chunk file it read is still
   there; it drops the replacements of those retention deleted (and those that
   need them: ``installable``), fsyncs the staging directory and writes
   ``manifest.json``, naming only what it installs and replaces: **the commit
   point**;
3. it renames each replacement into ``messages/`` (a higher version than the
   files it replaces, so loading prefers it) and fsyncs that directory;
4. the old files are deleted by whoever can prove nothing maps them: the job if
   no writer holds the store's lock, else the running writer once it adopted
   the replacements (and any writable open removes superseded versions);
5. ``installed`` is rewritten, then the staging directory removed.

Recovery (``recover``, run by every writable open and every job before it
starts): a staging directory with a manifest is rolled forward from step 3; one
without a manifest belongs to a job that never committed and is deleted,
unless a job is running right now.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final

from equeue.atomicfile import read_json, write_json
from equeue.chunks.fileops import fsync_directory
from equeue.chunks.opening import retention_floor
from equeue.errors import CompactionError, CorruptionError
from equeue.format.chunk import TEMP_SUFFIX, parse_chunk_file_name
from equeue.safepath import check_dir, check_file, ensure_dir, open_file
from equeue.store.meta import COMPACTION_DIR, MESSAGES_DIR, try_writer_lock

if TYPE_CHECKING:  # the store imports this module: numpy (rewrite's) stays out of it
    from equeue.compaction.rewrite import RewriteResult

log = logging.getLogger("equeue.compaction")

JOB_LOCK: Final = "JOB.lock"
COMMIT_LOCK: Final = "COMMIT.lock"
INSTALLED_FILE: Final = "installed"
MANIFEST_FILE: Final = "manifest.json"

# A manifest that cannot be read cannot say what it replaces; the chunk files still in
# the staging directory were not installed, those already renamed out of it outrank the
# files they replace at every load: either way the store opens without it.
_UNREADABLE_MANIFEST_REMEDY: Final = (
    "the chunk files in that staging directory were not installed: move the staging "
    "directory out of compaction/ and check the store with equeue verify"
)


def compaction_dir(store: Path) -> Path:
    return store / COMPACTION_DIR


def _ensure_dir(store: Path) -> Path:
    directory = compaction_dir(store)
    if ensure_dir(directory):  # never through a link: the locks would be written outside
        fsync_directory(store)
    return directory


@contextlib.contextmanager
def _flock(path: Path, *, blocking: bool, busy: str) -> Iterator[IO[str]]:
    handle = open_file(path, "a+")  # closed below, which releases the lock
    try:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            handle.seek(0)
            raise CompactionError(f"{busy} (pid {handle.read(64).strip() or 'unknown'})") from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        yield handle
    finally:
        handle.close()


def job_lock(store: Path) -> contextlib.AbstractContextManager[IO[str]]:
    """Held for a whole job; a second job is refused at once."""
    return _flock(
        _ensure_dir(store) / JOB_LOCK,
        blocking=False,
        busy=f"another compaction of {store} is running",
    )


def commit_lock(store: Path, *, blocking: bool = True) -> contextlib.AbstractContextManager[Any]:
    """Held while replacements are installed, adopted, or chunks deleted by retention."""
    return _flock(
        _ensure_dir(store) / COMMIT_LOCK,
        blocking=blocking,
        busy=f"a compaction of {store} is installing its chunks",
    )


def job_running(store: Path) -> bool:
    path = compaction_dir(store) / JOB_LOCK
    if not path.exists():
        return False
    try:
        with _flock(path, blocking=False, busy="busy"):
            return False
    except CompactionError:
        return True


def new_staging(store: Path) -> Path:
    """A new staging directory, as an absolute path: the job's tasks write into it from
    other working directories."""
    directory = _ensure_dir(Path(os.path.abspath(store)))
    staging = directory / f"{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    fsync_directory(directory)
    return staging


def installed_marker(store: Path) -> tuple[int, int] | None:
    """What identifies the last install (changes with each one); None before any."""
    try:
        st = os.stat(compaction_dir(store) / INSTALLED_FILE)
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_mtime_ns


def file_names(names: Sequence[str], what: str = "chunk") -> str:
    """A list of file names in a line: how many, the first and the last (a job beside
    retention can name hundreds)."""
    if not names:
        return f"no {what} files"
    if len(names) == 1:
        return f"1 {what} file ({names[0]})"
    ordered = sorted(names)
    return f"{len(names)} {what} files ({ordered[0]} .. {ordered[-1]})"


def removed_by_retention(messages: Path, name: str, listing: Sequence[str]) -> bool:
    """Whether the chunk file ``name``, gone from ``messages`` (listed after it was found
    gone), is retention's: every chunk file left starts after it. Else a compaction
    replaced it or a hand removed it from the middle of the log."""
    return retention_floor(messages / name, listing) >= 0


def chunks_vanished_error(store: Path, gone: Sequence[str]) -> CompactionError:
    """What the job says when chunk files it read are gone other than by retention: at
    the commit, or from a task that could not open one (job.py)."""
    return CompactionError(
        "chunk files the job read were removed while it ran, not by retention (chunk files "
        f"before them are still there, or a new version replaced them): {file_names(gone)}; "
        "nothing was installed, check the store with equeue verify and run the job again",
        file=store / MESSAGES_DIR,
    )


@dataclass(frozen=True, slots=True)
class Replacement:
    """A staged replacement, the chunk files it was made from, and the other chunk files
    it needs rewritten or gone (plan.tombstone_needs): without them it is not exact."""

    result: RewriteResult
    replaces: tuple[str, ...]
    needs: frozenset[str] = frozenset()


def replacements(
    results: Sequence[RewriteResult], read: Sequence[str], needs: Sequence[frozenset[str]] = ()
) -> list[Replacement]:
    """``results`` with the files of ``read`` each covers (by chunk number)."""
    numbers = {name: (parse_chunk_file_name(name) or (-1, 0))[0] for name in read}
    return [
        Replacement(
            r,
            tuple(n for n in read if r.start_number <= numbers[n] <= r.end_number),
            needs[i] if needs else frozenset(),
        )
        for i, r in enumerate(results)
    ]


def installable(replacements: Sequence[Replacement], gone: set[str]) -> list[bool]:
    """Which replacements can be installed once retention removed the files ``gone``.

    Not one that covers a gone file: it would bring back what retention removed. Every
    other decision about a record was made from it and newer records (a record is
    superseded by a later one), which retention, removing the oldest files first, leaves
    alone; except a tombstone that went because the files holding older values of its key
    were rewritten too: its replacement needs each of them installed, or gone. Dropping one
    can drop another, so this repeats until nothing changes."""
    keep = [not gone.intersection(r.replaces) for r in replacements]
    while True:
        installed = gone.union(*(r.replaces for r, k in zip(replacements, keep, strict=True) if k))
        again = [k and r.needs <= installed for r, k in zip(replacements, keep, strict=True)]
        if again == keep:
            return keep
        keep = again


@dataclass(slots=True)
class Outcome:
    installed: list[RewriteResult] = field(default_factory=list)
    dropped: list[RewriteResult] = field(default_factory=list)  # not installed: see installable
    gone: list[str] = field(default_factory=list)  # the files read that retention removed


def install(
    store: Path,
    staging: Path,
    results: Sequence[RewriteResult],
    read: Sequence[str],
    needs: Sequence[frozenset[str]] = (),
    gone: Sequence[str] = (),
) -> Outcome:
    """Commit the staged replacements (steps 2-5 above); ``read`` names every chunk file
    they were made from, ``needs`` (per result, if given) what each needs (Replacement).
    Those that cover a chunk file retention removed since the snapshot (``gone``: found
    so by the job before; or gone now), or need one dropped (``installable``), are not
    installed. Raises CompactionError, installing nothing, if a file they were made from
    is gone other than by retention."""
    planned = replacements(results, read, needs)
    messages = store / MESSAGES_DIR
    with commit_lock(store):
        listing = os.listdir(messages)
        present = set(listing)
        missing = sorted({n for r in planned for n in r.replaces if n not in present})
        alien = [n for n in missing if not removed_by_retention(messages, n, listing)]
        if alien:
            raise chunks_vanished_error(store, alien)
        outcome = Outcome(gone=sorted(set(missing).union(gone)))
        keep = installable(planned, set(outcome.gone))
        for replacement, kept in zip(planned, keep, strict=True):
            (outcome.installed if kept else outcome.dropped).append(replacement.result)
        if outcome.dropped:
            log.warning(
                "retention removed %s while the job ran: at the commit, %s left out",
                file_names(outcome.gone),
                file_names([r.file_name for r in outcome.dropped], "replacement"),
            )
        if not outcome.installed:
            discard(staging)
            return outcome
        for result in outcome.installed:
            if not (staging / result.file_name).exists():
                raise CompactionError("a staged replacement is missing", file=staging)
        for result in outcome.dropped:  # the staging holds only what the manifest names
            (staging / result.file_name).unlink(missing_ok=True)
        fsync_directory(staging)
        replaced = [n for r, kept in zip(planned, keep, strict=True) if kept for n in r.replaces]
        write_json(
            staging / MANIFEST_FILE,
            {"install": [asdict(r) for r in outcome.installed], "replaces": sorted(replaced)},
        )
        log.info("compaction committed: %s", staging / MANIFEST_FILE)
        _apply(store, staging)
    return outcome


def _apply(store: Path, staging: Path) -> None:
    """Steps 3-5 for a committed staging directory; safe to run again after a crash."""
    messages = store / MESSAGES_DIR
    installs, replaces = check_manifest(store, staging)
    for name in installs:
        source = staging / name
        if source.exists():
            os.rename(source, messages / name)
    fsync_directory(messages)
    writer = try_writer_lock(store)
    if writer is not None:  # no writer maps the old files: delete them now
        try:
            for name in replaces:
                (messages / name).unlink(missing_ok=True)
            fsync_directory(messages)
        finally:
            writer.close()
    write_json(compaction_dir(store) / INSTALLED_FILE, {"staging": staging.name, "at": time.time()})
    shutil.rmtree(staging)
    fsync_directory(compaction_dir(store))


def check_manifest(store: Path, staging: Path) -> tuple[list[str], list[str]]:
    """The manifest's (installs, replaces), once it is certain that installing them loses
    nothing: every replacement is staged or already in ``messages/`` (a re-run after a
    crash), and every replaced file's chunk is covered by a replacement of a higher
    version. Else CorruptionError, before anything is renamed or deleted."""
    messages = store / MESSAGES_DIR
    manifest_path = staging / MANIFEST_FILE
    try:
        manifest = read_json(manifest_path)
    except CorruptionError as exc:  # the same error, with what the operator can do
        raise type(exc)(
            exc.reason,
            file=manifest_path,
            offset=exc.offset,
            expected=exc.expected,
            found=exc.found,
            remedy=_UNREADABLE_MANIFEST_REMEDY,
        ) from exc
    try:
        entries = [(str(e["file_name"]), int(e.get("end_number", -1))) for e in manifest["install"]]
        replaces = [str(name) for name in manifest["replaces"]]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptionError(
            f"unreadable compaction manifest ({exc!r})",
            file=manifest_path,
            remedy=_UNREADABLE_MANIFEST_REMEDY,
        ) from exc
    intact = all((messages / name).is_file() for name in replaces)
    remedy = (
        "every chunk file it replaces is still in messages/: move the staging directory "
        "out of compaction/ and the store opens with them"
        if intact
        else "some chunk files it replaces are gone: restore them (or the missing "
        "replacement) from a backup before moving the staging directory out of compaction/"
    )
    for name in [e[0] for e in entries] + replaces:
        if parse_chunk_file_name(name) is None:
            raise CorruptionError(
                f"{name!r} is not a chunk file name", file=manifest_path, remedy=remedy
            )
    covered: list[tuple[int, int, int]] = []  # (start, end, version) of each replacement
    for name, end_number in entries:
        if not (staging / name).is_file() and not (messages / name).is_file():
            raise CorruptionError(
                f"the committed compaction installs {name}, which is neither in its "
                f"staging directory nor in {messages}; nothing was installed or deleted",
                file=manifest_path,
                remedy=remedy,
            )
        start, version = parse_chunk_file_name(name) or (0, 0)
        covered.append((start, max(end_number, start), version))
    for name in replaces:
        number, version = parse_chunk_file_name(name) or (0, 0)
        if not any(s <= number <= e and v > version for s, e, v in covered):
            raise CorruptionError(
                f"the committed compaction replaces {name}, but none of its replacements "
                "covers that chunk with a higher version; nothing was installed or deleted",
                file=manifest_path,
                remedy=remedy,
            )
    return [e[0] for e in entries], replaces


def _is_staging(path: Path) -> bool:
    """A job's staging directory; a link is refused (its files would be installed, or
    deleted, wherever it leads), as are the lock and marker files as anything else."""
    if path.name in (JOB_LOCK, COMMIT_LOCK, INSTALLED_FILE):
        check_file(path)
        return False
    if path.is_symlink():
        check_dir(path)  # raises
    return path.is_dir()


def discard(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)
    with contextlib.suppress(OSError):
        fsync_directory(staging.parent)


def recover(store: Path, *, holding_job_lock: bool = False) -> list[str]:
    """Roll committed jobs forward and delete uncommitted staging (unless a job is running,
    other than the caller's own); returns what it did."""
    directory = compaction_dir(store)
    if not check_dir(directory):
        return []
    done: list[str] = []
    with commit_lock(store):
        for temp in directory.glob(f"*{TEMP_SUFFIX}"):  # e.g. `installed` cut mid-write
            temp.unlink(missing_ok=True)
        running = not holding_job_lock and job_running(store)
        done += finish_committed(store)
        for staging in sorted(p for p in directory.iterdir() if _is_staging(p)):
            if not running:
                discard(staging)
                done.append(f"removed the uncommitted compaction staging {staging.name}")
    for line in done:
        log.warning("recovery: %s", line)
    return done


def finish_committed(store: Path) -> list[str]:
    """Under COMMIT.lock: install every committed staging directory (its manifest written),
    which only a job that died after its commit point leaves there (a live job installs
    under the same lock). A writer's retention calls this first (review18 R18-1: else it
    removed the chunks such a job replaced, and the next recovery installed their
    replacements, bringing back what retention removed, below a gap no open passes)."""
    directory = compaction_dir(store)
    if not check_dir(directory):
        return []
    done = []
    for staging in sorted(p for p in directory.iterdir() if _is_staging(p)):
        if (staging / MANIFEST_FILE).exists():
            _apply(store, staging)
            done.append(f"finished installing the committed compaction {staging.name}")
    return done
