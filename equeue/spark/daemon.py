"""The daemon that forks a local session's Python workers (``spark.python.daemon.module``):
pyspark's own, run from the installed pyspark instead of ``pyspark.zip``.

Spark puts ``$SPARK_HOME/python/lib/pyspark.zip`` first on its workers' path. Python
compiles a zip's modules from source in every process that imports them (it writes
no bytecode into a zip): 0.9 s of CPU for pyspark's daemon and worker modules, where
the installed package's bytecode loads in 0.14 s. It fell on the daemon, which runs
alone before any worker can start, then on each worker for the worker's modules: in
the path of every session's first task; see docs/benchmarks.md. When the zips are the
only pyspark or py4j found, the path is left as it is.

The workers are forked from this process as from pyspark's daemon, which must start
no thread before it forks: importing equeue starts none (its prefault thread starts
with the first append), and numpy is not imported until a worker needs it.
"""

from __future__ import annotations

import sys
from importlib.machinery import PathFinder
from pathlib import PurePath


def _zipped(entry: str) -> bool:
    name = PurePath(entry).name
    return name == "pyspark.zip" or (name.startswith("py4j-") and name.endswith(".zip"))


def installed_path(path: list[str]) -> list[str]:
    """``path`` without Spark's zips, if pyspark and py4j are found without them."""
    kept = [entry for entry in path if not _zipped(entry)]
    if len(kept) == len(path):
        return path
    if all(PathFinder.find_spec(name, kept) is not None for name in ("pyspark", "py4j")):
        return kept
    return path


def main() -> None:
    sys.path[:] = installed_path(sys.path)
    from pyspark.daemon import manager

    manager()


if __name__ == "__main__":
    main()
