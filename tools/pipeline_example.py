"""`make pipeline`: messages flow from a store through Spark for about 30 s on local[2].

- A producer process sends orders into ``orders`` (a JSON body with the customer and
  the amount in cents, keyed by customer) and price updates into ``prices``, a
  compacted topic (the newest price per item is what counts).
- A Structured Streaming query reads ``orders`` from the store as it grows
  (``readStream.format("equeue")``) and writes per-minute order counts and sums into
  Parquet, one directory per micro-batch (a re-run batch replaces its own output).
- Compaction runs beside them in the same Spark session every few seconds.
- When the producer stops, the query is stopped and restarted from its checkpoint
  with ``Trigger.AvailableNow``, so it finishes exactly where the producer did.

At the end it prints the per-minute table and checks it three ways: the Parquet
totals against what the producer says it sent, and the per-minute rows against a
batch read of the same store (``spark.read.format("equeue")``).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ORDERS = "orders"
PRICES = "prices"
ORDER_SCHEMA = "order long, customer string, amount_cents long"


def produce(store: Path, seconds: float, report: Path) -> None:
    """The producer process: orders and prices until ``seconds`` pass; writes its totals."""
    from equeue import MessageStore, OutgoingMessage, StoreConfig

    rng = random.Random(22)
    sent = amount = prices = 0
    deadline = time.monotonic() + seconds
    config = StoreConfig(chunk_data_size=4 << 20, queue_chunk_records=50_000)
    with MessageStore.open(store, config) as opened:
        while time.monotonic() < deadline:
            batch = []
            for _ in range(200):
                cents = rng.randrange(100, 100_000)
                customer = f"customer-{rng.randrange(1000)}"
                body = json.dumps({"order": sent, "customer": customer, "amount_cents": cents})
                batch.append(OutgoingMessage(body.encode(), key=customer, tag="created"))
                sent += 1
                amount += cents
            opened.send_batch(ORDERS, batch)
            updates = [
                OutgoingMessage(str(rng.randrange(100, 999)).encode(), key=f"item-{n % 50}")
                for n in range(100)
            ]
            opened.send_batch(PRICES, updates)
            prices += len(updates)
            time.sleep(0.01)  # about 20,000 orders a second: a steady stream, not a flood
    report.write_text(json.dumps({"orders": sent, "amount_cents": amount, "prices": prices}))


def run(store: Path, out: Path, seconds: float) -> int:
    from pyspark.sql import DataFrame
    from pyspark.sql import functions as F

    from equeue import MessageStore, StoreConfig
    from equeue.compaction.job import compact
    from equeue.spark import session

    config = StoreConfig(chunk_data_size=4 << 20, queue_chunk_records=50_000)
    with MessageStore.open(store, config) as created:
        created.create_topic(ORDERS, 4)
        created.create_topic(PRICES, 2, cleanup="compact")
    spark = session("local[2]", app_name="equeue-pipeline", quiet=True)
    spark.sparkContext.setLogLevel("ERROR")

    def per_minute(batch: DataFrame, batch_id: int) -> None:
        # One directory per batch, replaced if Spark runs the batch again: exactly once.
        (
            batch.select(
                F.from_json(F.col("body").cast("string"), ORDER_SCHEMA).alias("o"), "stored_at"
            )
            .groupBy(F.date_trunc("minute", "stored_at").alias("minute"))
            .agg(F.count("*").alias("orders"), F.sum("o.amount_cents").alias("amount_cents"))
            .write.mode("overwrite")
            .parquet(str(out / "minutes" / f"batch={batch_id}"))
        )

    def start(available_now: bool) -> Any:
        stream = (
            spark.readStream.format("equeue")
            .option("topics", ORDERS)
            .option("startingOffsets", "earliest")
            .option("maxOffsetsPerTrigger", "50000")
            .load(str(store))
        )
        writer = stream.writeStream.foreachBatch(per_minute).option(
            "checkpointLocation", str(out / "checkpoint")
        )
        writer = (
            writer.trigger(availableNow=True)
            if available_now
            else writer.trigger(processingTime="2 seconds")
        )
        return writer.start()

    compactions: list[str] = []
    stop = threading.Event()

    def compact_beside() -> None:
        while not stop.wait(5.0):
            report = compact(store, spark=spark)
            compactions.append(
                f"{report.chunks_rewritten} chunks rewritten, {report.records_removed:,} records "
                f"removed, {report.bytes_before - report.bytes_after:,} bytes freed"
            )

    started = time.monotonic()
    query = start(available_now=False)
    # The producer starts once the query runs, so that the stream reads a growing store.
    totals = out / "producer.json"
    producer = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--produce",
            str(store),
            "--seconds",
            str(seconds),
            "--report",
            str(totals),
        ]
    )
    compactor = threading.Thread(target=compact_beside, name="compaction")
    compactor.start()
    producer.wait()
    stop.set()  # (the compaction under way finishes first)
    compactor.join()
    query.stop()
    restarted = start(available_now=True)  # from the checkpoint: exactly where it stopped
    restarted.awaitTermination()
    elapsed = time.monotonic() - started

    sent = json.loads(totals.read_text())
    minutes = (
        spark.read.parquet(str(out / "minutes"))
        .groupBy("minute")
        .agg(F.sum("orders").alias("orders"), F.sum("amount_cents").alias("amount_cents"))
        .orderBy("minute")
        .collect()
    )
    batch = (
        spark.read.format("equeue")
        .load(str(store))
        .where(F.col("topic") == ORDERS)
        .select(F.from_json(F.col("body").cast("string"), ORDER_SCHEMA).alias("o"), "stored_at")
        .groupBy(F.date_trunc("minute", "stored_at").alias("minute"))
        .agg(F.count("*").alias("orders"), F.sum("o.amount_cents").alias("amount_cents"))
        .orderBy("minute")
        .collect()
    )
    spark.stop()

    print(
        f"pipeline ran {elapsed:.0f} s: {sent['orders']:,} orders, {sent['prices']:,} prices sent"
    )
    print(f"{'minute (UTC)':<20} {'orders':>10} {'amount':>16}")
    for row in minutes:
        print(f"{row.minute:%Y-%m-%d %H:%M}     {row.orders:>10,} {row.amount_cents / 100:>16,.2f}")
    for line in compactions:
        print(f"compaction beside the stream: {line}")
    streamed = (sum(r.orders for r in minutes), sum(r.amount_cents for r in minutes))
    checks = {
        "streamed totals equal what the producer sent": streamed
        == (sent["orders"], sent["amount_cents"]),
        "streamed minutes equal a batch read of the store": [tuple(r) for r in minutes]
        == [tuple(r) for r in batch],
    }
    for check, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {check}")
    return 0 if all(checks.values()) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--produce", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.produce is not None:
        produce(args.produce, args.seconds, args.report)
        return 0
    work = Path(tempfile.mkdtemp(prefix="equeue-pipeline-"))
    try:
        out = work / "out"
        out.mkdir()
        return run(work / "store", out, args.seconds)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
