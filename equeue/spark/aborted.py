"""Abort markers: ``STORE/incoming/aborted/<job directory>.<run>``, one per aborted run.

Spark calls a writer's ``abort()`` once the job (or epoch) has failed, without waiting
for tasks still staging their rows. abort() removes the job's directory; such a task
would make it again and leave its file there, which nothing appends or removes (a re-run
stages anew). So abort() first leaves a marker naming the run: a token the writer draws
on the driver, which the tasks and the commit or abort receive with the pickled writer
(the job's name is not enough: a re-run of a ``jobId`` is the same job, and must keep
its files). A task checks for its run's marker before it starts, once its file is in
place (and when its temp file vanished under it), and removes what it staged. Either the
task's check comes after the marker, or its file was in place before abort() listed the
directory and abort() removed it. A task killed between (Spark kills the tasks it
cancels) leaves its file, named with its run's token: the next abort or commit to the
store removes it (``tidy``), and the markers older than ``ABORTED_KEEP_SECONDS``.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import time
import uuid
from pathlib import Path
from typing import Final

from equeue.chunks.fileops import fsync_directory
from equeue.errors import EQueueError
from equeue.safepath import check_dir, check_file, ensure_dir, open_fd
from equeue.spark.ledger import INTENT_FILE, Incoming, Job, valid_job_dir

ABORTED_DIR: Final = "aborted"
# A task still staging this long after its run's abort leaves its file (a day: Spark
# kills the tasks it cancels within seconds, spark.python.task.killTimeout).
ABORTED_KEEP_SECONDS: Final = 86_400.0
log = logging.getLogger(__name__)
_MARKER: Final = re.compile(r"(?P<job>(batch|stream)-[A-Za-z0-9._-]{1,140})\.(?P<run>[0-9a-f]{32})")


def new_run() -> str:
    """A run's token (the driver draws one per writer: per write, per streaming query)."""
    return uuid.uuid4().hex


def marker(incoming: Incoming, job: Job, run: str) -> Path:
    return incoming.root / ABORTED_DIR / f"{job.dir_name}.{run}"


def mark_aborted(incoming: Incoming, job: Job, run: str) -> None:
    """Leave the marker of ``run`` of ``job`` (before abort() removes its files)."""
    incoming.make_root()
    directory = incoming.root / ABORTED_DIR
    if ensure_dir(directory):
        fsync_directory(incoming.root)
    os.close(open_fd(marker(incoming, job, run), os.O_WRONLY | os.O_CREAT))
    fsync_directory(directory)


def aborted(incoming: Incoming, job: Job, run: str) -> bool:
    return check_file(marker(incoming, job, run))


def tidy(incoming: Incoming, now: float | None = None) -> None:
    """At an abort or a commit: remove what tasks of aborted runs left (``sweep``), then
    the markers older than ABORTED_KEEP_SECONDS (only files named as markers).

    Best effort: the tasks of those runs may still be renaming and removing their files
    and directories meanwhile (a name listed may be gone by its lstat, a directory by
    its listing), and what one sweep could not remove the next one does, so no error
    here fails the commit or abort it runs in front of: it is logged."""
    directory = incoming.root / ABORTED_DIR
    try:
        names = os.listdir(directory) if check_dir(directory) else []
    except FileNotFoundError:
        return
    except (OSError, EQueueError) as exc:
        log.warning("abort markers in %s not tidied: %s", directory, exc)
        return
    cutoff = (time.time() if now is None else now) - ABORTED_KEEP_SECONDS
    for name in names:
        found = _MARKER.fullmatch(name)
        if found is None or not valid_job_dir(found["job"]):
            continue
        path = directory / name
        try:
            _sweep(incoming, found["job"], found["run"])
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff:
                path.unlink(missing_ok=True)
        except FileNotFoundError:
            continue
        except (OSError, EQueueError) as exc:
            log.warning("what the aborted run %s left not tidied: %s", path, exc)


def _sweep(incoming: Incoming, job_dir: str, run: str) -> None:
    """The files of aborted ``run`` in ``job_dir`` (a task killed after staging there
    once the abort had removed the directory), and the directory if that empties it;
    none where an intent is (its commit appends the files it names, and removes the
    directory with the rest)."""
    directory = incoming.root / job_dir
    if not check_dir(directory) or check_file(directory / INTENT_FILE):
        return
    removed = False
    for name in os.listdir(directory):  # (FileNotFoundError: a task removed it, tidy goes on)
        path = directory / name
        if f"-{run}-" not in name:
            continue
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:  # its task renamed or removed it since the listing
            continue
        if not stat.S_ISDIR(mode):
            path.unlink(missing_ok=True)
            removed = True
    if removed:
        incoming.remove_if_empty(directory)
