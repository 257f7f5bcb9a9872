"""Fixtures shared by several test modules: one local SparkSession for the whole run; the
chunk maker slowed on request (slow_chunk_maker.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
from fork_child import ForkServer
from slow_chunk_maker import install_from_environment

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

SPARK_GROUP = "spark"  # the xdist_group of the tests that use the spark fixture
# Fixtures made once per module (or class): a worker that gets one test of the module
# makes its own, so under xdist the tests that use one go to one worker (below).
_SHARED_SCOPES = frozenset({"module", "class", "package"})


def pytest_configure(config: pytest.Config) -> None:
    install_from_environment()  # EQUEUE_TEST_SLOW_MAKER (slow_chunk_maker.py)


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> Iterator[None]:
    """Under pytest-xdist (make test: ``-n 3 --dist loadgroup``) each set-up shared by
    several tests runs once a run, not once per worker that gets one of them: every test
    that uses the session's SparkSession goes to one worker (one JVM, each cold start
    costing seconds and ~1 GB), and the tests of a module that use a module-scoped fixture
    go to one worker (round 21's parallel run made the local-cluster child three times,
    2.4 min each, and the peer benchmarks' set-up twice). Without xdist nothing is marked
    (the mark is xdist's own; an unregistered mark warns). A wrapper: the marks go on
    before xdist's worker reads them (its hook of this name puts the group into the node
    id). xdist sends the groups with the most tests first (--loadscope-reorder)."""
    grouped = config.pluginmanager.hasplugin("xdist")
    if grouped:
        for item in items:
            group = _xdist_group(item)
            if group is not None:
                item.add_marker(pytest.mark.xdist_group(group))
    yield
    if grouped and config.getoption("loadgroup", False):
        for item in items:
            _group_node_id(item)


def _xdist_group(item: pytest.Item) -> str | None:
    """SPARK_GROUP; the module's path for a test that uses a fixture made once per module
    or class; else None (the test goes wherever a worker is free)."""
    names = getattr(item, "fixturenames", ())
    if "spark" in names:
        return SPARK_GROUP
    info: Any = getattr(item, "_fixtureinfo", None)  # pytest has no public way to a scope
    definitions: dict[str, Any] = getattr(info, "name2fixturedefs", {})
    for name in names:
        chosen = definitions.get(name)
        if chosen and chosen[-1].scope in _SHARED_SCOPES:
            return item.nodeid.split("::", 1)[0]
    return None


def _group_node_id(item: pytest.Item) -> None:
    """xdist 3.8 groups by the node id's "@group" suffix, which it writes to
    ``item._nodeid``; pytest 9.2 makes the node id of ``item._id`` (a NodeId) and ignores
    that, so every worker got Spark tests and started its own JVM (round 21's first
    parallel run: three). The suffix goes where pytest 9.2 reads the id from."""
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return
    suffix = "@" + str(mark.args[0])
    if item.nodeid.endswith(suffix):
        return  # an older pytest: xdist's own suffix took
    node_id: Any = getattr(item, "_id", None)
    if node_id is None or not dataclasses.is_dataclass(node_id) or isinstance(node_id, type):
        return
    suffixed: Any = dataclasses.replace(node_id)
    object.__setattr__(suffixed, "_str_cache", f"{node_id}{suffix}")
    item._id = suffixed


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """local[2], tuned to start fast: a cold JVM costs seconds, so every Spark test shares it.
    Without Java (or pyspark) the tests that use it are skipped, saying so; any other
    failure to start is an error."""
    from equeue.errors import SparkUnavailableError
    from equeue.spark import session

    try:
        spark = session(
            "local[2]",
            app_name="equeue-tests",
            shuffle_partitions=2,
            config={
                "spark.ui.enabled": "false",
                "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
            },
        )
    except SparkUnavailableError as exc:
        pytest.skip(str(exc))
    spark.sparkContext.setLogLevel("ERROR")
    yield spark
    spark.stop()


@pytest.fixture
def scan_starts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Where each recovery scan of an ongoing chunk of variable-size records started."""
    import equeue.chunks.opening as opening_module
    from equeue.chunks.recovery import ScanResult, scan_variable

    starts: list[int] = []

    def spy(*args: Any) -> ScanResult:
        starts.append(args[3] if len(args) > 3 else 0)
        return scan_variable(*args)

    monkeypatch.setattr(opening_module, "scan_variable", spy)
    return starts


@pytest.fixture(scope="module")
def forks() -> Iterator[ForkServer]:
    """Child processes forked from one that imported equeue once (fork_child.py)."""
    server = ForkServer()
    yield server
    server.close()
