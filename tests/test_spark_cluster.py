"""Spark beyond one process: the compaction job and the data source on
``local-cluster[2,1,1024]`` (executor JVMs and Python workers in their own working
directories) from relative store paths, the preflight's one-line errors, and the
spark-submit entry point's report file."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from compaction_model import all_messages, expected_removed
from server_helpers import short_dir
from spark_cluster_child import BROKER_ENV, BROKER_ROWS, BROKER_TOKEN_ENV
from test_compaction import fill, snapshot_messages
from test_spark_broker import Broker
from test_spark_broker import stored as all_stored

import equeue
from equeue import MessageStore
from equeue.spark.preflight import ExecutorReport, preflight, probe, verdict

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# Where this equeue is imported from: the executors of local-cluster need it on their
# path (an installed equeue needs nothing; a worktree's does).
PACKAGE_PARENT = str(Path(equeue.__file__).resolve().parent.parent)
DRIVER = f"{sys.version_info[0]}.{sys.version_info[1]}"
INSTALL = (
    "install equeue on the nodes or ship it (equeue compact --ship-equeue, or "
    "ship_equeue(spark) from equeue.spark.preflight)"
)


def minor_version(python: str) -> str | None:
    """'3.12' for a Python that runs; None for one that does not."""
    done = subprocess.run(
        [python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return done.stdout.strip() if done.returncode == 0 else None


def other_minor_pythons() -> list[str]:
    """One Python of another minor version than this one, if the machine has one."""
    found = [shutil.which(f"python3.{minor}") for minor in range(10, 15)]
    found += sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[0-4]*/bin/python3")))
    for python in found:
        if python is not None and minor_version(python) not in (None, DRIVER):
            return [python]
    return []


@dataclasses.dataclass
class ClusterRun:
    now: float
    seen: dict[str, Any]
    read_expected: dict[int, list[Any]]
    c1_before: dict[int, tuple[Any, ...]]
    c1_removed: set[int]
    c2_before: dict[int, tuple[Any, ...]]
    c2_removed: set[int]
    directory: Path
    other_pythons: list[str]
    seconds: float
    broker_stored: list[str]  # the bodies of topic "cluster" in the broker's store
    submit: Submitted | None  # None: no spark-submit beside this Python


@dataclasses.dataclass
class Submitted:
    """tools/spark_compact.py run by spark-submit on its own store, beside the child."""

    directory: Path  # its working directory: the store "s" and the report file
    before: dict[int, tuple[Any, ...]]
    removed: set[int]
    returncode: int
    output: str  # stdout and stderr


def start_submit(directory: Path) -> tuple[subprocess.Popen[str], Submitted] | None:
    """The documented path, started: ``spark-submit tools/spark_compact.py --report FILE``
    on a store of its own (a JVM of its own, which runs while the local-cluster child
    does: the child's JVMs wait on each other much of the time)."""
    submit = Path(sys.executable).parent / "spark-submit"
    if not submit.exists():
        return None
    directory.mkdir()
    store = directory / "s"
    fill(store, messages=900, seed=6)
    now = time.time() + 1
    removed = expected_removed(store, now)
    before = snapshot_messages(store)
    env = dict(os.environ, PYTHONPATH=PACKAGE_PARENT, PYSPARK_PYTHON=sys.executable)
    process = subprocess.Popen(
        [
            str(submit),
            "--master",
            "local[1]",
            "--conf",
            "spark.ui.enabled=false",
            "--driver-java-options",
            "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
            str(ROOT / "tools" / "spark_compact.py"),
            str(store),
            "--now",
            str(now),
            "--report",
            str(directory / "report.json"),
        ],
        cwd=directory,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return process, Submitted(directory, before, removed, -1, "")


def finish_submit(started: tuple[subprocess.Popen[str], Submitted] | None) -> Submitted | None:
    if started is None:
        return None
    process, submitted = started
    try:
        out, err = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return dataclasses.replace(submitted, returncode=process.returncode, output=out + err)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> ClusterRun:
    """One subprocess on local-cluster runs every cluster check (tests/spark_cluster_child.py);
    the references are computed here, in plain Python, before it changes the stores."""
    pytest.importorskip("pyspark")
    directory = tmp_path_factory.mktemp("cluster")
    now = time.time() + 1
    fill(directory / "r", messages=300, seed=3)
    with MessageStore.open(directory / "r", read_only=True) as store:
        read_expected = {
            p: [p, m.topic, m.queue_id, m.queue_offset, m.key, m.tag, m.body.hex()]
            for p, m in all_messages(store).items()
        }
    fill(directory / "c1", messages=900, seed=4)
    fill(directory / "c2", messages=900, seed=5)
    before = {name: snapshot_messages(directory / name) for name in ("c1", "c2")}
    removed = {name: expected_removed(directory / name, now) for name in ("c1", "c2")}
    with zipfile.ZipFile(directory / "marker.zip", "w") as archive:
        archive.writestr("cluster_marker.py", "VALUE = 'shipped'\n")
    others = other_minor_pythons()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([PACKAGE_PARENT, str(TESTS)]))
    home = short_dir()  # the broker's socket path must fit sun_path
    broker: Broker | None = None
    started = start_submit(directory / "submit")
    try:
        broker = Broker(home)
        env[BROKER_ENV] = broker.url
        # Relative to the driver's working directory, which no executor shares (reviewc F1).
        shutil.copy(broker.token_file, directory / "token")
        env[BROKER_TOKEN_ENV] = "token"
        tick = time.monotonic()
        done = subprocess.run(
            [sys.executable, str(TESTS / "spark_cluster_child.py"), str(now), PACKAGE_PARENT,
             *others],
            cwd=directory, env=env, capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        seconds = time.monotonic() - tick
        with broker.client() as client:
            stored = [m.body.decode() for ms in all_stored(client, "cluster").values() for m in ms]
    finally:
        if broker is not None:
            broker.stop()
        shutil.rmtree(home, ignore_errors=True)
        submitted = finish_submit(started)
    if done.returncode != 0:
        pytest.fail(f"the local-cluster run failed:\n{done.stderr[-6000:]}")
    return ClusterRun(
        now=now,
        seen=json.loads(done.stdout.strip().splitlines()[-1]),
        read_expected=read_expected,
        c1_before=before["c1"],
        c1_removed=removed["c1"],
        c2_before=before["c2"],
        c2_removed=removed["c2"],
        directory=directory,
        other_pythons=others,
        seconds=seconds,
        broker_stored=stored,
        submit=submitted,
    )


def test_executors_write_and_read_through_a_broker_on_local_cluster(cluster: ClusterRun) -> None:
    """Executor processes of their own (each reading the token from ``tokenFile``) send
    the rows to the broker and read them back through it: each row once."""
    want = sorted(str(i) for i in range(BROKER_ROWS))
    assert sorted(cluster.broker_stored) == want
    assert sorted(cluster.seen["broker_read"]) == want


def test_preflight_on_local_cluster_passes_and_reports_each_task(cluster: ClusterRun) -> None:
    """The control: executors that import this equeue (with its C accelerator), run the
    driver's Python and see the store."""
    reports = [ExecutorReport(**r) for r in cluster.seen["preflight"]]
    assert len(reports) == 2  # a task per slot: two executors of one core
    for report in reports:
        assert (report.python, report.equeue) == (DRIVER, str(Path(equeue.__file__).parent))
        assert report.speedups
        assert (report.import_error, report.store_error, report.write_error) == (None,) * 3


def test_data_source_reads_every_message_from_a_relative_path_on_local_cluster(
    cluster: ClusterRun,
) -> None:
    rows = {row[0]: row for row in cluster.seen["rows"]}
    assert len(rows) == len(cluster.seen["rows"])
    assert rows == cluster.read_expected


def test_streaming_source_reads_every_message_from_a_relative_path_on_local_cluster(
    cluster: ClusterRun,
) -> None:
    rows = {row[0]: row for row in cluster.seen["streamed"]}
    assert len(rows) == len(cluster.seen["streamed"])  # each message once
    assert rows == cluster.read_expected


def test_compaction_from_a_relative_path_on_local_cluster_removes_what_the_model_removes(
    cluster: ClusterRun,
) -> None:
    """Pass 2's tasks got the staging directory as a relative path and failed with
    FileNotFoundError in the executors' working directories (before the fix)."""
    report = cluster.seen["c1"]
    assert report["store"] == str(cluster.directory / "c1")
    assert report["records_removed"] == len(cluster.c1_removed) > 0
    after = snapshot_messages(cluster.directory / "c1")
    assert after == {p: m for p, m in cluster.c1_before.items() if p not in cluster.c1_removed}


def test_preflight_names_a_store_the_executors_cannot_see(cluster: ClusterRun) -> None:
    """The relative path as given, which the driver sees and the executors (in their own
    working directories) do not."""
    assert cluster.seen["unseen"] == (
        "executors cannot see r/store.json (FileNotFoundError on "
        f"{os.uname().nodename}): mount the store at the same path on every node"
    )


def test_preflight_names_a_package_the_executors_cannot_import(cluster: ClusterRun) -> None:
    assert cluster.seen["unimportable"] == (
        f"executors cannot import equeue (ModuleNotFoundError: No module named 'equeue'): {INSTALL}"
    )


def test_preflight_names_a_python_minor_version_mismatch(cluster: ClusterRun) -> None:
    if not cluster.other_pythons:
        pytest.skip("no Python of another minor version on this machine")
    (python,) = cluster.other_pythons
    version = minor_version(python)
    assert cluster.seen["mismatch"] == {
        python: f"executors run Python {version}, the driver {DRIVER}: run the driver with "
        f"Python {version}, or give the executors a Python {DRIVER} (spark.pyspark.python, "
        "PYSPARK_PYTHON)"
    }


def test_compact_command_ships_equeue_py_files_and_conf_to_local_cluster(
    cluster: ClusterRun,
) -> None:
    """--ship-equeue: the executors import the zip (pure Python), which comes before the
    equeue on their path; --py-files and --conf reach the session; the result is the
    model's."""
    seen = cluster.seen
    assert seen["cli_exit"] == 0
    assert seen["cli_report"]["records_removed"] == len(cluster.c2_removed) > 0
    after = snapshot_messages(cluster.directory / "c2")
    assert after == {p: m for p, m in cluster.c2_before.items() if p not in cluster.c2_removed}
    (line,) = [s for s in seen["cli_progress"] if s.startswith("[compact] preflight: ")]
    assert line.endswith("pure Python (no C accelerator)")
    assert "equeue.zip/equeue" in line
    assert seen["marker"] == ["shipped"]
    assert seen["conf"] == "passed"
    print(f"local-cluster subprocess: {cluster.seconds:.1f} s, steps at {seen['steps']}")


# --- the preflight in this process's local session ---------------------------------


def test_preflight_in_local_mode_and_an_unwritable_directory(
    tmp_path: Path, spark: SparkSession
) -> None:
    fill(tmp_path / "s", messages=20)
    reports = preflight(spark, tmp_path / "s", write_dir=str(tmp_path / "s"))  # the control
    assert {r.python for r in reports} == {DRIVER} and not any(r.store_error for r in reports)
    missing = tmp_path / "s" / "gone"
    from equeue.errors import SparkClusterError

    with pytest.raises(SparkClusterError) as caught:
        preflight(spark, tmp_path / "s", write_dir=str(missing))
    assert str(caught.value) == (
        f"executors cannot write {missing} (FileNotFoundError on {os.uname().nodename}): "
        "the job's tasks write there; give the executors' user write access to it"
    )
    # The driver's version faked: the executors' reports say 3.11 (or whatever runs here).
    other = "3.99"
    assert verdict(reports, str(tmp_path / "s" / "store.json"), driver=other) == (
        f"executors run Python {DRIVER}, the driver {other}: run the driver with Python "
        f"{DRIVER}, or give the executors a Python {other} (spark.pyspark.python, "
        "PYSPARK_PYTHON)"
    )


def test_preflight_names_a_python_the_executors_do_not_have(
    tmp_path: Path, spark: SparkSession
) -> None:
    """PYSPARK_PYTHON naming a path the nodes lack: Spark cannot start a worker."""
    from equeue.errors import SparkClusterError

    fill(tmp_path / "s", messages=20)
    context = spark.sparkContext
    python = context.pythonExec
    context.pythonExec = str(tmp_path / "no-python")
    try:
        with pytest.raises(SparkClusterError) as caught:
            preflight(spark, tmp_path / "s")
    finally:
        context.pythonExec = python
    assert str(caught.value) == (
        f"executors cannot run {tmp_path / 'no-python'} (No such file or directory): set "
        f"PYSPARK_PYTHON or spark.pyspark.python to a Python {DRIVER} every node has"
    )


def test_probe_runs_and_reports_in_a_python_without_equeue(tmp_path: Path) -> None:
    """The task's function needs only the standard library: its own source, run by a
    Python that has no equeue (-I: no PYTHONPATH; -S: no site-packages)."""
    import inspect

    source = inspect.getsource(probe)
    script = (
        "from __future__ import annotations\n"
        "from collections.abc import Iterable, Iterator\n"
        f"{source}\n"
        f"print(next(probe({str(tmp_path / 'nope')!r}, None, [])))\n"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    _host, python, where, speedups, import_error, store_error, write_error = eval(done.stdout)
    assert (python, where, speedups, write_error) == (DRIVER, "", "", "")
    assert import_error == "ModuleNotFoundError: No module named 'equeue'"
    assert store_error == "FileNotFoundError"
    # The control: here, with equeue.
    (row,) = list(probe(str(tmp_path / "nope"), None, []))
    assert row[2] == str(Path(equeue.__file__).parent) and row[4] == ""


# --- the spark-submit entry point ----------------------------------------------------


def test_spark_submit_writes_the_report_to_its_file(cluster: ClusterRun) -> None:
    """The documented path: spark-submit tools/spark_compact.py --report FILE. The report
    goes to FILE whole (stdout, which holds the driver's stderr too, has no JSON in it),
    and Spark logs at WARN: no INFO lines."""
    run = cluster.submit
    if run is None:
        pytest.skip("no spark-submit beside this Python")
    assert run.returncode == 0, run.output[-3000:]
    doc = json.loads((run.directory / "report.json").read_text())
    assert doc["records_removed"] == len(run.removed) > 0
    after = snapshot_messages(run.directory / "s")
    assert after == {p: m for p, m in run.before.items() if p not in run.removed}
    output = run.output
    assert "[compact] pass 2 done" in output
    assert '"records_removed"' not in output
    assert "replaced a previously registered data source" not in output  # registered once
    # Spark's INFO log stops where spark.log.level applies: after the SparkContext's banner.
    lines = output.splitlines()
    (warn,) = [i for i, line in enumerate(lines) if line == 'Setting Spark log level to "WARN".']
    assert not [line for line in lines[warn:] if " INFO " in line]
    assert len([line for line in lines if " INFO " in line]) <= 5
    assert [p.name for p in run.directory.iterdir() if p.name.startswith("report")] == [
        "report.json"
    ]


def test_session_gives_the_workers_the_python_its_config_names(
    spark: SparkSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PySpark reads its workers' Python from PYSPARK_PYTHON only (spark.pyspark.python
    only under spark-submit): ``equeue compact --conf spark.pyspark.python=X`` was ignored
    on a standalone cluster, and the preflight's messages name that setting."""
    from equeue.spark import session

    monkeypatch.setenv("PYSPARK_PYTHON", "/nonexistent/python")
    assert session(config={"spark.pyspark.python": sys.executable}) is spark
    assert os.environ["PYSPARK_PYTHON"] == sys.executable
