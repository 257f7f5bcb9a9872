"""The smoke run of tools/bench_peers.py: every case runs and checks out, the report and the
charts are written. Timings are not asserted (the smoke sizes are tiny and the machine noisy)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

for module in ("persistqueue", "litequeue", "diskcache", "queuelib", "lmdb", "matplotlib"):
    pytest.importorskip(
        module, reason="the peers come from the bench extra: pip install -e .[bench]"
    )

TOOL = Path(__file__).resolve().parent.parent / "tools" / "bench_peers.py"
PEERS = {
    "equeue": "equeue",
    "pq_file": "persistqueue.Queue",
    "pq_sqlite": "persistqueue.SQLiteQueue",
    "litequeue": "litequeue.LiteQueue",
    "diskcache": "diskcache.Deque",
    "queuelib": "queuelib.FifoDiskQueue",
    "sqlite3": "sqlite3 (WAL)",
    "lmdb": "lmdb",
    "ref": "reference: buffered append log",
}
SCENARIOS = ["append-100", "append-1k", "consume-100", "consume-1k", "durable-1", "durable-16"]
CHARTS = ["peers", "peers-append", "peers-consume", "peers-durable", "peers-reopen"]
BEFORE = "# Benchmarks\n\nKept as it is.\n\n<!-- peers:begin (written by the tool) -->\n"
AFTER = "<!-- peers:end -->\n\n## Later\n\nAlso kept.\n"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("bench-peers")
    doc = base / "docs" / "benchmarks.md"
    doc.parent.mkdir()
    doc.write_text(BEFORE + "Not measured yet.\n" + AFTER)
    (base / "scratch").mkdir()
    args = ["--smoke", "--dir", str(base / "scratch"), "--doc", str(doc)]
    args += ["--charts", str(doc.parent), "--json", str(base / "results.json")]
    proc = subprocess.run(
        [sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results: dict[str, Any] = json.loads((base / "results.json").read_text())
    return {
        "results": results,
        "doc": doc,
        "stdout": proc.stdout,
        "scratch": base / "scratch",
    }


def outcomes(smoke: dict[str, Any]) -> dict[tuple[str, str, str], dict[str, Any]]:
    return {(o["scenario"], o["peer"], o["variant"]): o for o in smoke["results"]["outcomes"]}


def test_every_peer_ran_every_scenario_without_errors(smoke: dict[str, Any]) -> None:
    found = outcomes(smoke)
    for scenario in SCENARIOS:
        for peer in PEERS:
            variants = [""]
            if peer == "equeue":
                variants = {
                    "append": ["send", "send_batch"],
                    "consume": ["pull"],
                    "durable": ["send"],
                }[scenario.split("-")[0]]
            for variant in variants:
                outcome = found.get((scenario, peer, variant))
                assert outcome is not None, (scenario, peer, variant)
                assert outcome["errors"] == [], (scenario, peer, outcome["errors"])
                assert len(outcome["results"]) == 1
                result = outcome["results"][0]
                assert result["rate"] > 0 and result["seconds"] > 0
                assert result["rss_mib"] > 0
    for peer in PEERS:
        reopen = found[("reopen", peer, "")]
        assert reopen["errors"] == [] and reopen["results"][0]["seconds"] > 0


def test_appends_and_durable_appends_stored_every_message(smoke: dict[str, Any]) -> None:
    for (scenario, peer, _), outcome in outcomes(smoke).items():
        if scenario.startswith(("append", "durable")):
            assert outcome["results"][0]["stored"] == outcome["count"], (scenario, peer)


def test_consume_read_back_exactly_what_was_appended(smoke: dict[str, Any]) -> None:
    found = outcomes(smoke)
    for (scenario, peer, _), outcome in found.items():
        if not scenario.startswith("consume"):
            continue
        result = outcome["results"][0]
        assert result["read"] == outcome["count"], (scenario, peer)
        assert result["stored"] == outcome["count"], (scenario, peer)
        assert result["mismatches"] == 0, (scenario, peer)
    # The consume case reads the append case's store where their counts agree.
    equeue_append = found[("append-100", "equeue", "send_batch")]["count"]
    assert found[("consume-100", "equeue", "pull")]["count"] == equeue_append


def test_reopen_after_kill_finds_the_first_message(smoke: dict[str, Any]) -> None:
    for (scenario, peer, _), outcome in outcomes(smoke).items():
        if scenario != "reopen":
            continue
        result = outcome["results"][0]
        if peer == "queuelib":
            continue  # it saves its head and tail only in close(): a killed queue is empty
        assert result["first_ok"], peer
        # Written before the kill (and acknowledged): all of it is back.
        assert result["stored"] >= result["written"], peer
        assert result["disk_bytes"] > 0


def test_the_peers_section_is_rewritten_and_nothing_else(smoke: dict[str, Any]) -> None:
    text: str = smoke["doc"].read_text()
    assert text.startswith(BEFORE) and text.endswith(AFTER)
    section = text[len(BEFORE) : -len(AFTER)]
    assert "Not measured yet." not in section
    assert section.strip() in smoke["stdout"]
    tables = section.split("\n### ")[1:]
    headings = [t.splitlines()[0] for t in tables]
    for expected in (
        "Append 100 B",
        "Append 1 KiB",
        "Consume 100 B",
        "Consume 1 KiB",
        "Durable appends",
        "Reopen after SIGKILL",
        "Peak memory",
    ):
        table = next((t for t, h in zip(tables, headings, strict=True) if h.startswith(expected)))
        rows = [line for line in table.splitlines() if line.startswith("| ")]
        for name in PEERS.values():
            wanted = "| **equeue" if name == "equeue" else f"| {name} |"
            assert any(row.startswith(wanted) for row in rows), (expected, name)
    for target in ("ahead of every queue library", "ahead of sqlite3 and lmdb", "16 threads"):
        assert target in section and ("**met**" in section or "**not met**" in section)
    for peer in PEERS.values():
        assert f"- **{peer}**" in section  # its mode is stated


def test_every_chart_is_a_png_linked_from_the_section(smoke: dict[str, Any]) -> None:
    docs: Path = smoke["doc"].parent
    section = smoke["doc"].read_text()
    for name in CHARTS:
        data = (docs / f"{name}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", name
        assert data[12:16] == b"IHDR"
        width, height = struct.unpack(">II", data[16:24])
        assert width > 200 and height > 200, name
        assert data[-8:-4] == b"IEND"
        if name != "peers":  # the overview is for the README
            assert f"]({name}.png)" in section


def test_the_case_directories_are_removed(smoke: dict[str, Any]) -> None:
    assert list(smoke["scratch"].iterdir()) == []
