"""The Spark sink's abort race (equeue/spark/aborted.py): Spark calls the writer's
abort() without waiting for tasks still staging; such a task must leave no staged file
or directory behind, nor fail. The writer's task, commit and abort functions are called
directly, in the order the race takes, each task in a thread held by an event."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark.sql.types import StringType, StructField, StructType

from equeue import MessageStore
from equeue.spark import aborted
from equeue.spark.ledger import INCOMING_DIR, Incoming, Job
from equeue.spark.sink import EqueueStreamWriter, EqueueWriter, StagedFile, _Sink

SCHEMA = StructType([StructField("body", StringType())])
ROWS = 300  # per task: three batches of 100


def _batches(first: int) -> list[pa.RecordBatch]:
    return [
        pa.RecordBatch.from_pydict({"body": [str(i) for i in range(at, at + 100)]})
        for at in range(first, first + ROWS, 100)
    ]


def _incoming(store: Path) -> list[str]:
    root = store / INCOMING_DIR
    return sorted(os.listdir(root)) if root.exists() else []


def _bodies(store: Path) -> list[int]:
    with MessageStore.open(store, read_only=True) as opened:
        if "t" not in opened.topics():
            return []
        return sorted(
            int(m.body)
            for q in opened.queue_ids("t")
            for m in opened.pull("t", q, 0, 10 * ROWS).messages
        )


class _HeldTask:
    """``stage(rows)`` in a thread; the rows wait for ``release`` before batch
    ``hold_at`` (0: before any; 3: after the last, before the file's rename)."""

    def __init__(self, stage: Callable[[Iterator[pa.RecordBatch]], StagedFile], hold_at: int):
        self.reached, self.release = threading.Event(), threading.Event()
        self.result: StagedFile | None = None
        self.error: BaseException | None = None
        self._hold_at = hold_at
        self._thread = threading.Thread(target=self._run, args=(stage,), daemon=True)
        self._thread.start()
        assert self.reached.wait(30), "the task never reached its hold"

    def _rows(self) -> Iterator[pa.RecordBatch]:
        for i, batch in enumerate([*_batches(0), None]):
            if i == self._hold_at:
                self.reached.set()
                assert self.release.wait(30)
            if batch is not None:
                yield batch

    def _run(self, stage: Callable[[Iterator[pa.RecordBatch]], StagedFile]) -> None:
        try:
            self.result = stage(self._rows())
        except BaseException as exc:  # (reported by finish)
            self.error = exc

    def finish(self) -> StagedFile:
        self.release.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the task did not finish"
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def _batch_writer(store: Path) -> EqueueWriter:
    return EqueueWriter({"path": str(store), "topic": "t", "jobId": "bad"}, SCHEMA, False)


def _stream_writer(store: Path) -> EqueueStreamWriter:
    checkpoint = store.parent / "checkpoint"
    checkpoint.mkdir(exist_ok=True)
    (checkpoint / "metadata").write_text(json.dumps({"id": "query-1"}) + "\n")
    options = {"path": str(store), "topic": "t", "checkpointLocation": str(checkpoint)}
    return EqueueStreamWriter(options, SCHEMA, False)


def _task_and_abort(store: Path, kind: str) -> tuple[_Sink, Callable[[], None], Job]:
    """A writer, its abort, and the job its tasks stage for."""
    if kind == "batch":
        batch = _batch_writer(store)
        return batch, lambda: batch.abort([]), batch.job
    stream = _stream_writer(store)
    return stream, lambda: stream.abort([], 3), stream._job(3)


@pytest.mark.parametrize(
    ("kind", "hold_at"), [("batch", 0), ("batch", 1), ("batch", 3), ("stream", 0)]
)
def test_a_task_staging_after_the_abort_leaves_nothing(
    tmp_path: Path, kind: str, hold_at: int
) -> None:
    """0: the task makes the job's directory after abort() removed it (what the failing
    run at load 8 left: incoming/batch-bad/); 1: abort() removed its open temp file;
    3: the same, found at the rename. Before the markers: a staged file left in a
    re-created directory (0), a StoreWriteError from the task (1, 3)."""
    store = tmp_path / "s"
    MessageStore.open(store).close()
    writer, abort, job = _task_and_abort(store, kind)
    task = _HeldTask(lambda rows: writer.stage(job, rows), hold_at)
    abort()  # the job failed elsewhere: Spark aborts while this task still runs
    assert task.finish() == StagedFile("", 0, 0)  # nothing reported, nothing raised
    assert _incoming(store) == [aborted.ABORTED_DIR]
    assert os.listdir(store / INCOMING_DIR / aborted.ABORTED_DIR) == [
        f"{job.dir_name}.{writer.run}"
    ]
    assert _bodies(store) == []


def test_a_rerun_of_the_job_keeps_its_rows_while_the_aborted_runs_task_cleans_up(
    tmp_path: Path,
) -> None:
    """The same jobId run again while a task of the aborted run still stages: the new
    run (another token) stages and commits every row once; the old task, finishing
    after and before that commit, removes only its own file."""
    store = tmp_path / "s"
    MessageStore.open(store).close()
    first = _batch_writer(store)
    late = _HeldTask(lambda rows: first.stage(first.job, rows), 0)
    later = _HeldTask(lambda rows: first.stage(first.job, rows), 1)
    first.abort([])
    again = _batch_writer(store)
    assert again.run != first.run and again.job == first.job
    staged = again.stage(again.job, iter(_batches(0)))
    assert late.finish() == StagedFile("", 0, 0)  # (between the re-run's staging and commit)
    assert staged.rows == ROWS and (store / INCOMING_DIR / "batch-bad" / staged.name).exists()
    again.commit([staged])
    assert later.finish() == StagedFile("", 0, 0)  # (after the commit)
    assert _bodies(store) == list(range(ROWS))
    assert _incoming(store) == [aborted.ABORTED_DIR, "ledger.json"]


def test_control_a_run_not_aborted_commits_what_its_tasks_staged(tmp_path: Path) -> None:
    store = tmp_path / "s"
    MessageStore.open(store).close()
    writer = _batch_writer(store)
    task = _HeldTask(lambda rows: writer.stage(writer.job, rows), 1)
    staged = task.finish()
    assert staged.rows == ROWS and staged.name
    writer.commit([staged])
    assert _bodies(store) == list(range(ROWS))
    assert _incoming(store) == ["ledger.json"]  # no marker: nothing was aborted


def test_old_markers_go_at_the_next_abort_or_commit(tmp_path: Path) -> None:
    store = tmp_path / "s"
    MessageStore.open(store).close()
    incoming = Incoming(store)
    old, young = Job("old"), Job("young")
    aborted.mark_aborted(incoming, old, aborted.new_run())
    aborted.mark_aborted(incoming, young, aborted.new_run())
    markers = store / INCOMING_DIR / aborted.ABORTED_DIR
    (markers / "notes.txt").write_text("not a marker: kept")
    stale = os.stat(markers / "notes.txt").st_mtime - aborted.ABORTED_KEEP_SECONDS - 60
    for name in os.listdir(markers):
        if name.startswith("batch-old.") or name == "notes.txt":
            os.utime(markers / name, (stale, stale))
    writer = _batch_writer(store)
    writer.commit([])  # a commit (of no rows) tidies
    assert sorted(n.split(".")[0] for n in os.listdir(markers)) == ["batch-young", "notes"]


def test_an_abort_marker_is_never_written_through_a_link(tmp_path: Path) -> None:
    """incoming/aborted/ replaced by a link out of the store: abort() refuses
    (StorePathError) before removing anything, and writes nothing there."""
    from equeue.errors import StorePathError

    store, elsewhere = tmp_path / "s", tmp_path / "elsewhere"
    MessageStore.open(store).close()
    elsewhere.mkdir()
    writer = _batch_writer(store)
    staged = writer.stage(writer.job, iter(_batches(0)))
    (store / INCOMING_DIR / aborted.ABORTED_DIR).symlink_to(elsewhere)
    with pytest.raises(StorePathError, match="is a symbolic link"):
        writer.abort([])
    assert os.listdir(elsewhere) == []
    assert (store / INCOMING_DIR / "batch-bad" / staged.name).is_file()


# A task of the writer on stdin: once staging, it waits for a line, then stages one batch and is
# SIGKILLed before its file is renamed (Spark kills the tasks of a job it cancels).
KILLED_TASK = """
import os, pickle, signal, sys
import pyarrow as pa
writer = pickle.load(sys.stdin.buffer)
def rows():
    print("staging", flush=True)  # past the task's first look for its run's marker
    sys.stdin.readline()
    yield pa.RecordBatch.from_pydict({"body": ["x"] * 100})
    os.kill(os.getpid(), signal.SIGKILL)
writer.stage(writer.job, rows())
"""


def test_a_task_killed_after_the_abort_is_cleaned_up_by_the_next_commit(tmp_path: Path) -> None:
    """The task (another process) starts, Spark aborts the run, the task makes the job's
    directory again, writes its temp file and is SIGKILLed before it could see the
    marker: the next sink commit to the store (another job) removes the file and the
    directory (named with the aborted run's token); control: a re-run's file stays."""
    store = tmp_path / "s"
    MessageStore.open(store).close()
    writer = _batch_writer(store)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    task = subprocess.Popen(
        [sys.executable, "-c", KILLED_TASK], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    try:
        assert task.stdin is not None
        task.stdin.write(pickle.dumps(writer))
        task.stdin.flush()
        assert task.stdout is not None and task.stdout.readline() == b"staging\n"
        writer.abort([])
        task.stdin.write(b"go\n")
        task.stdin.close()
        assert task.wait(60) == -signal.SIGKILL
    finally:
        if task.poll() is None:
            task.kill()
            task.wait(10)
        if task.stdout is not None:
            task.stdout.close()
    job_dir = store / INCOMING_DIR / "batch-bad"
    (left,) = os.listdir(job_dir)
    assert left.endswith(".arrow.tmp") and f"-{writer.run}-" in left
    rerun = _batch_writer(store)
    kept = rerun.stage(rerun.job, iter(_batches(0)))  # a re-run of the job, not committed yet
    other = EqueueWriter({"path": str(store), "topic": "t", "jobId": "other"}, SCHEMA, False)
    other.commit([other.stage(other.job, iter(_batches(ROWS)))])
    assert os.listdir(job_dir) == [kept.name]  # the killed task's file went, the re-run's not
    rerun.commit([kept])
    assert _bodies(store) == list(range(2 * ROWS))
    assert _incoming(store) == [aborted.ABORTED_DIR, "ledger.json"]
