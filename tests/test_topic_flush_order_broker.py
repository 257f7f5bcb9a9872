"""The broker's order of a topic's creation, seen from the system calls (tests/fdatasync_shim.c,
LD_PRELOAD, logs every fdatasync with its times and file): a topic made by a send or by
the create_topic op has its topics.journal record fdatasynced before the fdatasync of the
message log that releases the send's answer begins, while the C flusher is busy with
another client's sends; and the journal is fdatasynced once per topic made, never by a
group commit (the order costs nothing per send). tests/topic_order_child.py is the child."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

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
    path = Path(tempfile.mkdtemp(prefix="eq", dir="/tmp"))  # short: a socket path
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_new_topics_record_is_durable_before_its_first_answer(base: Path) -> None:
    shim = base / "shim.so"
    subprocess.run(
        ["gcc", "-O2", "-shared", "-fPIC", "-pthread", str(HERE / "fdatasync_shim.c"),
         "-o", str(shim), "-ldl"],
        check=True, timeout=LIMIT_S,
    )  # fmt: skip
    trace = base / "trace.tsv"
    done = subprocess.run(
        [sys.executable, str(HERE / "topic_order_child.py"), str(base / "s")],
        env={**os.environ, "LD_PRELOAD": str(shim), "FDS_TRACE": str(trace)},
        capture_output=True,
        text=True,
        timeout=LIMIT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["flusher"] == "CSync" and report["answered"] >= 50
    journal = str((base / "s" / "topics.journal").resolve())
    messages = str((base / "s" / "messages").resolve())
    calls = [line.split("\t") for line in trace.read_text().splitlines()]
    journal_syncs = [(int(b), int(e), rc) for _, b, e, rc, target in calls if target == journal]
    log_syncs = [
        (int(b), int(e))
        for _, b, e, rc, target in calls
        if os.path.dirname(target) == messages and rc == "0"
    ]
    # "t", "auto" and "made": one record each, and no other fdatasync of the journal
    # (hundreds of group commits ran meanwhile).
    assert len(journal_syncs) == 3 and all(rc == "0" for *_, rc in journal_syncs), journal_syncs
    assert len(log_syncs) > 3 * len(journal_syncs)
    for topic, sent, answered in report["creations"]:
        made = [end for begin, end, _ in journal_syncs if sent <= begin and end <= answered]
        assert len(made) == 1, (topic, journal_syncs, sent, answered)
        # An fdatasync of the log that began after the record was durable, and ended
        # before the answer: the one that released it (its append came after the record).
        assert any(made[0] <= b and e <= answered for b, e in log_syncs), topic
