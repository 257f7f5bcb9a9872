"""Spark integration: the ``equeue`` data source and the session the compaction job uses.

Importing this package needs the ``spark`` extra (pyspark, pyarrow); the rest of
equeue never imports it.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def register(spark: SparkSession) -> None:
    """Make ``spark.read.format("equeue").load(STORE)`` available in ``spark``."""
    from equeue.spark.source import EqueueDataSource

    spark.dataSource.register(EqueueDataSource)


def session(
    master: str | None = None,
    app_name: str = "equeue",
    *,
    shuffle_partitions: int = 8,
    config: dict[str, str] | None = None,
) -> SparkSession:
    """A SparkSession with the data source registered.

    ``master`` None keeps what spark-submit set (or ``local[*]``). Workers run this
    interpreter (PYSPARK_PYTHON) unless the environment names another, so a local
    run uses the venv that has equeue installed.
    """
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName(app_name)
    if master is not None:
        builder = builder.master(master)
        if master.startswith("local"):
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
            builder = builder.config("spark.driver.host", "127.0.0.1")
            # A local job is short and shares the machine's few cores with its Python
            # workers, so the JVM should spend as little CPU as it can: C2's compiler
            # threads cost more than their code saves (on the 1 GiB benchmark, 10 s of
            # compile CPU against 1.4 s with C1 alone), and G1's concurrent threads more
            # than the serial collector on a heap of tens of MiB. The driver's options
            # set the one JVM; ``config`` can replace them.
            builder = builder.config(
                "spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
            )
            # The shuffles carry key hashes (random bytes) and positions: LZ4 finds little
            # to save, and the files stay on this machine's disk.
            builder = builder.config("spark.shuffle.compress", "false")
            # Workers import the installed pyspark, not Spark's zip (see daemon.py). Local
            # only: a cluster's executors need not have equeue at the daemon's start.
            builder = builder.config("spark.python.daemon.module", "equeue.spark.daemon")
    for key, value in (config or {}).items():
        builder = builder.config(key, value)
    spark = (
        builder.config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        # DataFrame shuffles (the data source's users): a few partitions per core, not
        # 200. The compaction job sizes its own shuffles (job.py), not by this.
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .getOrCreate()
    )
    register(spark)
    return spark
