"""``aborted.tidy`` racing the late tasks of an aborted run (review 30a, finding 2): tidy
runs in front of every sink commit and abort and sweeps the aborted runs' job
directories while their tasks may still rename and remove files there. A file or
directory gone between tidy's listing and its lstat fails neither the commit nor the
abort (of another job), and what it could not sweep the next tidy does. The race is
injected deterministically: os.lstat / os.listdir, patched, do the task's step first."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark.sql.types import StringType, StructField, StructType

from equeue import MessageStore
from equeue.spark import aborted
from equeue.spark.ledger import INCOMING_DIR, Incoming
from equeue.spark.sink import EqueueWriter

SCHEMA = StructType([StructField("body", StringType())])
ROWS = 100


def _writer(store: Path, job: str) -> EqueueWriter:
    return EqueueWriter({"path": str(store), "topic": "t", "jobId": job}, SCHEMA, False)


def _rows() -> list[pa.RecordBatch]:
    return [pa.RecordBatch.from_pydict({"body": [str(i) for i in range(ROWS)]})]


def _leftover(store: Path) -> tuple[Path, Path]:
    """An aborted run of job 'bad' whose late task has its temp file in the job's
    directory (and a re-run's file there, which keeps the directory): the temp file,
    and the name the task renames it to."""
    bad = _writer(store, "bad")
    bad.abort([])  # the marker
    job_dir = store / INCOMING_DIR / "batch-bad"
    job_dir.mkdir()
    (job_dir / f"0-0-{'0' * 32}-x.arrow").write_bytes(b"a re-run's")
    tmp = job_dir / f"0-1-{bad.run}-y.arrow.tmp"
    tmp.write_bytes(b"staged")
    return tmp, job_dir / tmp.name.removesuffix(".tmp")


def _race(monkeypatch: pytest.MonkeyPatch, store: Path, race: str) -> tuple[Path, list[str]]:
    """Arm the race; the job directory swept, and the races fired (one, once)."""
    tmp, renamed = _leftover(store)
    job_dir = tmp.parent
    real_lstat, real_listdir = os.lstat, os.listdir
    fired: list[str] = []

    def lstat(path: object, *args: object, **kwargs: object) -> os.stat_result:
        if Path(str(path)) == tmp and not fired:
            fired.append(race)
            if race == "renamed":  # the task's rename of its temp file, at its end
                os.rename(tmp, renamed)
            else:  # the task saw the marker and removed what it staged
                os.unlink(tmp)
        return real_lstat(path, *args, **kwargs)  # type: ignore[arg-type]

    def listdir(path: str | os.PathLike[str] = ".") -> list[str]:
        if race == "directory gone" and Path(str(path)) == job_dir and not fired:
            fired.append(race)  # the last file of the run removed, and the directory
            shutil.rmtree(job_dir)
        return real_listdir(path)

    monkeypatch.setattr(os, "lstat", lstat)
    monkeypatch.setattr(os, "listdir", listdir)
    return job_dir, fired


RACES = ["renamed", "removed", "directory gone"]


@pytest.fixture
def store(tmp_path: Path) -> Path:
    MessageStore.open(tmp_path / "s").close()
    return tmp_path / "s"


@pytest.mark.parametrize("race", RACES)
def test_another_jobs_commit_is_not_failed_by_the_race(
    store: Path, monkeypatch: pytest.MonkeyPatch, race: str
) -> None:
    job_dir, fired = _race(monkeypatch, store, race)
    other = _writer(store, "other")
    other.commit([other.stage(other.job, iter(_rows()))])
    assert fired == [race]
    monkeypatch.undo()
    with MessageStore.open(store, read_only=True) as opened:
        assert sum(len(opened.pull("t", q, 0, 1000).messages) for q in opened.queue_ids("t")) == (
            ROWS
        )
    aborted.tidy(Incoming(str(store)))  # the next tidy: the renamed file goes too
    if race == "directory gone":
        assert not job_dir.exists()
    else:
        assert os.listdir(job_dir) == [f"0-0-{'0' * 32}-x.arrow"]  # the re-run's stays


@pytest.mark.parametrize("race", RACES)
def test_another_jobs_abort_still_removes_its_files(
    store: Path, monkeypatch: pytest.MonkeyPatch, race: str
) -> None:
    failing = _writer(store, "failing")
    failing.stage(failing.job, iter(_rows()))
    assert os.listdir(store / INCOMING_DIR / "batch-failing")
    _, fired = _race(monkeypatch, store, race)
    failing.abort([])  # before: FileNotFoundError out of abort(), its staged file left
    assert fired == [race]
    assert not (store / INCOMING_DIR / "batch-failing").exists()


def test_control_without_a_race_tidy_sweeps_the_aborted_runs_file(tmp_path: Path) -> None:
    store = tmp_path / "s"
    MessageStore.open(store).close()
    tmp, _ = _leftover(store)
    aborted.tidy(Incoming(str(store)))
    assert os.listdir(tmp.parent) == [f"0-0-{'0' * 32}-x.arrow"]


def test_a_link_in_place_of_a_job_directory_is_logged_not_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A hostile symlink where an aborted run's job directory was: tidy logs it (naming
    it) and raises nothing; it never follows it."""
    store = tmp_path / "s"
    MessageStore.open(store).close()
    _writer(store, "bad").abort([])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / f"0-0-{'1' * 32}-x.arrow").write_bytes(b"keep")
    (store / INCOMING_DIR / "batch-bad").symlink_to(elsewhere)
    aborted.tidy(Incoming(str(store)))
    assert os.listdir(elsewhere) == [f"0-0-{'1' * 32}-x.arrow"]
    assert "batch-bad is a symbolic link" in caplog.text
