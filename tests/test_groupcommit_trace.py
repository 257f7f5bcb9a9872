"""The C flusher seen from the system calls (tests/fdatasync_shim.c, LD_PRELOAD, logs every
fdatasync's thread, times, outcome and file): every acknowledged send was answered after an
fdatasync of its own chunk file that began after its append and succeeded, and the C
thread fdatasyncs nothing but the log's chunk files (a flusher syncing another descriptor,
say the directory's, fails this); an fdatasync the C thread sees interrupted (EINTR) is
retried, not reported as a failed write; a topic made by a send or the create_topic op has
its topics.journal record fdatasynced before the log fdatasync that releases the send's
answer begins, once per topic, also a consumer group's retry, dead-letter and delay topics
(docs/durability.md, "The order of a topic's changes")."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
LIMIT_S = 60.0

pytest.importorskip("equeue._speedups", reason="no C accelerator")
pytestmark = pytest.mark.skipif(
    shutil.which("gcc") is None or not sys.platform.startswith("linux"),
    reason="needs the C flusher (Linux) and gcc for the LD_PRELOAD shim",
)


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="eq", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _run(base: Path, mode: str, **env: str) -> tuple[dict[str, Any], list[list[str]]]:
    shim = base / "shim.so"
    subprocess.run(
        ["gcc", "-O2", "-shared", "-fPIC", "-pthread", str(HERE / "fdatasync_shim.c"),
         "-o", str(shim), "-ldl"],
        check=True, timeout=LIMIT_S,
    )  # fmt: skip
    trace = base / "trace.tsv"
    child_env = {**os.environ, "LD_PRELOAD": str(shim), "FDS_TRACE": str(trace), **env}
    done = subprocess.run(
        [sys.executable, str(HERE / "cflush_trace_child.py"), mode, str(base / "s")],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=LIMIT_S,
        check=False,
    )  # fmt: skip  (run() kills the child on a timeout)
    assert done.returncode == 0, done.stderr
    calls = [line.split("\t") for line in trace.read_text().splitlines()] if trace.exists() else []
    return json.loads(done.stdout.splitlines()[-1]), calls


def test_every_acknowledged_send_follows_an_fdatasync_of_its_chunk_after_its_append(
    base: Path,
) -> None:
    report, calls = _run(base, "order")
    assert report["flusher"] == "CSync"
    messages = str((base / "s" / "messages").resolve())
    synced: dict[str, list[tuple[int, int]]] = {}  # path -> (begin, end) of good fdatasyncs
    by_c = 0
    for name, begin, end, error, target in calls:
        if name == "equeue-flush":
            by_c += 1
            # the C thread syncs the log's chunk files and nothing else
            assert os.path.dirname(target) == messages, target
            assert os.path.basename(target).startswith("chunk-"), target
        if error == "0":
            synced.setdefault(target, []).append((int(begin), int(end)))
    sends = report["sends"]
    assert len(sends) == 8 * 40 and all(ok for *_, ok in sends)
    assert len({path for *_, path, _ in sends}) >= 3  # rollovers happened
    covered_by_c = 0
    for appended, answered, path, _ in sends:
        covering = [(b, e) for b, e in synced.get(path, []) if b >= appended and e <= answered]
        assert covering, f"answered at {answered} with no fdatasync of {path} after {appended}"
        covered_by_c += any(
            n == "equeue-flush" and t == path and appended <= int(b) and int(e) <= answered
            for n, b, e, _, t in calls
        )
    assert by_c >= 10 and covered_by_c >= len(sends) // 2  # the C thread did the work


def test_an_interrupted_c_fdatasync_is_retried_not_a_failed_write(base: Path) -> None:
    report, calls = _run(base, "broker", FDS_EINTR_ONCE="1")
    assert report["flusher"] == "CSync"
    interrupted = [c for c in calls if c[0] == "equeue-flush" and c[3] == str(4)]  # EINTR
    assert len(interrupted) == 1  # the shim did interrupt one
    assert report["outcomes"] == ["ok 0", "ok 1", "ok 2"], report["outcomes"]


def test_a_new_topics_record_is_durable_before_its_first_answer(base: Path) -> None:
    """While the C flusher is busy with another client's sends (a send's topic, the
    create_topic op's, a group's retry topic at its join, its dead-letter and delay topics
    at nacks, which are answered once durable): the journal's fdatasync
    ends before the log fdatasync that released the answer began (the append came after
    it), and the journal is fdatasynced once per topic made, by no group commit (the
    order costs nothing per send). Fails with the journal append's fdatasync removed."""
    report, calls = _run(base, "topics")
    assert report["flusher"] == "CSync" and report["answered"] >= 50
    journal = str((base / "s" / "topics.journal").resolve())
    messages = str((base / "s" / "messages").resolve())
    journal_syncs = [(int(b), int(e), rc) for _, b, e, rc, target in calls if target == journal]
    log_syncs = [
        (int(b), int(e))
        for _, b, e, rc, target in calls
        if os.path.dirname(target) == messages and rc == "0"
    ]
    # One record per topic made (tens of group commits ran meanwhile).
    topics = {"t", *(topic for topic, _, _ in report["creations"])}
    assert sorted(topics) == report["topics"]
    assert len(journal_syncs) == len(topics) and all(rc == "0" for *_, rc in journal_syncs)
    assert len(log_syncs) > 3 * len(journal_syncs)
    for topic, sent, answered in report["creations"]:
        made = [end for begin, end, _ in journal_syncs if sent <= begin and end <= answered]
        assert len(made) == 1, (topic, journal_syncs, sent, answered)
        if not topic.startswith("equeue.retry."):  # (made by a join: no append)
            assert any(made[0] <= b and e <= answered for b, e in log_syncs), topic
