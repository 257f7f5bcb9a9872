"""The ``equeue`` command (chunk inspector) on stores built here: healthy, and damaged the
way a crash or a bad disk damages them. Most runs go through ``main(argv)``; a few run
the real entry point in a subprocess (console script, ``python -m equeue``, a live store).
"""

from __future__ import annotations

import datetime as dt
import io
import itertools
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

import pytest
from store_helpers import settle_chunk_maker

from equeue import MessageStore, SendResult, StoreConfig
from equeue.cli import main
from equeue.errors import MessageNotFoundError
from equeue.format.chunk import FOOTER_SIZE, FRAME_OVERHEAD, FRAME_PREFIX, HEADER_SIZE
from equeue.format.message import QUEUE_RECORD_SIZE
from equeue.inspect.render import WIDTH, ProgressBar, human_size, human_time
from equeue.inspect.verify import verify_store

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

CONFIG = StoreConfig(chunk_data_size=4096, queue_chunk_records=400, default_queue_count=2)
ORDERS = 100
BINARY = bytes([0, 1, 2, 200, 255]) * 8


# --- building and damaging stores ------------------------------------------------------


def build_store(path: Path) -> list[SendResult]:
    with MessageStore.open(path, CONFIG) as store:
        results = [
            store.send(
                "orders",
                f"order {i}".encode() * (1 + i % 4),
                tag="created" if i % 2 else "paid",
                key=f"customer-{i % 5}",
                properties={"n": str(i)},
                queue_id=i % 2,
            )
            for i in range(ORDERS)
        ]
        results.append(store.send("audit", BINARY, queue_id=0))
        store.commit_offset("billing", "orders", 0, 10)
    return results


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[SendResult]]:
    path = tmp_path_factory.mktemp("built") / "store"
    return path, build_store(path)


@pytest.fixture
def store(built: tuple[Path, list[SendResult]], tmp_path: Path) -> Path:
    """A fresh copy of the healthy store, free to damage."""
    copy = tmp_path / "store"
    shutil.copytree(built[0], copy)
    return copy


@pytest.fixture
def sent(built: tuple[Path, list[SendResult]]) -> list[SendResult]:
    return built[1]


def message_chunks(store: Path) -> list[Path]:
    return sorted((store / "messages").glob("chunk-*"))


def frame_offsets(path: Path) -> tuple[list[int], int]:
    """File offsets of the frames of a chunk, and the file offset where its data ends."""
    data = path.read_bytes()
    offsets, p = [], HEADER_SIZE
    while p + 4 <= len(data) - FOOTER_SIZE:
        (length,) = FRAME_PREFIX.unpack_from(data, p)
        if length == 0:
            break
        offsets.append(p)
        p += length + FRAME_OVERHEAD
    return offsets, p


def patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x20]))


def snapshot(path: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``path`` with its bytes and mtime, and every directory, once the
    chunk maker has settled."""
    settle_chunk_maker()
    result = {}
    for root, dirs, files in os.walk(path):
        for name in dirs:
            result[os.path.join(root, name)] = (b"<dir>", 0)
        for name in files:
            full = os.path.join(root, name)
            result[full] = (Path(full).read_bytes(), os.stat(full).st_mtime_ns)
    return result


# --- running the command -------------------------------------------------------------


def run(
    capsys: pytest.CaptureFixture[str], *args: str | Path, terminal: bool = False
) -> tuple[int, str, str]:
    """``terminal``: stdout says it is one (sentences are wrapped only for a terminal)."""
    with mock.patch.object(sys.stdout, "isatty", return_value=terminal):
        code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, Any]:
    code, out, _ = run(capsys, *args, "--json")
    return code, json.loads(out)


def run_lines(capsys: pytest.CaptureFixture[str], *args: str | Path) -> list[dict[str, Any]]:
    code, out, _ = run(capsys, "records", *args, "--json")
    assert code == 0
    return [json.loads(line) for line in out.splitlines()]


def subprocess_run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "equeue", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def assert_fits(text: str, path: Path) -> None:
    """Every line fits 80 columns, but for those naming a file under ``path``: a path is
    printed whole (pytest's are long) so that it can be copied."""
    for line in text.splitlines():
        assert len(line) <= WIDTH or str(path) in line, f"{len(line)} columns: {line!r}"


# --- inspect ---------------------------------------------------------------------------


def test_inspect_store_json(
    capsys: pytest.CaptureFixture[str], store: Path, sent: list[SendResult]
) -> None:
    code, doc = run_json(capsys, "inspect", store)
    assert code == 0
    assert doc["store_id"] == int(sent[0].message_id[:8], 16)
    assert doc["chunk_data_size"] == 4096
    assert doc["queue_chunk_records"] == 400
    chunks = doc["message_chunks"]
    assert len(chunks) >= 3
    assert [c["state"] for c in chunks] == ["completed"] * (len(chunks) - 1) + ["ongoing"]
    assert [c["start_number"] for c in chunks] == list(range(len(chunks)))
    assert chunks[1]["start_position"] == 4096 and chunks[1]["end_position"] == 8192
    assert sum(c["records"] for c in chunks) == doc["records"] == ORDERS + 1
    for chunk in chunks:
        assert chunk["file"].endswith(chunk["file"].rsplit("/", 1)[-1])
        assert 0 < chunk["physical_size"] == chunk["logical_size"] <= 4096
        assert chunk["file_size"] == HEADER_SIZE + 4096 + FOOTER_SIZE
        assert chunk["first_stored_ns"] <= chunk["last_stored_ns"]
    assert doc["end_position"] == chunks[-1]["start_position"] + chunks[-1]["physical_size"]
    topics = {t["topic"]: t["queues"] for t in doc["topics"]}
    assert sorted(topics) == ["audit", "orders"]
    assert [(q["queue_id"], q["first_offset"], q["next_offset"]) for q in topics["orders"]] == [
        (0, 0, 50),
        (1, 0, 50),
    ]
    assert topics["orders"][0]["messages"] == 50 and topics["orders"][0]["chunk_count"] == 1
    assert topics["audit"][0]["next_offset"] == 1
    assert doc["groups"] == [
        {
            "group": "billing",
            "topic": "orders",
            "queue_id": 0,
            "committed_offset": 10,
            "next_offset": 50,
            "lag": 40,
        }
    ]
    on_disk = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
    assert doc["apparent_bytes"] == on_disk
    assert doc["allocated_bytes"] > 0
    assert doc["problems"] == []


def test_inspect_store_text_fits_80_columns(
    capsys: pytest.CaptureFixture[str], store: Path
) -> None:
    code, out, _ = run(capsys, "inspect", store)
    assert code == 0
    assert_fits(out, store)
    for expected in ("chunk-000000000000.0000", "completed", "ongoing", "orders/1", "billing"):
        assert expected in out
    assert "KiB" in out and "Z .. " in out  # human sizes and ISO times


def test_inspect_store_notes_damage_and_still_summarises(
    capsys: pytest.CaptureFixture[str], store: Path
) -> None:
    first = message_chunks(store)[0]
    flip(first, 20)
    code, doc = run_json(capsys, "inspect", store)
    assert code == 0
    assert doc["message_chunks"][0]["state"] == "damaged"
    assert doc["message_chunks"][0]["start_position"] is None
    assert [(p["kind"], p["file"], p["offset"]) for p in doc["problems"]] == [
        ("header", str(first), 0)
    ]
    code, out, _ = run(capsys, "inspect", store, terminal=True)
    assert code == 0 and "Problems noticed (1)" in out and "the header is damaged" in out
    assert_fits(out, store)


def test_inspect_completed_chunk_file(capsys: pytest.CaptureFixture[str], store: Path) -> None:
    path = message_chunks(store)[0]
    code, doc = run_json(capsys, "inspect", path)
    assert code == 0
    assert doc["kind"] == "message chunk" and doc["state"] == "completed"
    header = doc["header"]
    assert header["magic"] == "EQCH" and header["version"] == 1
    assert header["chunk_type"] == "variable" and header["timestamp_offset"] == 8
    assert header["chunk_start_number"] == header["chunk_end_number"] == 0
    assert header["chunk_data_size"] == 4096 and not header["compacted"]
    footer = doc["footer"]
    assert footer["completed"] and footer["map_entry_count"] == 0
    assert footer["physical_data_size"] == footer["logical_data_size"] == doc["data_used"]
    assert footer["record_count"] == doc["records"] == len(frame_offsets(path)[0])
    assert footer["first_timestamp_ns"] <= footer["last_timestamp_ns"]
    for name in ("header_checksum", "footer_checksum", "data_checksum"):
        assert doc[name]["ok"], name
    assert doc["data_checksum"]["stored"] == footer["checksum"]
    assert doc["position_map_entries"] == doc["position_map_bytes"] == 0
    assert doc["problems"] == []
    code, out, _ = run(capsys, "inspect", path)
    assert code == 0
    assert_fits(out, store)
    assert "data checksum" in out and "MISMATCH" not in out


def test_inspect_ongoing_and_queue_chunk_files(
    capsys: pytest.CaptureFixture[str], store: Path
) -> None:
    ongoing = message_chunks(store)[-1]
    code, doc = run_json(capsys, "inspect", ongoing)
    assert code == 0
    assert doc["state"] == "ongoing" and doc["footer"] is None and doc["data_checksum"] is None
    offsets, end = frame_offsets(ongoing)
    assert doc["records"] == len(offsets) and doc["data_used"] == end - HEADER_SIZE
    queue = store / "queues" / "orders" / "1" / "chunk-000000000000.0000"
    code, doc = run_json(capsys, "inspect", queue)
    assert doc["kind"] == "queue chunk" and doc["header"]["record_size"] == QUEUE_RECORD_SIZE
    assert doc["header"]["chunk_data_size"] == 400 * QUEUE_RECORD_SIZE
    assert doc["records"] == 50 and doc["first_timestamp_ns"] is None
    code, out, _ = run(capsys, "inspect", queue)
    assert code == 0 and "queue chunk, ongoing" in out
    assert_fits(out, store)


def test_inspect_file_shows_data_checksum_mismatch(
    capsys: pytest.CaptureFixture[str], store: Path
) -> None:
    path = message_chunks(store)[1]
    flip(path, frame_offsets(path)[0][2] + 70)
    code, doc = run_json(capsys, "inspect", path)
    assert code == 0  # inspect shows; verify judges
    assert doc["footer_checksum"]["ok"] and not doc["data_checksum"]["ok"]
    assert [(p["kind"], p["offset"]) for p in doc["problems"]] == [
        ("checksum", path.stat().st_size - FOOTER_SIZE)
    ]
    _, out, _ = run(capsys, "inspect", path)
    assert "MISMATCH" in out


def test_inspect_file_with_damaged_header_shows_its_fields(
    capsys: pytest.CaptureFixture[str], store: Path
) -> None:
    path = message_chunks(store)[0]
    flip(path, 33)  # inside the chunk data size
    code, doc = run_json(capsys, "inspect", path)
    assert code == 0
    assert not doc["header_checksum"]["ok"] and doc["state"] == "damaged"
    assert doc["header"]["chunk_data_size"] != 4096  # shown, unverified
    assert doc["problems"][0]["kind"] == "header" and doc["problems"][0]["offset"] == 0


# --- records ---------------------------------------------------------------------------


def test_records_from_the_log(
    capsys: pytest.CaptureFixture[str], store: Path, sent: list[SendResult]
) -> None:
    records = run_lines(capsys, store)
    assert [r["message_id"] for r in records] == [s.message_id for s in sent]
    first = records[0]
    assert first["position"] == 0 and first["topic"] == "orders" and first["queue_id"] == 0
    assert first["queue_offset"] == 0 and first["tag"] == "paid" and first["key"] == "customer-0"
    assert first["properties"] == {"n": "0"} and first["code"] == 0
    assert first["body"] == "order 0" and first["body_encoding"] == "utf-8"
    assert first["body_size"] == 7
    assert first["stored_ns"] == pytest.approx(sent[0].stored_at * 1e9, abs=1000)
    binary = records[-1]
    assert binary["body_encoding"] == "hex" and bytes.fromhex(binary["body"]) == BINARY
    assert [r["position"] for r in records] == [s.position for s in sent]


def test_records_from_a_queue_offset(capsys: pytest.CaptureFixture[str], store: Path) -> None:
    records = run_lines(capsys, store, "--topic", "orders", "--queue", "1", "--offset", "5")
    assert [(r["queue_id"], r["queue_offset"]) for r in records] == [(1, q) for q in range(5, 50)]
    limited = run_lines(capsys, store, "--topic", "orders", "--queue", "1", "--limit", "2")
    assert [r["queue_offset"] for r in limited] == [0, 1]


def test_records_filters(
    capsys: pytest.CaptureFixture[str], store: Path, sent: list[SendResult]
) -> None:
    keyed = run_lines(capsys, store, "--key", "customer-3")
    assert len(keyed) == ORDERS // 5 and {r["key"] for r in keyed} == {"customer-3"}
    audit = run_lines(capsys, store, "--topic", "audit")
    assert [r["position"] for r in audit] == [sent[-1].position]
    middle = sent[60]
    ns = run_lines(capsys, store, "--from", str(middle.position), "--limit", "1")[0]["stored_ns"]
    since = run_lines(capsys, store, "--since", f"{ns // 10**9}.{ns % 10**9:09d}")  # exact
    assert since[0]["position"] <= middle.position < since[1]["position"]
    assert all(r["stored_ns"] >= ns for r in since) and len(since) >= len(sent) - 60
    iso = dt.datetime.fromtimestamp(sent[-1].stored_at + 1, dt.UTC).isoformat()
    assert run_lines(capsys, store, "--since", iso) == []
    from_position = run_lines(capsys, store, "--from", str(middle.position), "--limit", "3")
    assert [r["position"] for r in from_position] == [s.position for s in sent[60:63]]
    from_id = run_lines(capsys, store, "--from", middle.message_id, "--limit", "1")
    assert from_id[0]["message_id"] == middle.message_id
    inside = run_lines(capsys, store, "--from", hex(middle.position + 1), "--limit", "1")
    assert inside[0]["position"] == sent[61].position  # the next record start
    assert run_lines(capsys, store, "--from", str(10**12)) == []


def test_records_text_fits_80_columns(capsys: pytest.CaptureFixture[str], store: Path) -> None:
    code, out, _ = run(capsys, "records", store)
    assert code == 0
    assert_fits(out, store)
    assert "position 0 (0x0)" in out and "key customer-0" in out and "properties n=0" in out
    assert "body 7 B: order 0" in out
    assert f"hex {BINARY[:4].hex()}" in out  # a binary body is shown as hex


def test_records_on_a_damaged_log_fails_cleanly(
    capsys: pytest.CaptureFixture[str], store: Path
) -> None:
    path = message_chunks(store)[1]
    flip(path, frame_offsets(path)[0][2] + 70)
    code, _, err = run(capsys, "records", store)
    assert code == 1
    assert "record checksum" in err and str(path) in err and "equeue verify" in err


# --- verify ----------------------------------------------------------------------------


def test_verify_healthy_store(capsys: pytest.CaptureFixture[str], store: Path) -> None:
    code, doc = run_json(capsys, "verify", store)
    assert code == 0
    assert doc["clean"] and doc["problems"] == []
    assert doc["records"] == doc["queue_entries"] == ORDERS + 1
    assert doc["message_chunks"] == len(message_chunks(store)) and doc["queue_chunks"] == 3
    code, out, _ = run(capsys, "verify", store, terminal=True)
    assert code == 0 and out.rstrip().endswith("No problems found.")
    assert_fits(out, store)


def test_verify_torn_tail(capsys: pytest.CaptureFixture[str], store: Path) -> None:
    path = message_chunks(store)[-1]
    _, end = frame_offsets(path)
    # A frame cut short by a crash: its length and part of its payload, no suffix.
    patch(path, end, struct.pack("<I", 200) + b"torn" * 10)
    code, doc = run_json(capsys, "verify", store)
    assert code == 1 and not doc["clean"]
    assert [(p["kind"], p["file"], p["offset"]) for p in doc["problems"]] == [
        ("torn tail", str(path), end)
    ]
    assert "recovery would cut" in doc["problems"][0]["reason"]
    code, out, _ = run(capsys, "verify", store, terminal=True)
    assert code == 1
    assert f"{path} at offset {end} (0x{end:x})" in out and "torn tail:" in out
    assert "1 problem found." in out
    assert_fits(out, store)


def test_verify_torn_queue_tail(capsys: pytest.CaptureFixture[str], store: Path) -> None:
    path = store / "queues" / "orders" / "0" / "chunk-000000000000.0000"
    hole = HEADER_SIZE + 50 * QUEUE_RECORD_SIZE  # offset 50: the first empty slot
    patch(path, hole + QUEUE_RECORD_SIZE, b"\x07" * QUEUE_RECORD_SIZE)  # an entry past a hole
    code, doc = run_json(capsys, "verify", store)
    assert code == 1
    assert [(p["kind"], p["file"], p["offset"]) for p in doc["problems"]] == [
        ("torn tail", str(path), hole)
    ]
    assert "after the last queue entry (offset 49)" in doc["problems"][0]["reason"]


def test_verify_flipped_checksum_reports_and_goes_on(
    capsys: pytest.CaptureFixture[str], store: Path
) -> None:
    first, second = message_chunks(store)[:2]
    bad = [frame_offsets(first)[0][3], frame_offsets(second)[0][5]]
    flip(first, bad[0] + 80)
    flip(second, bad[1] + 80)
    code, doc = run_json(capsys, "verify", store)
    assert code == 1
    found = {(p["kind"], p["file"], p["offset"]) for p in doc["problems"]}
    for path, offset in zip((first, second), bad, strict=True):
        assert ("checksum", str(path), offset) in found  # the record
        assert ("checksum", str(path), path.stat().st_size - FOOTER_SIZE) in found  # the footer
    reasons = " ".join(p["reason"] for p in doc["problems"])
    assert "record checksum mismatch" in reasons and "footer data checksum" in reasons
    # The walk went on past each bad record: every record was still visited.
    assert doc["records"] == ORDERS + 1
    # The queue entries that point at the damaged records say so, in their own files.
    entries = [p for p in doc["problems"] if p["kind"] == "queue entry"]
    assert len(entries) == 2 and all("/queues/orders/" in p["file"] for p in entries)


def test_verify_queue_entry_pointing_at_the_wrong_message(
    capsys: pytest.CaptureFixture[str], store: Path
) -> None:
    path = store / "queues" / "orders" / "1" / "chunk-000000000000.0000"
    entry = HEADER_SIZE + 5 * QUEUE_RECORD_SIZE
    with open(path, "rb") as f:
        f.seek(entry + QUEUE_RECORD_SIZE)
        following = f.read(QUEUE_RECORD_SIZE)
    patch(path, entry, following)  # offset 5 now names offset 6's message
    code, doc = run_json(capsys, "verify", store)
    assert code == 1
    assert [(p["kind"], p["file"], p["offset"]) for p in doc["problems"]] == [
        ("queue entry", str(path), entry)
    ]
    assert "orders/1 offset 5" in doc["problems"][0]["reason"]
    assert "orders/1 offset 6" in doc["problems"][0]["reason"]


def compacted_store(store: Path, spark: SparkSession) -> Path:
    """The orders topic compacted (5 keys): the newest order per customer survives; the
    compacted chunk file with the most survivors."""
    from equeue.compaction.job import compact

    with MessageStore.open(store) as opened:
        opened.create_topic("orders", cleanup="compact")
        for i in range(30):  # survivors: keys nothing supersedes
            opened.send("orders", b"kept" * 10, key=f"unique-{i}")
        for _ in range(100):  # then enough to complete their chunk
            opened.send("orders", b"filler" * 10, key="filler")
    report = compact(store, spark=spark)
    assert report.records_removed > 0
    replacements = [p for p in message_chunks(store) if p.name.endswith(".0001")]
    return max(replacements, key=lambda p: p.stat().st_size)  # one with survivors


@pytest.mark.parametrize(
    ("option", "said"),
    [
        (["--conf", "spark.executor.memory"], "--conf 'spark.executor.memory': expected KEY=VALUE"),
        (["--conf", "=4g"], "--conf '=4g': expected KEY=VALUE"),
        (["--py-files", "a.zip"], "--py-files: a.zip is not a file"),
    ],
)
def test_compact_refuses_a_bad_conf_or_py_file_before_starting_spark(
    capsys: pytest.CaptureFixture[str], store: Path, option: list[str], said: str
) -> None:
    before = snapshot(store)
    with mock.patch("equeue.spark.java.require_spark", side_effect=AssertionError("started")):
        code, _, err = run(capsys, "compact", store, *option)
    assert code == 2
    (line,) = err.splitlines()
    assert line.startswith(f"equeue: error: {said}")
    assert snapshot(store) == before


def test_compact_says_in_one_line_that_executors_cannot_import_equeue(
    capsys: pytest.CaptureFixture[str], store: Path, tmp_path: Path, spark: SparkSession
) -> None:
    """The executors' Python has no equeue (this local session's daemon, which forks the
    workers, is equeue's: it is what fails there). One line, exit 1, no traceback, and
    nothing in the store changed but the job's lock files."""
    from spark_cluster_child import without_equeue

    before = snapshot(store)
    context = spark.sparkContext
    python = context.pythonExec
    context.pythonExec = without_equeue(str(tmp_path / "python-without-equeue"))
    try:
        code, out, err = run(capsys, "compact", store, "--now", "2100-01-01T00:00:00Z")
    finally:
        context.pythonExec = python
    assert (code, out) == (1, ""), err
    assert [line for line in err.splitlines() if not line.startswith("[compact] ")] == [
        "equeue: error: executors cannot import equeue (ModuleNotFoundError: No module named "
        "'equeue'): install equeue on the nodes or ship it (equeue compact --ship-equeue, or "
        "ship_equeue(spark) from equeue.spark.preflight)"
    ]
    assert "[compact] pass 1" not in err
    jobs = str(store / "compaction")
    after = snapshot(store)
    assert set(after) - set(before) <= {jobs, f"{jobs}/JOB.lock", f"{jobs}/COMMIT.lock"}
    assert {k: v for k, v in after.items() if not k.startswith(jobs)} == before
    # The control: the same command with the session's own Python compacts.
    code, out, err = run(capsys, "compact", store, "--now", "2100-01-01T00:00:00Z", "--json")
    assert code == 0 and json.loads(out)["chunks_eligible"] > 0
    assert "[compact] preflight: " in err


def test_verify_compacted_chunk(
    capsys: pytest.CaptureFixture[str], store: Path, spark: SparkSession
) -> None:
    path = compacted_store(store, spark)
    code, doc = run_json(capsys, "verify", store)
    assert (code, doc["problems"]) == (0, [])
    code, out, _ = run(capsys, "inspect", path)
    assert code == 0 and "compacted" in out and "Position map" in out
    size = path.stat().st_size
    # the position map sits between the data and the footer: damage its last entry
    flip(path, size - FOOTER_SIZE - 3)
    code, doc = run_json(capsys, "verify", store)
    assert code == 1
    assert str(path) in {p["file"] for p in doc["problems"]}
    # besides the chunk itself, only queue entries the damaged map no longer resolves
    assert {p["kind"] for p in doc["problems"] if p["file"] != str(path)} <= {"queue entry"}


def test_records_on_a_compacted_store(
    capsys: pytest.CaptureFixture[str], store: Path, spark: SparkSession
) -> None:
    """Issue 20 item 17: the log walk gave a compacted chunk's records the map's file
    offset + logical offset as their positions, so every records command failed. Each
    command lists exactly the survivors that pull returns (the uncompacted store: the
    tests above)."""
    from compaction_model import all_messages

    compacted_store(store, spark)
    with MessageStore.open(store, read_only=True) as opened:
        survivors = sorted(all_messages(opened).values(), key=lambda m: m.position)
    everything = run_lines(capsys, store)
    assert [r["position"] for r in everything] == [m.position for m in survivors]
    assert [r["message_id"] for r in everything] == [m.message_id for m in survivors]
    middle = survivors[len(survivors) // 2]
    assert [r["position"] for r in run_lines(capsys, store, "--from", str(middle.position))] == [
        m.position for m in survivors if m.position >= middle.position
    ]
    ns = everything[len(survivors) // 2]["stored_ns"]
    since = run_lines(capsys, store, "--since", f"{ns // 10**9}.{ns % 10**9:09d}")
    assert since and all(r["stored_ns"] >= ns for r in since)
    assert [r["key"] for r in run_lines(capsys, store, "--key", "unique-3")] == ["unique-3"]
    orders = run_lines(capsys, store, "--topic", "orders")
    assert [r["position"] for r in orders] == [m.position for m in survivors if m.topic == "orders"]
    code, _, err = run(capsys, "records", store)
    assert (code, err) == (0, "")


def test_verify_bad_record_before_the_tail_hint_is_not_a_cut(
    capsys: pytest.CaptureFixture[str], store: Path
) -> None:
    """The checkpoint's tail hint covers the whole ongoing chunk of a closed store, so
    recovery does not scan it: verify reports the record, and no cut (issue 20 item 18)."""
    path = message_chunks(store)[-1]
    offsets, _ = frame_offsets(path)
    flip(path, offsets[1] + 70)
    code, doc = run_json(capsys, "verify", store)
    assert code == 1
    record = [p for p in doc["problems"] if p["file"] == str(path)]
    assert [(p["kind"], p["offset"]) for p in record] == [("checksum", offsets[1])]
    assert "recovery keeps the records around it" in record[0]["reason"]
    assert "would cut" not in record[0]["reason"]
    assert doc["records"] == ORDERS + 1  # the frame's extent is known: counted, walked on


def cut_store(tmp_path: Path) -> tuple[Path, Path, list[int], int]:
    """A writer killed (its directory copied while open) after 8 messages past the last
    checkpoint, all in one ongoing chunk: (copy, that chunk, its frames' file offsets,
    the file offset where the checkpoint's tail hint says its records end)."""
    path = tmp_path / "store"
    with MessageStore.open(path, CONFIG) as opened:
        for i in range(8):
            opened.send("orders", f"before {i}".encode() * 3, key=f"k{i}")
    with MessageStore.open(path, CONFIG) as opened:
        for i in range(8):
            opened.send("orders", f"after {i}".encode() * 3, key=f"k{i}")
        copy = Path(shutil.copytree(path, tmp_path / "copy"))
    chunk = message_chunks(copy)[-1]
    offsets, _ = frame_offsets(chunk)
    with MessageStore.open(copy, read_only=True) as opened:
        tail = opened._read_meta("checkpoint.json", {})["log_tail"]
    assert len(offsets) == 16 and tail["records"] == 8
    return copy, chunk, offsets, HEADER_SIZE + tail["data_end"]


@pytest.mark.parametrize("victim", [0, 3, 7, 8, 12, 15])
def test_verify_predicts_the_cuts_recovery_makes(tmp_path: Path, victim: int) -> None:
    """Issue 20 item 18: for damage before the tail hint (records 0-7: recovery does not
    scan them, keeps them, and verify predicts no cut) and after it (8-15: recovery cuts
    from the damage on, and verify says so), what verify predicts is what the open does.
    Damage in the hint's own last record (7) makes recovery refuse the hint."""
    copy, chunk, offsets, hinted = cut_store(tmp_path)
    flip(chunk, offsets[victim] + 30)  # inside the message head: a checksum mismatch
    mine = [p for p in verify_store(copy) if p.file == str(chunk)]
    assert [p.offset for p in mine] == [offsets[victim]]
    predicted = [p.offset for p in mine if "recovery would cut" in p.reason]
    with MessageStore.open(copy, CONFIG) as opened:
        cuts = [c for c in opened.recovery.cuts if c.file == str(chunk)]
        made = [c.offset for c in cuts if c.reason != "footer of a chunk reopened by a cut"]
        if victim < 7:
            with pytest.raises(MessageNotFoundError, match="checksum mismatch"):  # no bad bytes
                opened.read(offsets[victim] - HEADER_SIZE)
            opened.read(offsets[victim + 1] - HEADER_SIZE)  # the records after it stay
        else:
            pulled = sum(len(opened.pull("orders", q, 0, 100).messages) for q in (0, 1))
    assert made == predicted
    if victim < 7:  # before the hint: kept, no cut
        assert offsets[victim] < hinted and predicted == []
    else:  # the hint's last record, or past it: cut from the damage on
        assert predicted == [offsets[victim]]
        assert pulled == victim  # every record before the damaged one


def test_verify_broken_length_resyncs_at_the_next_record(
    capsys: pytest.CaptureFixture[str], store: Path
) -> None:
    path = message_chunks(store)[0]
    offsets, _ = frame_offsets(path)
    flip(path, offsets[4] + 1)  # the length prefix: the frame's extent is unknown
    code, doc = run_json(capsys, "verify", store)
    assert code == 1
    mine = [p for p in doc["problems"] if p["file"] == str(path)]
    assert (mine[0]["kind"], mine[0]["offset"]) == ("record", offsets[4])
    assert f"the next valid record is at position {offsets[5] - HEADER_SIZE}" in mine[0]["reason"]
    assert doc["records"] == ORDERS  # all but the unreadable one


def test_verify_missing_chunk_and_damaged_header(
    capsys: pytest.CaptureFixture[str], store: Path
) -> None:
    chunks = message_chunks(store)
    flip(chunks[0], 20)  # start number field
    chunks[1].unlink()
    code, doc = run_json(capsys, "verify", store)
    assert code == 1
    kinds = {(p["kind"], p["file"]) for p in doc["problems"]}
    assert ("header", str(chunks[0])) in kinds
    assert ("missing chunk", str(store / "messages")) in kinds
    # Entries into the lost chunks: one problem per queue chunk and lost chunk, not per entry.
    entries = [p for p in doc["problems"] if p["kind"] == "queue entry"]
    assert 1 <= len(entries) <= 4
    assert all(" entries) point into message chunk" in p["reason"] for p in entries)


def test_verify_damaged_metadata(capsys: pytest.CaptureFixture[str], store: Path) -> None:
    offsets = store / "offsets.json"
    offsets.write_text(offsets.read_text().replace("10", "11"))
    code, doc = run_json(capsys, "verify", store)
    assert code == 1
    assert [(p["kind"], p["file"], p["offset"]) for p in doc["problems"]] == [
        ("metadata", str(offsets), 0)
    ]


def test_verify_store_progress_reaches_the_total(store: Path) -> None:
    seen: list[tuple[int, int]] = []
    assert verify_store(store, lambda done, total: seen.append((done, total))) == []
    assert seen and seen[-1][0] == seen[-1][1] > 0
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(seen))


# --- read-only, live stores ------------------------------------------------------------


def test_commands_change_nothing(capsys: pytest.CaptureFixture[str], store: Path) -> None:
    path = message_chunks(store)[-1]
    _, end = frame_offsets(path)
    patch(path, end, struct.pack("<I", 200) + b"torn" * 10)  # recovery would cut this
    before = snapshot(store)
    commands: list[list[str | Path]] = [
        ["inspect", store],
        ["inspect", path],
        ["records", store],
        ["records", store, "--topic", "orders", "--queue", "0"],
        ["verify", store],
    ]
    for args in commands:
        for extra in ([], ["--json"]):
            run(capsys, *args, *extra)
    assert snapshot(store) == before


class _Sender(threading.Thread):
    def __init__(self, live: MessageStore) -> None:
        super().__init__(daemon=True)
        self.live = live
        self.stop = threading.Event()
        self.sent = 0

    def run(self) -> None:
        while not self.stop.is_set():
            self.live.send("orders", b"live %d" % self.sent, key=f"k{self.sent % 3}")
            self.sent += 1


@pytest.fixture
def live(store: Path) -> Iterator[MessageStore]:
    with MessageStore.open(store, CONFIG) as opened:
        yield opened


def test_live_store_beside_a_writer(store: Path, live: MessageStore) -> None:
    lock = (store / "LOCK").read_text()
    sender = _Sender(live)
    sender.start()
    try:
        for _ in range(2):
            verified = subprocess_run("verify", store, "--json")
            assert verified.returncode == 0, verified.stdout + verified.stderr
            assert json.loads(verified.stdout)["problems"] == []
        inspected = subprocess_run("inspect", store, "--json")
        assert inspected.returncode == 0, inspected.stderr
        listed = subprocess_run("records", store, "--topic", "orders", "--queue", "1", "--json")
        assert listed.returncode == 0, listed.stderr
        offsets = [json.loads(line)["queue_offset"] for line in listed.stdout.splitlines()]
        assert offsets == list(range(len(offsets))) and len(offsets) >= 50
    finally:
        sender.stop.set()
        sender.join()
    assert sender.sent > 0
    assert (store / "LOCK").read_text() == lock  # the writer still holds it, untouched
    live.send("orders", b"after")  # and it still writes


# --- usage errors and the entry point --------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["inspect", "{tmp}/nothing-here"], "no such file or directory"),
        (["inspect", "{tmp}/plain"], "not a chunk file"),
        (["verify", "{tmp}"], "not an equeue store"),
        (["records", "{tmp}/plain"], "not a store directory"),
        (["verify", "{store}/messages"], "inspect one with 'equeue inspect FILE'"),
        (["records", "{store}", "--offset", "3"], "--offset needs --topic T --queue Q"),
        (["records", "{store}", "--queue", "1"], "--queue needs --topic"),
        (["records", "{store}", "--from", "0", "--topic", "orders", "--queue", "0"], "give one"),
        (["records", "{store}", "--topic", "nope", "--queue", "0"], "no topic 'nope'"),
        (["records", "{store}", "--topic", "orders", "--queue", "7"], "queues 0..1"),
        (["records", "{store}", "--since", "yesterday"], "cannot read time"),
        # One rule with the API (equeue.store.times): a time without a zone is refused.
        (["records", "{store}", "--since", "2024-05-01T12:00:00"], "add Z"),
        (["records", "{store}", "--from", "banana"], "neither a log position"),
        (["records", "{store}", "--from", "00000001" + "0" * 16], "not of this store"),
        (["records", "{store}", "--limit", "-1"], "is negative"),
        (["verify", "{store}", "--bogus"], "unrecognized arguments: --bogus"),
        (["frobnicate"], "invalid choice"),
        ([], "a command is required"),
    ],
)
def test_usage_errors_exit_2_with_one_clear_line(
    capsys: pytest.CaptureFixture[str], store: Path, args: list[str], message: str
) -> None:
    tmp = store.parent
    (tmp / "plain").write_text("not a chunk\n")
    argv = [a.format(tmp=tmp, store=store) for a in args]
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err
    assert out == ""


def test_entry_point_runs_without_tracebacks(store: Path) -> None:
    ok = subprocess_run("verify", store)
    assert ok.returncode == 0 and "No problems found." in ok.stdout
    bad = subprocess_run("inspect", store / "store.json")
    assert bad.returncode == 2 and "not a chunk file" in bad.stderr
    assert "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1
    unknown = subprocess_run("records", store, "--nope")
    assert unknown.returncode == 2 and "Traceback" not in unknown.stderr


def test_console_script_is_installed(store: Path) -> None:
    script = Path(sys.executable).parent / "equeue"
    if not script.exists():
        pytest.skip("the equeue console script is not installed (pip install -e .)")
    result = subprocess.run(
        [str(script), "inspect", store, "--json"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0 and json.loads(result.stdout)["records"] == ORDERS + 1


def test_records_into_a_closed_pipe_stops_quietly(store: Path) -> None:
    reader = subprocess.Popen(
        [sys.executable, "-m", "equeue", "records", str(store)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert reader.stdout is not None and reader.stderr is not None
    reader.stdout.read(10)
    reader.stdout.close()
    reader.wait(timeout=60)
    assert b"Traceback" not in reader.stderr.read()
    reader.stderr.close()


# --- rendering -------------------------------------------------------------------------


def test_human_sizes_and_times() -> None:
    assert human_size(0) == "0 B" and human_size(1023) == "1023 B"
    assert human_size(1536) == "1.5 KiB" and human_size(256 << 20) == "256.0 MiB"
    assert human_time(None) == "-"
    assert human_time(1_714_564_800_000_000_000) == "2024-05-01T12:00:00Z"
    assert human_time(1_714_564_800_123_456_000, precise=True) == "2024-05-01T12:00:00.123456Z"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal() -> None:
    terminal, pipe = _Terminal(), io.StringIO()
    for stream in (terminal, pipe):
        bar = ProgressBar(stream, "verifying")
        bar(5 << 20, 10 << 20)
        bar(10 << 20, 10 << 20)
        bar.close()
    assert pipe.getvalue() == ""
    drawn = terminal.getvalue()
    assert "\rverifying [" in drawn and "100%" in drawn and "10.0 MiB" in drawn
    assert all(len(part) <= WIDTH for part in drawn.split("\r"))


# --- tools/demo.py ----------------------------------------------------------------------


def run_demo(path: Path) -> subprocess.CompletedProcess[str]:
    demo = Path(__file__).parent.parent / "tools" / "demo.py"
    return subprocess.run(
        [sys.executable, str(demo), str(path), "--messages", "2000"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_demo_refuses_to_delete_what_is_not_a_store(tmp_path: Path) -> None:
    """Issue 20 item 20: the demo deleted its path whatever it was. A directory with other
    files, or a file, is refused and left as it was; an absent path, an empty directory
    and a store (the controls) are (re)made."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    lone = tmp_path / "file"
    lone.write_text("keep me too")
    for path in (mine, lone):
        before = snapshot(tmp_path)
        result = run_demo(path)
        assert result.returncode != 0
        assert f"demo: {path}" in result.stderr and "refusing to delete it" in result.stderr
        assert "Traceback" not in result.stderr
        assert snapshot(tmp_path) == before
    absent = tmp_path / "store"
    assert run_demo(absent).returncode == 0
    assert (absent / "store.json").is_file()
    assert run_demo(absent).returncode == 0  # a store is replaced
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_demo(empty).returncode == 0 and (empty / "store.json").is_file()
