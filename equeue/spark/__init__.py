"""Spark integration: the ``equeue`` data source and the session the compaction job uses.

Importing this package needs the ``spark`` extra (pyspark, pyarrow); the rest of
equeue never imports it.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import TYPE_CHECKING

from equeue.errors import SparkUnavailableError
from equeue.spark.java import require_spark
from equeue.spark.preflight import preflight as preflight  # equeue.spark.preflight(spark, store)

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def register(spark: SparkSession) -> None:
    """Make ``spark.read.format("equeue").load(STORE)`` available in ``spark``."""
    from equeue.spark.datasource import EqueueDataSource

    # The batch source implements pushFilters, which Spark refuses to plan unless this is
    # on (DATA_SOURCE_PUSHDOWN_DISABLED): a session that registers EqueueDataSource itself
    # must set it too.
    spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    # Once per session: registering again makes Spark warn that the source was replaced.
    if spark.conf.get(_REGISTERED, None) != "true":
        spark.dataSource.register(EqueueDataSource)
        spark.conf.set(_REGISTERED, "true")


_REGISTERED = "spark.equeue.registered"


def session(
    master: str | None = None,
    app_name: str = "equeue",
    *,
    shuffle_partitions: int = 8,
    config: dict[str, str] | None = None,
    quiet: bool = False,
) -> SparkSession:
    """A SparkSession with the data source registered.

    ``master`` None keeps what spark-submit set (or ``local[*]``). Workers run this
    interpreter (PYSPARK_PYTHON) unless the environment names another, so a local
    run uses the venv that has equeue installed. ``quiet`` sends the output of a JVM
    started here (Spark's log, the JVM's warnings) to a temporary file instead of
    stderr; it is shown only if the JVM fails to start. Raises SparkUnavailableError
    without pyspark or a Java runtime (17 or newer).
    """
    require_spark()
    from pyspark.sql import SparkSession

    # PySpark takes its workers' Python from PYSPARK_PYTHON alone (outside spark-submit,
    # spark.pyspark.python is not read): a Python named in ``config`` must go there.
    named = (config or {}).get("spark.pyspark.python")
    if named:
        os.environ["PYSPARK_PYTHON"] = named
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    options: dict[str, bool | float | int | str | None] = {"spark.app.name": app_name}
    if master is not None:
        options["spark.master"] = master
        if master.startswith("local"):
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
            options["spark.driver.host"] = "127.0.0.1"
            # A local job is short and shares the machine's few cores with its Python
            # workers, so the JVM should spend as little CPU as it can: C2's compiler
            # threads cost more than their code saves (on the 1 GiB benchmark, 10 s of
            # compile CPU against 1.4 s with C1 alone), and G1's concurrent threads more
            # than the serial collector on a heap of tens of MiB. The driver's options
            # set the one JVM; ``config`` can replace them.
            options["spark.driver.extraJavaOptions"] = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
            # The shuffles carry key hashes (random bytes) and positions: LZ4 finds little
            # to save, and the files stay on this machine's disk.
            options["spark.shuffle.compress"] = "false"
            # Workers import the installed pyspark, not Spark's zip (see daemon.py). Local
            # only: a cluster's executors need not have equeue at the daemon's start.
            options["spark.python.daemon.module"] = "equeue.spark.daemon"
    options.update(config or {})
    options["spark.ui.showConsoleProgress"] = "false"
    options["spark.sql.execution.arrow.pyspark.enabled"] = "true"
    # DataFrame shuffles (the data source's users): a few partitions per core, not
    # 200. The compaction job sizes its own shuffles (job.py), not by this.
    options["spark.sql.shuffle.partitions"] = str(shuffle_partitions)
    if quiet:
        _start_quietly(options)
    spark = SparkSession.builder.config(map=options).getOrCreate()
    register(spark)
    return spark


def _start_quietly(options: dict[str, bool | float | int | str | None]) -> None:
    """Start the JVM as getOrCreate would, its stdout and stderr to an unlinked temporary
    file: its log4j banner and log, and the JVM's own warnings ("Using incubator
    modules"), which no log level silences. Nothing to do if a JVM runs already (an
    earlier session, or spark-submit's)."""
    from pyspark import SparkConf, SparkContext
    from pyspark.errors import PySparkException
    from pyspark.java_gateway import launch_gateway

    if SparkContext._gateway is not None or "PYSPARK_GATEWAY_PORT" in os.environ:
        return  # (pyspark keeps its one JVM in SparkContext._gateway, ever since 1.0)
    conf = SparkConf()  # as getOrCreate builds it, before a JVM exists
    for key, value in options.items():
        conf.set(key, str(value))
    with tempfile.TemporaryFile() as log:
        try:
            gateway = launch_gateway(  # type: ignore[no-untyped-call]
                conf, popen_kwargs={"stdout": log, "stderr": log}
            )
        except PySparkException as exc:
            log.seek(0)
            lines = log.read().decode(errors="replace").strip().splitlines()
            said = f": {lines[-1]}" if lines else ""
            raise SparkUnavailableError(f"Spark's JVM did not start ({exc}){said}") from None
    SparkContext(conf=conf, gateway=gateway)  # the active context getOrCreate then takes
