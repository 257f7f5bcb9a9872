"""The ``spark-submit`` entry point of the compaction job (see docs/compaction.md):

    spark-submit --master spark://head:7077 tools/spark_compact.py /shared/store \\
        --report report.json [--dry-run] [--now TIME] [--no-merge] [--log-level LEVEL]

The master, executors, memory and ``--py-files`` come from spark-submit. The report
is JSON: written to FILE with ``--report FILE`` (atomically; nothing else goes there),
else printed on stdout. Progress goes to stderr, which spark-submit sends to stdout
for a Python driver: hence ``--report``. Spark logs at WARN unless ``--log-level``
says otherwise (spark.log.level: it applies once the SparkContext starts, after the
three INFO lines of its banner; a log4j2.properties given to spark-submit silences those).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

LOG_LEVELS = ("ALL", "DEBUG", "INFO", "WARN", "ERROR", "FATAL", "OFF")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compact an equeue store with Spark.")
    parser.add_argument("store", help="the store directory, on a filesystem every node mounts")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    parser.add_argument("--now", help="retention is measured from TIME (ISO-8601 or unix seconds)")
    parser.add_argument("--no-merge", action="store_true", help="never merge chunks")
    parser.add_argument(
        "--report", type=Path, metavar="FILE", help="write the JSON report to FILE, not stdout"
    )
    parser.add_argument(
        "--log-level",
        default="WARN",
        choices=LOG_LEVELS,
        type=str.upper,
        help="Spark's log level (spark.log.level; default WARN)",
    )
    args = parser.parse_args(argv)

    from equeue.atomicfile import write_bytes
    from equeue.compaction.job import compact
    from equeue.errors import EQueueError
    from equeue.inspect.records import parse_time
    from equeue.spark import session

    try:
        # The master spark-submit was given; quiet: a JVM started here (not by spark-submit)
        # keeps its banner and log to itself.
        spark = session(
            None,
            app_name="equeue-compact",
            config={"spark.log.level": args.log_level},
            quiet=args.log_level in ("WARN", "ERROR", "FATAL", "OFF"),
        )
        try:
            report = compact(
                args.store,
                spark=spark,
                now=None if args.now is None else parse_time(args.now) / 1e9,
                dry_run=args.dry_run,
                merge=not args.no_merge,
                progress=lambda line: print(f"[compact] {line}", file=sys.stderr, flush=True),
            )
        finally:
            spark.stop()
    except EQueueError as exc:  # one line, as the equeue command prints it
        print(f"spark_compact: error: {exc}", file=sys.stderr)
        return 1
    if args.report is not None:
        write_bytes(args.report, json.dumps(report.as_dict(), indent=2).encode() + b"\n")
    else:
        print(json.dumps(report.as_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
