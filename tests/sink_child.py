"""A Spark driver for the sink's crash tests, run as a subprocess (its own SparkContext).

``python sink_child.py STORE JOB_ID ROWS`` writes ``frame(ROWS)`` to topic ``t`` of
STORE with option jobId, on ``local[2,4]`` (a failed task is tried again, up to 4
times), the writer's tasks fed Arrow batches of 2000 rows. The crashes are the sink's
test hooks, set in the environment: EQUEUE_SINK_KILL_TASK=P:N SIGKILLs the first attempt
of partition P's Python worker once it staged N rows; EQUEUE_SINK_KILL_AFTER_ROWS=N
SIGKILLs the commit's process once it appended N rows (Spark runs a Python data source's
commit in a Python process the driver's JVM starts; its death fails the job).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from equeue.spark import session

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

BATCH_ROWS = 2000


def frame(spark: SparkSession, rows: int) -> DataFrame:
    """Bodies "<n>", keys "k<n % 97>", 4 partitions."""
    return spark.range(0, rows, numPartitions=4).selectExpr(
        "cast(id as string) as body", "concat('k', cast(id % 97 as string)) as key"
    )


def main(argv: list[str]) -> int:
    store, job_id, rows = argv[0], argv[1], int(argv[2])
    spark = session(
        "local[2,4]",
        app_name="equeue-sink-child",
        shuffle_partitions=2,
        config={
            "spark.ui.enabled": "false",
            "spark.sql.execution.arrow.maxRecordsPerBatch": str(BATCH_ROWS),
        },
        quiet=True,
    )
    spark.sparkContext.setLogLevel("ERROR")
    writer = frame(spark, rows).write.format("equeue").option("topic", "t")
    writer.option("jobId", job_id).mode("append").save(store)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
