"""Run by tests/test_spark_cluster.py in a process of its own (one SparkContext per
process, the tests' is local[2]), in the directory holding the stores it names by
RELATIVE paths: r (read by the data source and by a streaming query), c1 (compacted
through the API), c2 (by the ``equeue compact`` command, shipping equeue and
marker.zip); and, when the test started one (BROKER_ENV), writes and reads through a
broker. Everything runs on ``local-cluster[2,1,1024]``: two executor JVMs in their
own working directories, each with its own Python workers, as on a cluster. Prints what
it saw as one JSON object.

argv: NOW (the compaction's clock, unix seconds), the executors' PYTHONPATH, and Pythons
of another minor version (to run as the executors' Python; may be none).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys
import sysconfig
import time
from collections.abc import Iterable, Iterator
from typing import Any

from equeue.cli import main as cli_main
from equeue.compaction.job import compact
from equeue.errors import SparkClusterError
from equeue.spark import preflight, session
from equeue.spark.preflight import run_probes, verdict

# A node's Python without equeue: of the PYTHONPATH Spark gives its workers it keeps
# Spark's zips (and --py-files'), not this equeue's directory; -S leaves out the venv's
# .pth files, one of which installs this equeue (editable); the venv's other packages
# (numpy, pyarrow, ...) stay importable. -P: `python -m` would put the working
# directory first on the path, and a local worker's is the driver's (a checkout, maybe);
# not `cd`, since an executor finds --py-files by paths relative to its own.
WITHOUT_EQUEUE = """#!/bin/sh
PYTHONPATH=$(echo "$PYTHONPATH" | tr : '\\n' | grep -E '[.](zip|jar)$' | paste -sd: -):{site}
export PYTHONPATH
exec {python} -S -P "$@"
"""


def without_equeue(path: str) -> str:
    """Writes a script at ``path`` running this Python as a node without equeue would (to
    be a pythonExec); returns its absolute path."""
    with open(path, "w") as f:
        f.write(WITHOUT_EQUEUE.format(python=sys.executable, site=sysconfig.get_paths()["purelib"]))
    os.chmod(path, 0o755)
    return os.path.abspath(path)


def _marker(_: Iterable[int]) -> Iterator[str]:
    import cluster_marker  # type: ignore[import-not-found]  # only in marker.zip

    yield str(cluster_marker.VALUE)


def _failure(spark: Any, python: str) -> str:
    """The preflight's error with ``python`` as the executors' Python."""
    context = spark.sparkContext
    before = context.pythonExec
    context.pythonExec = python  # the tasks of the next jobs run it
    try:
        preflight(spark, "r")
    except SparkClusterError as exc:
        return str(exc)
    finally:
        context.pythonExec = before
    return "no error"


def _stream(spark: Any, store: str) -> list[list[Any]]:
    """Every row a streaming query (Trigger.AvailableNow) reads from ``store``, relative."""
    rows: list[list[Any]] = []

    def collect(frame: Any, batch_id: int) -> None:
        rows.extend(
            [r.position, r.topic, r.queue_id, r.queue_offset, r.key, r.tag, bytes(r.body).hex()]
            for r in frame.collect()
        )

    query = (
        spark.readStream.format("equeue")
        .option("topicPattern", ".*")
        .option("startingOffsets", "earliest")
        .load(store)  # relative: the driver resolves it, the executors run elsewhere
        .writeStream.foreachBatch(collect)
        .option("checkpointLocation", "stream-checkpoint")
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(240)
    query.stop()
    return rows


BROKER_ENV = "EQUEUE_TEST_BROKER"  # the URL of a broker the test started, if any
BROKER_TOKEN_ENV = "EQUEUE_TEST_BROKER_TOKEN_FILE"  # its token file
BROKER_ROWS = 400


def _through_broker(spark: Any, url: str, token_file: str) -> list[str]:
    """Rows written by the executors through the broker (topic ``cluster``), then read
    back by them through it: the bodies the batch source gives."""
    df = spark.range(0, BROKER_ROWS, numPartitions=2).selectExpr(
        "concat('k', cast(id % 5 as string)) as key", "cast(id as string) as body"
    )
    options = {"broker": url, "tokenFile": token_file}
    df.write.format("equeue").options(**options).option("topic", "cluster").mode("append").save()
    read = spark.read.format("equeue").options(**options).option("topics", "cluster").load()
    return [bytes(r.body).decode() for r in read.collect()]


def run(now: float, executor_path: str, other_pythons: list[str]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    tick = time.monotonic()
    spark = session(
        "local-cluster[2,1,1024]",
        app_name="equeue-cluster-test",
        shuffle_partitions=2,
        config={
            "spark.ui.enabled": "false",
            "spark.executorEnv.PYTHONPATH": executor_path,
            # As on a real cluster: Spark's own daemon forks the workers, so a worker
            # starts without equeue and the preflight's task can say what it lacks.
            "spark.python.daemon.module": "pyspark.daemon",
            "spark.executor.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
            # The failures below fail at once, not after four attempts.
            "spark.task.maxFailures": "1",
        },
        quiet=True,
    )
    spark.sparkContext.setLogLevel("ERROR")
    seen["steps"] = {"start": time.monotonic() - tick}
    seen["preflight"] = [dataclasses.asdict(r) for r in preflight(spark, "r", write_dir="r")]
    seen["steps"]["preflight"] = time.monotonic() - tick
    frame = spark.read.format("equeue").load("r")
    seen["rows"] = [
        [r.position, r.topic, r.queue_id, r.queue_offset, r.key, r.tag, bytes(r.body).hex()]
        for r in frame.collect()
    ]
    seen["steps"]["read"] = time.monotonic() - tick
    seen["streamed"] = _stream(spark, "r")
    seen["steps"]["stream"] = time.monotonic() - tick
    broker = os.environ.get(BROKER_ENV)
    if broker:
        seen["broker_read"] = _through_broker(spark, broker, os.environ[BROKER_TOKEN_ENV])
        seen["steps"]["broker"] = time.monotonic() - tick
    # The path as given, unresolved: the executors' working directories hold no "r".
    seen["unseen"] = verdict(run_probes(spark, "r/store.json"), "r/store.json")
    seen["unimportable"] = _failure(spark, without_equeue("without-equeue.sh"))
    seen["mismatch"] = {python: _failure(spark, python) for python in other_pythons}
    seen["steps"]["failures"] = time.monotonic() - tick
    seen["c1"] = compact("c1", spark=spark, now=now).as_dict()
    seen["steps"]["c1"] = time.monotonic() - tick
    # The command on nodes without equeue, which --ship-equeue gives them. (Another
    # pythonExec than the one above: new workers, which have tried no import yet.)
    spark.sparkContext.pythonExec = without_equeue("nodes-without-equeue.sh")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        seen["cli_exit"] = cli_main(
            [
                "compact",
                "c2",
                "--json",
                "--now",
                str(now),
                "--ship-equeue",
                "--py-files",
                "marker.zip",
                "--conf",
                "spark.equeue.test=passed",
            ]
        )
    seen["steps"]["cli"] = time.monotonic() - tick
    seen["cli_report"] = json.loads(out.getvalue()) if seen["cli_exit"] == 0 else None
    seen["cli_progress"] = err.getvalue().splitlines()
    seen["conf"] = spark.conf.get("spark.equeue.test", None)
    seen["marker"] = spark.sparkContext.parallelize([0], 1).mapPartitions(_marker).collect()
    seen["seconds"] = time.monotonic() - tick
    spark.stop()
    return seen


if __name__ == "__main__":
    print(json.dumps(run(float(sys.argv[1]), sys.argv[2], sys.argv[3:])))
