"""Before a job's first task: can the executors run equeue's tasks on this store?

A cluster whose nodes lack equeue, run another Python, or do not mount the store
otherwise fails each task four times, after a minute, with a hundred lines of
traceback per attempt. ``preflight`` runs one small job first, a task per task slot
(up to ``MAX_TASKS``), and turns what went wrong into one line (SparkClusterError):

- ``executors cannot import equeue (ModuleNotFoundError: ...): ...``
- ``executors run Python 3.12, the driver 3.11: ...``
- ``executors cannot run /opt/py/bin/python (No such file or directory): ...``
- ``executors cannot see /x/store/store.json (FileNotFoundError on node-2): ...``
- ``executors cannot write /x/store/compaction (PermissionError on node-2): ...``

The task function (``probe``) imports nothing of equeue's at module level and is
shipped by value, so it runs where ``import equeue`` fails and can say why.

``ship_equeue`` zips this equeue package and adds it to a session's Python path
(``equeue compact --ship-equeue``): for nodes without equeue installed. The C
accelerator cannot load from a zip, so executors then run the pure-Python paths.
"""

from __future__ import annotations

import atexit
import builtins
import functools
import os
import re
import shutil
import sys
import tempfile
import types
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final, cast

from equeue.errors import SparkClusterError
from equeue.store.meta import IDENTITY_FILE

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

MAX_TASKS: Final = 64
_INSTALL: Final = (
    "install equeue on the nodes or ship it (equeue compact --ship-equeue, or "
    "ship_equeue(spark) from equeue.spark.preflight)"
)
_MOUNT: Final = "mount the store at the same path on every node"


@dataclass(frozen=True, slots=True)
class ExecutorReport:
    """What one preflight task found where it ran."""

    host: str
    python: str  # "3.11"
    equeue: str | None  # where equeue was imported from; None if it was not
    speedups: bool  # the C accelerator loaded there
    import_error: str | None  # "ModuleNotFoundError: No module named 'equeue'"
    store_error: str | None  # opening store.json: "FileNotFoundError"
    write_error: str | None  # creating a file in the directory to write


def probe(store_file: str, write_dir: str | None, _rows: Iterable[int]) -> Iterator[list[str]]:
    """The task: runs on an executor, with the standard library only (shipped by value,
    see ``_by_value``); yields one row, ExecutorReport's fields as strings ("" for None)."""
    import os
    import socket
    import sys
    import tempfile

    where, speedups, import_error = "", "", ""
    try:
        import equeue
        from equeue.speedups import SPEEDUPS

        where, speedups = os.path.dirname(equeue.__file__ or "?"), "1" if SPEEDUPS else ""
    except Exception as exc:  # whatever stops the import is the answer
        import_error = f"{type(exc).__name__}: {exc}"
    store_error = ""
    try:
        with open(store_file, "rb") as f:
            f.read(1)
    except OSError as exc:
        store_error = type(exc).__name__
    write_error = ""
    if write_dir:
        try:
            fd, name = tempfile.mkstemp(prefix=".preflight-", dir=write_dir)
            os.close(fd)
            os.unlink(name)
        except OSError as exc:
            write_error = type(exc).__name__
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    yield [socket.gethostname(), python, where, speedups, import_error, store_error, write_error]


_Probe = Callable[[str, str | None, Iterable[int]], Iterator[list[str]]]


def _by_value(function: _Probe) -> _Probe:
    """``function`` as a function of no importable module: cloudpickle then ships its
    code instead of a reference to ``equeue.spark.preflight``, which an executor without
    equeue could not resolve (the task would fail before it could report)."""
    shipped = types.FunctionType(
        function.__code__,
        {"__builtins__": builtins, "__name__": "equeue_preflight_probe"},
        function.__name__,
        function.__defaults__,
        function.__closure__,
    )
    return cast(_Probe, shipped)


def run_probes(
    spark: SparkSession, store_file: str, write_dir: str | None = None
) -> list[ExecutorReport]:
    """Runs ``probe`` as one task per task slot (up to MAX_TASKS); the paths are passed as
    given. A task that fails before the probe runs (the worker's Python is another minor
    version; the worker cannot start) raises SparkClusterError saying what failed."""
    from py4j.protocol import Py4JError
    from pyspark.errors import PySparkException

    context = spark.sparkContext
    tasks = max(1, min(MAX_TASKS, context.defaultParallelism))
    task = functools.partial(_by_value(probe), store_file, write_dir)
    try:
        rows: list[list[str]] = (
            context.parallelize(range(tasks), tasks).mapPartitions(task).collect()
        )
    except (Py4JError, PySparkException) as exc:
        raise SparkClusterError(_failed_task(str(exc), _driver_python())) from None
    return [
        ExecutorReport(
            host=host,
            python=python,
            equeue=where or None,
            speedups=bool(speedups),
            import_error=import_error or None,
            store_error=store_error or None,
            write_error=write_error or None,
        )
        for host, python, where, speedups, import_error, store_error, write_error in rows
    ]


_MISMATCH: Final = re.compile(r"different version:? (\d+\.\d+) than that in driver:? (\d+\.\d+)")
_IMPORT: Final = re.compile(
    r"\b(ModuleNotFoundError: No module named '[^'\n]*'|ImportError: [^\n]*)"
)
_NO_PROGRAM: Final = re.compile(r'Cannot run program "([^"\n]+)": error=\d+, ([^\n]+)')
_ERROR: Final = re.compile(r"\b([A-Z]\w*(?:Error|Exception): [^\n]*)")


def _driver_python() -> str:
    return f"{sys.version_info[0]}.{sys.version_info[1]}"


def _mismatch(executors: str, driver: str) -> str:
    return (
        f"executors run Python {executors}, the driver {driver}: run the driver with Python "
        f"{executors}, or give the executors a Python {driver} (spark.pyspark.python, "
        "PYSPARK_PYTHON)"
    )


def _failed_task(text: str, driver: str) -> str:
    """One line for a preflight task that Spark reports failed (its text, a Java stack
    trace with the Python worker's output in it)."""
    found = _MISMATCH.search(text)
    if found is not None:
        return _mismatch(found.group(1), found.group(2))
    found = _NO_PROGRAM.search(text)
    if found is not None:  # PYSPARK_PYTHON names a Python the nodes do not have
        return (
            f"executors cannot run {found.group(1)} ({found.group(2).strip()}): set "
            f"PYSPARK_PYTHON or spark.pyspark.python to a Python {driver} every node has"
        )
    found = _IMPORT.search(text)
    if found is not None:  # a worker (or the daemon forking it) could not start
        return f"executors cannot import equeue ({found.group(1).strip()}): {_INSTALL}"
    errors = _ERROR.findall(text)
    said = errors[-1].strip() if errors else text.strip().splitlines()[0] if text.strip() else ""
    return f"the preflight task failed on the executors: {said[:300]}"


def verdict(
    reports: list[ExecutorReport],
    store_file: str,
    write_dir: str | None = None,
    driver: str | None = None,
) -> str | None:
    """The one line saying why the executors cannot run equeue's tasks; None if they can.
    ``driver`` is the driver's Python (major.minor), this interpreter's by default."""
    driver = driver or _driver_python()

    def hosts(picked: list[ExecutorReport]) -> str:
        return ", ".join(sorted({r.host for r in picked}))

    other = sorted({r.python for r in reports if r.python != driver})
    if other:
        return _mismatch(", ".join(other), driver)
    failed = [r for r in reports if r.import_error]
    if failed:
        return f"executors cannot import equeue ({failed[0].import_error}): {_INSTALL}"
    failed = [r for r in reports if r.store_error]
    if failed:
        return (
            f"executors cannot see {store_file} ({failed[0].store_error} on {hosts(failed)}): "
            f"{_MOUNT}"
        )
    failed = [r for r in reports if r.write_error]
    if failed:
        return (
            f"executors cannot write {write_dir} ({failed[0].write_error} on {hosts(failed)}): "
            "the job's tasks write there; give the executors' user write access to it"
        )
    return None


def preflight(
    spark: SparkSession, store: str | os.PathLike[str], *, write_dir: str | None = None
) -> list[ExecutorReport]:
    """Check that the executors of ``spark`` import equeue, run the driver's Python minor
    version and read ``store``'s store.json (and, with ``write_dir``, can create files in
    it). Raises SparkClusterError with one line saying what is wrong; returns what each
    task found (which equeue, whether the C accelerator loaded)."""
    store_file = os.path.join(os.path.abspath(store), IDENTITY_FILE)
    if write_dir is not None:
        write_dir = os.path.abspath(write_dir)
    reports = run_probes(spark, store_file, write_dir)
    problem = verdict(reports, store_file, write_dir)
    if problem is not None:
        raise SparkClusterError(problem)
    return reports


def summary(reports: list[ExecutorReport]) -> str:
    """One line for a job's progress: where the tasks ran and which equeue they import."""
    hosts = sorted({r.host for r in reports})
    where = sorted({r.equeue or "?" for r in reports})
    accelerated = {r.speedups for r in reports}
    speed = (
        "with the C accelerator"
        if accelerated == {True}
        else "pure Python (no C accelerator)"
        if accelerated == {False}
        else "with the C accelerator on some executors only"
    )
    return (
        f"{len(reports)} preflight tasks on {len(hosts)} host{'s' if len(hosts) > 1 else ''} "
        f"({', '.join(hosts[:4])}"
        f"{', ...' if len(hosts) > 4 else ''}): Python {reports[0].python}, equeue from "
        f"{', '.join(where)}, {speed}"
    )


def equeue_zip(directory: str | os.PathLike[str]) -> Path:
    """A zip of this equeue package's Python files (no C accelerator: a zip cannot hold
    one that loads) in ``directory``, for ``--py-files``/``addPyFile``."""
    package = Path(__file__).resolve().parent.parent
    target = Path(directory) / "equeue.zip"
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(package.rglob("*")):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            if path.suffix == ".py":
                archive.write(path, Path("equeue") / path.relative_to(package))
    return target


def ship_equeue(spark: SparkSession) -> Path:
    """Add a zip of this equeue package to ``spark``'s executors' Python path. It comes
    before anything installed on the nodes, so an installed equeue (with its C
    accelerator) is hidden while the session lasts."""
    directory = tempfile.mkdtemp(prefix="equeue-ship-")
    # Spark serves the file from here to executors that start later: kept to the end.
    atexit.register(shutil.rmtree, directory, True)
    target = equeue_zip(directory)
    spark.sparkContext.addPyFile(str(target))
    return target
