"""The smoke run of tools/bench_broker.py (``--quick``): every case's rows are in the report,
every run checked out (what was sent was stored, what was filled was consumed), the Redis
rows are there or a note says why not, and the run's directory is removed. Speed is not
asserted: the smoke counts are tiny and the machine is shared."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("redis", reason="redis-py comes from the bench extra: pip install -e .[bench]")

TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))

from brokerbench.pool import JobError, Pool  # noqa: E402
from brokerbench.profile import part_of, summarize  # noqa: E402

from equeue.protocol import shmrings  # noqa: E402

REDIS = shutil.which("redis-server") is not None
RINGS = shmrings.AVAILABLE
ON_RINGS = "on shared-memory rings (`--shm`, `shm=True`)"
DASH = "\u2013"  # the report's empty cell
PRODUCE = [f"produce {p}p {b}B" for b in (100, 1024) for p in (1, 4, 16)]


@pytest.fixture(scope="module")
def smoke() -> Iterator[dict[str, Any]]:
    base = Path(tempfile.mkdtemp(prefix="eqbb", dir="/tmp"))  # socket paths stay short
    try:
        (base / "scratch").mkdir()
        argv = [sys.executable, str(TOOLS / "bench_broker.py"), "--quick", "--dir"]
        argv += [str(base / "scratch"), "--json", str(base / "runs.json")]
        argv += ["--markdown", str(base / "report.md")]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        found = json.loads((base / "runs.json").read_text())
        yield {
            "runs": found["runs"],
            "meta": found["meta"],
            "report": (base / "report.md").read_text(),
            "scratch": list((base / "scratch").iterdir()),
        }
    finally:
        shutil.rmtree(base, ignore_errors=True)


def runs(smoke: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["case"], r["system"]): r for r in smoke["runs"]}


def expected() -> list[tuple[str, str]]:
    wanted = []
    for case in PRODUCE:
        wanted += [(case, "broker-batch"), (case, "broker-single"), (case, "broker-many")]
        if case.startswith("produce 1p"):
            wanted += [(case, "store-batch"), (case, "store-single")]
        if REDIS:
            wanted.append((case, "redis"))
    for case in ("consume 1c 100B", "consume 4c 100B"):
        wanted += [(case, "broker")] + ([(case, "redis")] if REDIS else [])
    wanted += [("round trip 100B", s) for s in ("broker", "store")]
    wanted += [("round trip 100B", "redis")] if REDIS else []
    for procs in (1, 4):
        case = f"durable 64 tasks in {procs} process(es) 100B"
        for system in ("broker", "broker-shared"):  # a connection per task; one shared client
            wanted.append((case, system))
            wanted += [(case, system.replace("broker", "redis"))] if REDIS else []
        if RINGS:  # the same two on shared-memory rings, on the same broker
            wanted += [(case, "broker-shm"), (case, "broker-shm-shared")]
        # each broker row's ceiling: the same producers, a --flush async broker
        wanted += [(case, "async-" + s) for c, s in wanted if c == case and s.startswith("b")]
        wanted.append((case, "fdatasync"))
    return wanted


def test_every_case_ran_and_checked_out(smoke: dict[str, Any]) -> None:
    found = runs(smoke)
    for key in expected():
        run = found.get(key)
        assert run is not None, key
        assert "error" not in run, (key, run.get("error"))
        assert run["count"] > 0 and run["seconds"] > 0 and run["rate"] > 0, key
        if run["section"] in ("produce", "durable") and run["system"] != "fdatasync":
            assert run["stored"] == run["count"], key  # every acknowledged send is stored
        if run["section"] == "durable" and run["system"].startswith("broker"):
            assert 1 <= run["flushes"] <= run["count"], key
        if run["section"] == "consume":
            assert run["consumed"] == run["count"] >= 2_000, key
        if run["section"] == "latency":
            assert 0 < run["p50_us"] <= run["p99_us"] <= run["max_us"], key
    assert len(smoke["runs"]) == len(expected())


def test_the_report_has_every_row_and_every_target(smoke: dict[str, Any]) -> None:
    report: str = smoke["report"]
    rows = [line for line in report.splitlines() if line.startswith("| ")]
    for body in ("100 B", "1 KiB"):
        for producers in (1, 4, 16):
            row = next(r for r in rows if r.startswith(f"| {body} | {producers} | "))
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert DASH not in cells[2:5], row  # the broker's three
            assert (cells[5] != DASH) == (producers == 1), row  # the store: one process
            assert (cells[7] != DASH) == REDIS, row
    assert any(r.startswith("| 4 | ") for r in rows)  # consume, 4 consumer processes
    assert any(r.startswith("| broker, sync client `send` |") for r in rows)
    for procs in (1, 4):  # every durable row, each reading on its own, with its targets
        readings = ["a connection per task", "one client per process, shared by its tasks"]
        if RINGS:
            readings += [
                f"a connection per task, {ON_RINGS}",
                f"one client per process, shared, {ON_RINGS}",
            ]
        for reading in readings:
            row = f"| 64 asyncio tasks in {procs} process(es) | {reading} |"
            assert sum(r.startswith(row) for r in rows) == 1, row
            where = f"durable 64 tasks in {procs} process(es) 100B, {reading}"
            for target in ("the fdatasync loop", "60,000 msg/s", "ahead of Redis"):
                line = next(t for t in report.splitlines() if where in t and target in t)
                assert "**met**" in line or "**not met**" in line or not REDIS, line
            line = next(t for t in report.splitlines() if where in t and "fdatasync loop" in t)
            shown = "with no fdatasync waited for (`--flush async`) the same sends make"
            assert shown in line, line
            cells = [c.strip() for c in next(r for r in rows if r.startswith(row)).split("|")]
            assert cells[9] != DASH and cells[10] != DASH, row  # the ceiling and its ratio
    for target in (
        "ahead of Redis Streams in every case measured",
        "durable \u2265 10\u00d7 the fdatasync loop",
        "4 producer processes batched",
        "unbatched pipelined asyncio sends",
        "p99 round trip < 1 ms",
    ):
        line = next(line for line in report.splitlines() if target in line)
        assert "**met**" in line or "**not met**" in line or not REDIS, line
    assert "--quick" in report  # the figures are marked as a smoke run's
    if not REDIS:
        assert "redis-server is not installed" in report


def test_the_run_directory_is_removed(smoke: dict[str, Any]) -> None:
    assert smoke["scratch"] == []


def test_a_failed_job_is_reported_and_the_pool_goes_on(tmp_path: Path) -> None:
    pool = Pool(2)
    try:
        with pytest.raises(JobError, match="KeyError"):
            pool.run([{"kind": "fdatasync", "dir": str(tmp_path)}], 5.0)  # no count/body
        job = {"kind": "fdatasync", "dir": str(tmp_path), "body": 100, "count": 5, "cap": 5.0}
        (done,) = pool.run([job], 5.0)
        assert done["count"] == 5 and done["t1"] >= done["t0"]
        assert (tmp_path / "fdatasync.log").stat().st_size == 5 * 104
    finally:
        pool.close()


def test_profile_samples_are_summed_by_part() -> None:
    collapsed = "\n".join(
        [
            "run (asyncio/base_events.py:600);data_received (equeue/server/connection.py:9) 5",
            "data_received (equeue/server/connection.py:9);unpackb (msgpack/_unpacker.so) 3",
            "handle (equeue/server/handlers.py:1);send (equeue/store/store.py:490) 2",
            "garbage line",
        ]
    )
    total, leaf, inclusive = summarize(collapsed)
    assert total == 10
    assert leaf[part_of("equeue/server/connection.py")] == 5
    assert leaf["msgpack"] == 3
    assert leaf[part_of("equeue/store/store.py")] == 2
    assert inclusive[part_of("equeue/server/connection.py")] == 10


@pytest.mark.skipif(not REDIS, reason="redis-server is not installed")
def test_redis_settings_are_asked_of_the_server() -> None:
    from brokerbench.servers import ServerError, check_redis_config, start_redis

    server = start_redis(Path(tempfile.mkdtemp(prefix="eqrd", dir="/tmp")), durable=False)
    try:
        check_redis_config(server, durable=False)  # what it was started with
        with pytest.raises(ServerError, match="appendfsync"):
            check_redis_config(server, durable=True)  # a row claiming more is refused
    finally:
        server.stop()
        shutil.rmtree(server.socket_path.parent, ignore_errors=True)
    assert server.proc.returncode is not None


def test_each_durable_run_starts_after_the_disk_is_synced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from brokerbench import cases

    seen: list[str] = []
    monkeypatch.setattr("brokerbench.cases.os.sync", lambda: seen.append("sync"))
    bench = SimpleNamespace(args=SimpleNamespace(repeat=2), failed=None)
    systems = [(name, lambda r, name=name: seen.append(f"{name}{r}")) for name in ("a", "b")]
    cases.Bench.alternate(bench, "durable", {"case": "d"}, systems)  # type: ignore[arg-type]
    assert seen == ["sync", "a0", "sync", "b0", "sync", "b1", "sync", "a1"]
    seen.clear()
    cases.Bench.alternate(bench, "produce", {"case": "p"}, systems)  # type: ignore[arg-type]
    assert seen == ["a0", "b0", "b1", "a1"]
