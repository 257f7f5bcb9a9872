"""The sink's files under ``STORE/incoming/``: staged rows, intents and the ledger.

``incoming/<job>/`` holds one job's (or one streaming epoch's) staged rows, Arrow IPC
files the tasks wrote (``<partition>-<attempt>-<run>-<uuid>.arrow``, first as ``.tmp``), and,
once the driver's commit starts appending, ``intent.json``: the job, its files in the
order they are appended, and each queue's next offset before the append. ``ledger.json``
records the jobs appended in full (batch jobs by ``jobId``, the latest ``LEDGER_JOBS``;
streaming writers by their query's id, with the highest epoch committed).

Everything read back from these files is checked like API input: a job or file name
that could not have been written here (``../``, a slash) is a CorruptionError naming
the file, never a path that is followed.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from equeue.atomicfile import read_json, write_json
from equeue.chunks.fileops import fsync_directory
from equeue.errors import CorruptionError, SinkCommitError, StorePathError
from equeue.safepath import check_dir, check_file, ensure_dir, open_fd

INCOMING_DIR: Final = "incoming"
LEDGER_FILE: Final = "ledger.json"
INTENT_FILE: Final = "intent.json"
STAGED_SUFFIX: Final = ".arrow"
# Batch jobs remembered by jobId; a re-run of a job older than the latest this many
# appends again. Streaming writers keep one entry each, the latest this many writers.
LEDGER_JOBS: Final = 1000
# How often a task makes its job's directory and file, or a removal lists the directory,
# when a task of an aborted run removes or adds a file meanwhile.
_CREATE_ATTEMPTS: Final = 3

_JOB_ID: Final = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
_WRITER: Final = re.compile(r"[0-9a-f]{16}")
# <partition>-<attempt>-<run>-<uuid>.arrow (the run's token: aborted.py; a name without one
# is an earlier version's)
_STAGED: Final = re.compile(r"[0-9]{1,10}-[0-9]{1,20}-([0-9a-f]{32}-)?[0-9a-f]{32}\.arrow")
_JOB_DIR: Final = re.compile(
    r"(batch-[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}|stream-[0-9a-f]{16}-[0-9]{1,19})"
)


def valid_job_id(job_id: str) -> bool:
    return _JOB_ID.fullmatch(job_id) is not None


def valid_job_dir(name: str) -> bool:
    return _JOB_DIR.fullmatch(name) is not None


def valid_staged_name(name: str) -> bool:
    return _STAGED.fullmatch(name) is not None


@dataclass(frozen=True)
class Job:
    """A batch job (``batch`` None, ``key`` its jobId) or a streaming epoch (``key`` the
    writer: a hash of the query's id, which Spark keeps in its checkpoint; ``batch`` the
    epoch)."""

    key: str
    batch: int | None = None
    checkpoint: str = field(default="", compare=False)  # for people: the key names the job

    @property
    def dir_name(self) -> str:
        if self.batch is None:
            return f"batch-{self.key}"
        return f"stream-{self.key}-{self.batch}"

    def describe(self) -> str:
        if self.batch is None:
            return f"job {self.key}"
        return f"epoch {self.batch} of the streaming query checkpointed at {self.checkpoint}"

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "batch": self.batch, "checkpoint": self.checkpoint}

    @classmethod
    def from_json(cls, body: Any, path: Path) -> Job:
        try:
            key, batch, checkpoint = body["key"], body["batch"], body["checkpoint"]
        except (KeyError, TypeError) as exc:
            raise CorruptionError(f"sink intent without a job ({exc})", file=path) from exc
        if batch is None:
            ok = isinstance(key, str) and valid_job_id(key)
        else:
            ok = isinstance(key, str) and _WRITER.fullmatch(key) is not None
            ok = ok and type(batch) is int and 0 <= batch < 2**63
        if not ok or not isinstance(checkpoint, str):
            raise CorruptionError(f"sink intent names no valid job: {body!r}", file=path)
        return cls(key, batch, checkpoint)


@dataclass(frozen=True)
class Intent:
    job: Job
    topic: str
    files: list[tuple[str, int]]  # (staged file name, rows), in append order
    offsets: list[int]  # each queue's next offset before the append ([]: no topic yet)

    def to_json(self) -> dict[str, Any]:
        return {
            "job": self.job.to_json(),
            "topic": self.topic,
            "files": [list(f) for f in self.files],
            "offsets": self.offsets,
        }

    @classmethod
    def read(cls, path: Path) -> Intent:
        body = read_json(path)
        if not isinstance(body, dict):
            raise CorruptionError("sink intent is not a JSON object", file=path)
        job = Job.from_json(body.get("job"), path)
        topic, files, offsets = body.get("topic"), body.get("files"), body.get("offsets")
        good = isinstance(topic, str) and isinstance(files, list) and isinstance(offsets, list)
        good = good and all(
            isinstance(f, list)
            and len(f) == 2
            and isinstance(f[0], str)
            and valid_staged_name(f[0])
            and type(f[1]) is int
            and f[1] >= 0
            for f in files or []
        )
        good = good and all(type(o) is int and o >= 0 for o in offsets or [])
        if not good:
            raise CorruptionError(f"sink intent is malformed: {body!r}", file=path)
        assert isinstance(topic, str) and isinstance(files, list) and isinstance(offsets, list)
        return cls(job, topic, [(str(n), int(r)) for n, r in files], list(offsets))


class Incoming:
    """``STORE/incoming/``: the staging directories and the ledger."""

    def __init__(self, store: str | os.PathLike[str]) -> None:
        self.root = Path(store) / INCOMING_DIR
        self.ledger_path = self.root / LEDGER_FILE

    def job_dir(self, job: Job) -> Path:
        return self.root / job.dir_name

    def make_root(self) -> None:
        """Create (if need be) ``incoming/``, checked as the store checks its own."""
        if not check_dir(self.root.parent):
            raise StorePathError("is no store directory (it does not exist)", file=self.root.parent)
        if ensure_dir(self.root):
            fsync_directory(self.root.parent)

    def make_job_dir(self, job: Job) -> Path:
        self.make_root()
        if ensure_dir(self.job_dir(job)):
            fsync_directory(self.root)
        return self.job_dir(job)

    def pending_intents(self) -> list[Path]:
        """The intents of commits a crash (or a failure) interrupted, oldest first."""
        if not check_dir(self.root):
            return []
        found = []
        for name in os.listdir(self.root):
            if not valid_job_dir(name):
                continue
            path = self.root / name / INTENT_FILE
            if check_dir(self.root / name) and check_file(path):
                found.append((os.lstat(path).st_mtime_ns, path))
        return [path for _, path in sorted(found)]

    def create_staged(self, job: Job, name: str) -> tuple[Path, int]:
        """The job's directory (made if need be) and a new file ``name`` there, open for
        writing. A task of an aborted run (sink.py) removes the directory once it is empty,
        maybe between the two steps: then both are done again."""
        for attempt in range(_CREATE_ATTEMPTS):
            directory = self.make_job_dir(job)
            try:
                return directory, open_fd(directory / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            except FileNotFoundError:
                if attempt == _CREATE_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def remove_job_dir(self, job: Job) -> None:
        """Remove a job's staged files (also a killed task's ``.tmp``), intent and
        directory; a link there is removed, never followed. A file a task of an aborted
        run staged meanwhile is removed too, or, if it comes after the last listing, left
        to that task (it removes what it staged once it sees its run's abort marker)."""
        directory = self.job_dir(job)
        for _ in range(_CREATE_ATTEMPTS):
            if not check_dir(directory):
                return
            try:
                _empty(directory)
                os.rmdir(directory)
            except FileNotFoundError:  # removed meanwhile (a file, or the directory)
                continue
            except OSError as exc:
                if exc.errno == errno.ENOTEMPTY:  # a file staged after the listing
                    continue
                raise
            fsync_directory(self.root)
            return

    def remove_staged(self, job: Job, name: str) -> None:
        """Remove one staged file (and its ``.tmp``) of ``job``, and the job's directory if
        that leaves it empty (another task's file, or an intent, keeps it)."""
        directory = self.job_dir(job)
        if not check_dir(directory):
            return
        for path in (directory / name, directory / (name + ".tmp")):
            check_file(path)  # (a link or a directory there: StorePathError, nothing removed)
            path.unlink(missing_ok=True)
        self.remove_if_empty(directory)

    def remove_if_empty(self, directory: Path) -> None:
        """Remove a job's ``directory`` unless a file is in it (or it is gone already)."""
        try:
            os.rmdir(directory)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.ENOENT):
                raise
            return
        fsync_directory(self.root)

    # --- the ledger -----------------------------------------------------------

    def read_ledger(self) -> dict[str, Any]:
        try:
            return self._read_ledger()
        except (CorruptionError, StorePathError, OSError) as exc:
            raise SinkCommitError(
                f"cannot read the sink ledger {self.ledger_path} ({exc}); every sink commit to "
                "the store reads it: restore it, or move it out of the store (a re-run of a "
                "job or epoch it recorded then appends that job's rows again)"
            ) from None

    def _read_ledger(self) -> dict[str, Any]:
        if not os.path.lexists(self.ledger_path):
            return {"jobs": {}, "streams": {}}
        body = read_json(self.ledger_path)
        jobs = body.get("jobs") if isinstance(body, dict) else None
        streams = body.get("streams") if isinstance(body, dict) else None
        good = isinstance(jobs, dict) and isinstance(streams, dict)
        good = good and all(
            valid_job_id(k) and isinstance(v, (int, float)) for k, v in (jobs or {}).items()
        )
        good = good and all(
            _WRITER.fullmatch(k) is not None
            and isinstance(v, dict)
            and type(v.get("batch")) is int
            and isinstance(v.get("at"), (int, float))
            for k, v in (streams or {}).items()
        )
        if not good:
            raise CorruptionError(f"sink ledger is malformed: {body!r}", file=self.ledger_path)
        assert isinstance(body, dict)
        return body

    def committed(self, job: Job) -> bool:
        ledger = self.read_ledger()
        if job.batch is None:
            return job.key in ledger["jobs"]
        entry = ledger["streams"].get(job.key)
        return entry is not None and int(entry["batch"]) >= job.batch

    def record(self, job: Job) -> None:
        """Record ``job`` as appended in full (atomic), dropping the oldest entries past
        ``LEDGER_JOBS`` so the ledger stays small."""
        self.make_root()
        ledger = self.read_ledger()
        now = time.time()
        if job.batch is None:
            jobs: dict[str, float] = ledger["jobs"]
            jobs.pop(job.key, None)
            jobs[job.key] = now
            ledger["jobs"] = _latest(jobs, lambda v: float(v))
        else:
            streams: dict[str, Any] = ledger["streams"]
            entry = streams.get(job.key)
            if entry is None or int(entry["batch"]) < job.batch:
                streams[job.key] = {"batch": job.batch, "at": now, "checkpoint": job.checkpoint}
            ledger["streams"] = _latest(streams, lambda v: float(v["at"]))
        write_json(self.ledger_path, ledger)

    def write_intent(self, intent: Intent) -> None:
        write_json(self.job_dir(intent.job) / INTENT_FILE, intent.to_json())


def _empty(directory: Path) -> None:
    for name in os.listdir(directory):
        path = directory / name
        if stat.S_ISDIR(os.lstat(path).st_mode):
            raise StorePathError("is a directory where the sink stages files", file=path)
        path.unlink(missing_ok=True)


def _latest(entries: dict[str, Any], when: Any) -> dict[str, Any]:
    if len(entries) <= LEDGER_JOBS:
        return entries
    kept = sorted(entries.items(), key=lambda item: when(item[1]))[-LEDGER_JOBS:]
    return dict(kept)
