"""A damaged topics.journal (its header, or a record with records after it): every open
and the broker refuse it naming the file, the offset, expected and found, and what to do;
``equeue rebuild-topics`` keeps a copy, replays the records that check out and lets the
store open with every topic (equeue/store/topicsrebuild.py; docs/durability.md)."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xxhash
from store_helpers import snapshot

from equeue import MessageStore
from equeue.errors import CorruptionError, StoreLockedError
from equeue.format.topicsjournal import HEADER_SIZE, TOPICS_JOURNAL_FILE, TopicRecord
from equeue.store.topicsfile import JOURNAL_READ_LIMIT
from equeue.store.topicsrebuild import rebuild_topics

ROOT = Path(__file__).parent.parent
ENV = os.environ | {"PYTHONPATH": str(ROOT)}

# A writer killed with topic changes only its journal holds: "idle" has no queue
# directory (no message yet), "kept" a compact policy, "orders" messages.
_KILLED_WRITER = """
import datetime as dt, os, sys
from equeue import MessageStore, StoreConfig
store = MessageStore.open(sys.argv[1], StoreConfig(flush="sync"))
store.create_topic("idle", 3)
store.create_topic("kept", 2, cleanup="compact", retention=dt.timedelta(hours=5))
for i in range(5):
    store.send("orders", b"m%d" % i)
store.create_topic("gone", 1)
store.send("gone", b"a deleted topic's record, in the log until retention")
store.delete_topic("gone")
os.kill(os.getpid(), 9)
"""


def _killed_store(path: Path) -> None:
    run = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(path)], env=ENV)
    assert run.returncode == -signal.SIGKILL
    assert (path / TOPICS_JOURNAL_FILE).stat().st_size > HEADER_SIZE  # records not folded


def _damage(journal: Path, kind: str) -> tuple[int, str]:
    """Damage the header; the offset and the expected-found text the error must give."""
    raw = bytearray(journal.read_bytes())
    if kind == "magic":
        raw[0] ^= 0x10
        found = "found 0x" + bytes(raw[:8]).hex()
    elif kind == "generation":
        raw[12] ^= 0x01
        found = f"found 0x{xxhash.xxh32_intdigest(bytes(raw[:20])):x}"
    elif kind == "checksum":
        raw[21] ^= 0xFF
        found = f"found 0x{xxhash.xxh32_intdigest(bytes(raw[:20])):x}"
    else:
        assert kind == "short"
        raw = raw[:10]
        found = "expected 0x18, found 0xa"
    journal.write_bytes(bytes(raw))
    return 0, found


@pytest.mark.parametrize("kind", ["magic", "generation", "checksum", "short"])
def test_a_damaged_header_is_refused_naming_where_and_what_to_do(tmp_path: Path, kind: str) -> None:
    store = tmp_path / "s"
    _killed_store(store)
    journal = store / TOPICS_JOURNAL_FILE
    offset, found = _damage(journal, kind)
    before = snapshot(store)
    for read_only in (False, True):
        with pytest.raises(CorruptionError) as exc:
            MessageStore.open(store, read_only=read_only)
        assert (exc.value.file, exc.value.offset) == (str(journal), offset)
        text = str(exc.value)
        assert found in text and "expected 0x" in text, text
        assert "equeue rebuild-topics STORE" in text and "no writer running" in text, text
        assert snapshot(store) == before  # refused: nothing changed
    verify = subprocess.run(
        [sys.executable, "-m", "equeue", "verify", str(store)], env=ENV, capture_output=True,
        text=True,
    )  # fmt: skip
    assert verify.returncode == 1 and "rebuild-topics" in verify.stdout, verify.stdout
    # the journal only: gone's record is not named as a record of a queue the store lacks
    # (review 38e E12), as nothing can say the journal did not delete it
    assert "1 problem found" in verify.stdout and "lacks" not in verify.stdout, verify.stdout


def test_rebuild_replays_every_record_and_keeps_a_copy(tmp_path: Path) -> None:
    store = tmp_path / "s"
    _killed_store(store)
    journal = store / TOPICS_JOURNAL_FILE
    _damage(journal, "magic")
    damaged = journal.read_bytes()
    run = subprocess.run(
        [sys.executable, "-m", "equeue", "rebuild-topics", "--json", str(store)], env=ENV,
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["rebuilt"] and "bad magic" in report["damage"]
    assert Path(report["side_file"]).read_bytes() == damaged
    assert Path(report["side_file"]).parent == store / "recovered"
    assert [r["topic"] for r in report["replayed"]] == ["idle", "kept", "orders", "gone", "gone"]
    assert report["skipped"] == [] and report["records_from"] == HEADER_SIZE
    with MessageStore.open(store) as opened:
        assert opened.topics() == ["idle", "kept", "orders"]  # "gone" stays deleted
        assert len(opened.queue_ids("idle")) == 3  # no queue directory: only records knew it
        policy = opened.topic_policy("kept")
        assert (policy.cleanup, policy.retention) == ("compact", dt.timedelta(hours=5))
        bodies = [m.body for q in opened.queue_ids("orders") for m in opened.pull("orders", q, 0)]
        assert sorted(bodies) == [b"m%d" % i for i in range(5)]
        assert opened.recovery.problems == []
    verify = subprocess.run([sys.executable, "-m", "equeue", "verify", str(store)], env=ENV)
    assert verify.returncode == 0
    again = rebuild_topics(store)  # sound now: left as it is
    assert again.damage is None and sorted(os.listdir(store / "recovered")) == [
        Path(report["side_file"]).name
    ]


def test_rebuild_steps_over_a_damaged_record_and_reports_it(tmp_path: Path) -> None:
    store = tmp_path / "s"
    _killed_store(store)
    journal = store / TOPICS_JOURNAL_FILE
    raw = bytearray(journal.read_bytes())
    second = HEADER_SIZE + len(TopicRecord("idle", 3).pack())  # "kept"'s record
    raw[second + 41] ^= 0x01  # its name: the checksum fails, records follow (not torn)
    journal.write_bytes(bytes(raw))
    with pytest.raises(CorruptionError, match="rebuild-topics") as exc:
        MessageStore.open(store)
    assert exc.value.offset == second
    report = rebuild_topics(store)
    assert [(s.offset, s.reason) for s in report.skipped] == [(second, "no record")]
    assert report.skipped[0].length == len(TopicRecord("kept", 2).pack())
    with MessageStore.open(store) as opened:
        # "kept" is lost with its record; told, not silent: the report names its bytes.
        assert opened.topics() == ["idle", "orders"]


def test_a_version_1_journal_whose_version_is_damaged_is_read_from_16(tmp_path: Path) -> None:
    store = tmp_path / "s"
    MessageStore.open(store).close()
    head = b"EQTOPJ01" + struct.pack("<I", 1)
    v1 = head + struct.pack("<I", xxhash.xxh32_intdigest(head))
    journal = store / TOPICS_JOURNAL_FILE
    journal.write_bytes(b"EQTOPJ01\x07" + v1[9:] + TopicRecord("old", 2).pack())
    report = rebuild_topics(store)
    assert report.records_from == 16 and [r.topic for r in report.replayed] == ["old"]
    with MessageStore.open(store) as opened:
        assert opened.topics() == ["old"]


def test_rebuild_is_refused_while_a_writer_runs(tmp_path: Path) -> None:
    store = tmp_path / "s"
    with MessageStore.open(store) as writer:
        writer.create_topic("t")
        before = snapshot(store)
        with pytest.raises(StoreLockedError):
            rebuild_topics(store)
        assert snapshot(store) == before


def test_the_broker_refuses_with_the_remedy_then_serves_after_a_rebuild(tmp_path: Path) -> None:
    import equeue

    store = tmp_path / "s"
    _killed_store(store)
    _damage(store / TOPICS_JOURNAL_FILE, "checksum")
    serve = [sys.executable, "-m", "equeue", "serve", str(store), "--quiet"]
    refused = subprocess.run(serve, env=ENV, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1
    assert str(store / TOPICS_JOURNAL_FILE) in refused.stderr
    assert "equeue rebuild-topics STORE" in refused.stderr, refused.stderr
    rebuild = subprocess.run(
        [sys.executable, "-m", "equeue", "rebuild-topics", str(store)], env=ENV,
        capture_output=True, text=True,
    )  # fmt: skip
    assert rebuild.returncode == 0 and "5 replayed" in rebuild.stdout, rebuild.stdout
    broker = subprocess.Popen(serve, env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert broker.stdout is not None
        assert broker.stdout.readline().startswith("listening on")
        with equeue.connect(str(store)) as client:
            assert client.topics() == ["idle", "kept", "orders"]
    finally:
        broker.send_signal(signal.SIGTERM)
        broker.wait(timeout=30)
    assert broker.returncode == 0
    deadline = time.monotonic() + 5
    while (store / "broker.sock").exists() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_journal_past_the_size_a_writer_leaves_is_copied_whole_and_its_rest_reported(
    tmp_path: Path,
) -> None:
    store = tmp_path / "s"
    MessageStore.open(store).close()
    journal = store / TOPICS_JOURNAL_FILE
    with journal.open("ab") as f:
        f.write(TopicRecord("big", 2).pack())
    os.truncate(journal, JOURNAL_READ_LIMIT + 10)  # (sparse zeros)
    with pytest.raises(CorruptionError, match="rebuild-topics"):
        MessageStore.open(store)
    report = rebuild_topics(store)
    assert [r.topic for r in report.replayed] == ["big"]
    assert (report.skipped[-1].offset, report.skipped[-1].length) == (JOURNAL_READ_LIMIT, 10)
    assert report.skipped[-2].reason == "zeros"
    assert report.side_file is not None
    assert os.path.getsize(report.side_file) == JOURNAL_READ_LIMIT + 10
    with MessageStore.open(store) as opened:
        assert opened.topics() == ["big"]


def test_a_damaged_topics_json_beside_it_is_named_with_its_own_remedy(tmp_path: Path) -> None:
    store = tmp_path / "s"
    _killed_store(store)
    _damage(store / TOPICS_JOURNAL_FILE, "magic")
    topics_json = store / "topics.json"
    topics_json.write_bytes(b'{"body": {}, "xxh64": "0"}')  # (the killed writer wrote none)
    before = snapshot(store)
    with pytest.raises(CorruptionError, match=r"move topics\.json out of the store") as exc:
        rebuild_topics(store)
    assert exc.value.file == str(topics_json)
    assert snapshot(store) == before
    topics_json.rename(tmp_path / "topics.json.aside")
    report = rebuild_topics(store)
    assert len(report.replayed) == 5
    with MessageStore.open(store) as opened:
        assert opened.topics() == ["idle", "kept", "orders"]
        assert opened.topic_policy("kept").cleanup == "compact"


def test_a_record_create_topic_would_refuse_is_named_and_left_out(tmp_path: Path) -> None:
    store = tmp_path / "s"
    _killed_store(store)
    journal = store / TOPICS_JOURNAL_FILE
    hostile = journal.stat().st_size
    with journal.open("ab") as f:  # a whole, checksummed record naming a path
        f.write(TopicRecord("../x", 1).pack() + TopicRecord("later", 2).pack())
    with pytest.raises(CorruptionError, match="rebuild-topics") as exc:
        MessageStore.open(store)
    assert exc.value.offset == hostile
    report = rebuild_topics(store)
    assert [(s.offset, s.length) for s in report.skipped] == [
        (hostile, len(TopicRecord("../x", 1).pack()))
    ]
    assert report.replayed[-1].topic == "later"
    with MessageStore.open(store) as opened:
        assert opened.topics() == ["idle", "kept", "later", "orders"]


def test_a_stale_journal_with_a_damaged_record_neither_refuses_nor_reverts(
    tmp_path: Path,
) -> None:
    """Review 37-2 F2: a journal topics.json already holds (an older generation: a fold
    cut between its two writes) with a damaged record in the middle made every open refuse,
    and rebuild-topics then replayed its older records over topics.json: a deleted topic
    came back and a grown topic lost its third queue (its message unreachable). A stale
    journal's records are never replayed, so they are not read either."""
    path = tmp_path / "s"
    with MessageStore.open(path) as store:
        store.create_topic("keep", 1)
    with MessageStore.open(path) as store:
        store.create_topic("gone", 1)
        store.create_topic("x" * 40, 1)
        store.create_topic("y", 2)
        older = (path / TOPICS_JOURNAL_FILE).read_bytes()  # the records the fold takes in
        store.delete_topic("gone")
        store.create_topic("y", 3)
        store.send("y", b"in queue 2", queue_id=2)
    raw = bytearray(older)  # put back as a cut fold leaves it, one record damaged
    raw[raw.find(b"x" * 40) + 5] ^= 0xFF
    (path / TOPICS_JOURNAL_FILE).write_bytes(bytes(raw))
    for read_only in (True, False):
        with MessageStore.open(path, read_only=read_only) as store:
            assert "gone" in store.deleted_topics() and "gone" not in store.topics()
            assert store.queue_ids("y") == [0, 1, 2]
            assert [m.body for m in store.pull("y", 2, 0).messages] == [b"in queue 2"]
