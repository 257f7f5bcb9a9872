"""The ``spark-submit`` entry point of the compaction job (see docs/compaction.md):

    spark-submit --master spark://head:7077 --py-files equeue.zip \
        tools/spark_compact.py /shared/store [--dry-run] [--now TIME] [--no-merge]

The master, executors and memory come from spark-submit; the report is printed
as JSON on stdout, progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compact an equeue store with Spark.")
    parser.add_argument("store", help="the store directory, on a filesystem every node mounts")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    parser.add_argument("--now", help="retention is measured from TIME (ISO-8601 or unix seconds)")
    parser.add_argument("--no-merge", action="store_true", help="never merge chunks")
    args = parser.parse_args(argv)

    from equeue.compaction.job import compact
    from equeue.inspect.records import parse_time
    from equeue.spark import session

    spark = session(None, app_name="equeue-compact")  # the master spark-submit was given
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
    print(json.dumps(report.as_dict(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
