"""The streaming source on ``local-cluster[2,1,1024]`` (two executor JVMs, their own Python
workers), from a RELATIVE store path: run in a subprocess (one SparkContext per process)
whose working directory holds the store.

    python tests/stream_cluster_child.py WORKTREE

It creates ``store`` in the working directory, streams it with Trigger.AvailableNow and
prints one JSON line: rows read, rows expected, whether they are the same, executors seen.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from stream_producer import config as producer_config
from stream_producer import create, produce

from equeue import MessageStore
from equeue.spark import session


def main() -> int:
    worktree = Path(sys.argv[1]).resolve()
    create(Path("store"))
    with MessageStore.open("store", producer_config()) as writer:
        produce(writer, 0, 300)
    path = os.pathsep.join([str(worktree), str(worktree / "tests")])
    spark = session(
        "local-cluster[2,1,1024]",
        app_name="equeue-stream-cluster",
        shuffle_partitions=2,
        quiet=True,
        config={
            "spark.ui.enabled": "false",
            "spark.executorEnv.PYTHONPATH": path,
            "spark.executor.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        },
    )
    spark.sparkContext.setLogLevel("ERROR")
    got: list[tuple[str, int, int, bytes]] = []

    def sink(df, batch_id):  # type: ignore[no-untyped-def]
        got.extend(
            (r[0], r[1], r[2], bytes(r[3]))
            for r in df.select("topic", "queue_id", "queue_offset", "body").collect()
        )

    query = (
        spark.readStream.format("equeue")
        .option("topicPattern", "orders|payments")
        .option("startingOffsets", "earliest")
        .load("store")  # relative: the driver resolves it, executors run elsewhere
        .writeStream.foreachBatch(sink)
        .option("checkpointLocation", "ck")
        .trigger(availableNow=True)
        .start()
    )
    finished = query.awaitTermination(240)
    executors = spark.sparkContext._jsc.sc().getExecutorMemoryStatus().size() - 1
    with MessageStore.open("store", read_only=True) as store:
        want = sorted(
            (m.topic, m.queue_id, m.queue_offset, m.body)
            for t in ("orders", "payments")
            for q in store.queue_ids(t)
            for m in store.pull(t, q, 0, 1000)
        )
    spark.stop()
    print(
        json.dumps(
            {
                "finished": finished,
                "rows": len(got),
                "expected": len(want),
                "same": sorted(got) == want,
                "executors": executors,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
