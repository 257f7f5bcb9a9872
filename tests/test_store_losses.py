"""Issue 20 items 8 and 9: losses from outside are reported (by the open and by
``equeue verify``), told apart from retention, and derived data (topics.json, the key
index) is rebuilt, each with a control that reports nothing."""

from __future__ import annotations

import contextlib
import datetime as dt
import io
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from store_helpers import Sent, send

from equeue import MessageStore, StoreConfig
from equeue.cli import main
from equeue.errors import CorruptionError
from equeue.store.meta import KEYS_FILE, MESSAGES_DIR, OFFSETS_FILE, QUEUES_DIR, TOPICS_FILE

CONFIG = StoreConfig(
    chunk_data_size=4096, queue_chunk_records=342, default_queue_count=2, flush="os"
)


def build(path: Path, config: StoreConfig = CONFIG) -> list[Sent]:
    sent: list[Sent] = []
    with MessageStore.open(path, config) as store:
        store.create_topic("t", 2, cleanup="compact", retention=dt.timedelta(days=3))
        store.create_topic("u", 1)
        for i in range(400):
            sent.append(send(store, "u", b"u%04d" % i))
            if i % 3 == 0:
                sent.append(send(store, "t", b"t%04d" % i, key=f"k{i % 7}"))
        store.commit_offset("g", "u", 0, 5)
    return sent


def verify(path: Path) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main(["verify", str(path)])
    return code, out.getvalue()


def chunks(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.name.startswith("chunk-"))


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    build(path)
    return path


def test_control_reports_nothing(store_path: Path) -> None:
    assert verify(store_path)[0] == 0
    for read_only in (False, True):
        with MessageStore.open(store_path, read_only=read_only) as store:
            assert store.recovery.problems == []
            assert store.topic_policy("t").compact


# --- item 8: losses nobody reported ----------------------------------------------------


def _check_reported(path: Path, *words: str) -> None:
    """verify exits 1 naming it; the first open reports it, the next one does not (the
    writer's checkpoint records the store as it now is)."""
    code, output = verify(path)
    assert code == 1, output
    for word in words:
        assert word in output, output
    with MessageStore.open(path, read_only=True) as store:
        assert any(all(w in p for w in words) for p in store.recovery.problems), (
            store.recovery.problems
        )
    with MessageStore.open(path) as store:
        assert any(all(w in p for w in words) for p in store.recovery.problems), (
            store.recovery.problems
        )
    with MessageStore.open(path) as store:
        assert not any(all(w in p for w in words) for p in store.recovery.problems)


def test_deleted_first_message_chunk_is_reported(store_path: Path) -> None:
    first = chunks(store_path / MESSAGES_DIR)[0]
    first.unlink()
    _check_reported(store_path, "starts at position 4096", "0..4095")


def test_deleted_first_queue_chunk_is_reported(store_path: Path) -> None:
    chunks(store_path / QUEUES_DIR / "u" / "0")[0].unlink()
    _check_reported(store_path, "u/0", "starts at offset 342", "0..341")


def test_deleted_offsets_are_reported(store_path: Path) -> None:
    (store_path / OFFSETS_FILE).unlink()
    _check_reported(store_path, OFFSETS_FILE, "committed")


def test_deleted_topics_are_rebuilt_from_the_queue_directories(store_path: Path) -> None:
    (store_path / TOPICS_FILE).unlink()
    code, output = verify(store_path)
    assert code == 1 and "'t'" in output and "'u'" in output, output
    with MessageStore.open(store_path, read_only=True) as store:  # it changes nothing
        assert store.topics() == ["t", "u"]
        assert any("policies are lost" in p for p in store.recovery.problems)
    assert not (store_path / TOPICS_FILE).exists()
    with MessageStore.open(store_path) as store:
        assert store.topics() == ["t", "u"] and store.queue_ids("t") == [0, 1]
        (problem,) = [p for p in store.recovery.problems if TOPICS_FILE in p]
        assert "t: 2 queues" in problem and "policies are lost" in problem
        assert not store.topic_policy("t").compact  # lost with the file, and said so
        assert len(store.pull("u", 0, 0, 1000).messages) == 400
    assert verify(store_path)[0] == 0


def test_damaged_topics_are_rebuilt_and_bad_names_skipped(store_path: Path) -> None:
    raw = bytearray((store_path / TOPICS_FILE).read_bytes())
    raw[len(raw) // 2] ^= 1
    (store_path / TOPICS_FILE).write_bytes(bytes(raw))
    bad = store_path / QUEUES_DIR / "bad topic!" / "0"
    bad.mkdir(parents=True)
    shutil.copy(chunks(store_path / QUEUES_DIR / "t" / "0")[0], bad)
    with MessageStore.open(store_path) as store:
        assert store.topics() == ["t", "u"]
        assert any("bad topic!" in p and "skipped" in p for p in store.recovery.problems)
        assert list((store_path / "recovered").glob("topics.json.*.damaged"))


def test_topic_missing_from_topics_json_is_reported(store_path: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    with MessageStore.open(other, CONFIG) as store:
        store.create_topic("t", 2, cleanup="compact", retention=dt.timedelta(days=3))
    shutil.copy(other / TOPICS_FILE, store_path / TOPICS_FILE)  # valid, but without "u"
    code, output = verify(store_path)
    assert code == 1 and "'u'" in output, output
    with MessageStore.open(store_path) as store:
        assert store.topics() == ["t", "u"] and store.topic_policy("t").compact
        assert len(store.pull("u", 0, 0, 1000).messages) == 400


def test_retention_is_not_a_loss(tmp_path: Path) -> None:
    """The control of the deletions above: retention removes the same chunks."""
    path = tmp_path / "store"
    config = StoreConfig(
        chunk_data_size=4096,
        queue_chunk_records=342,
        default_queue_count=2,
        flush="os",
        retention=dt.timedelta(seconds=1),
    )
    build(path, config)
    with MessageStore.open(path, config) as store:
        assert store.apply_retention(now=time.time() + 3600) > 0
        assert store.queue_range("u", 0)[0] > 0
    assert verify(path)[0] == 0
    with MessageStore.open(path, config) as store:
        assert store.recovery.problems == []


_KILLED_RETENTION = """
import os, signal, sys, time
from equeue import MessageStore, StoreConfig
from equeue.chunks.manager import ChunkManager
import datetime as dt

def remove_one_and_die(self, number):
    # The first chunk file goes, then the process dies mid-way through retention.
    first = sorted(p for p in self.directory.iterdir() if p.name.startswith("chunk-"))[0]
    first.unlink()
    os.kill(os.getpid(), signal.SIGKILL)

ChunkManager.remove_chunks_before = remove_one_and_die
config = StoreConfig(chunk_data_size=4096, queue_chunk_records=342, default_queue_count=2,
                     flush="os", retention=dt.timedelta(seconds=1))
store = MessageStore.open(sys.argv[1], config)
store.apply_retention(now=time.time() + 3600)
"""


def test_retention_killed_mid_deletion_is_not_a_loss(tmp_path: Path) -> None:
    path = tmp_path / "store"
    build(path)
    first = chunks(path / MESSAGES_DIR)[0]
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_KILLED_RETENTION), str(path)],
        capture_output=True,
        env=os.environ.copy(),
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr.decode()
    assert not first.exists()
    code, output = verify(path)
    assert code == 0, output
    with MessageStore.open(path) as store:
        assert store.recovery.problems == []


# --- item 9: the key index ---------------------------------------------------------------


def _zero(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes(512))


@pytest.mark.parametrize("offset", [0, 4096], ids=["header", "second page"])
def test_damaged_key_index_is_rebuilt_from_the_log(store_path: Path, offset: int) -> None:
    keys = store_path / KEYS_FILE
    with MessageStore.open(store_path) as store:
        expected = [m.message_id for m in store.query_by_key("t", "k3")]
    assert len(expected) == 19
    _zero(keys, offset)
    code, output = verify(store_path)
    assert code == 1 and KEYS_FILE in output, output
    with MessageStore.open(store_path, read_only=True) as store:
        assert len(store.pull("u", 0, 0, 1000).messages) == 400  # answers without it
        # A read-only handle reads the log past what SQLite says is indexed: a damaged
        # page it cannot read either raises naming the file or is answered from the log.
        try:
            found = [m.message_id for m in store.query_by_key("t", "k3")]
        except CorruptionError as exc:
            assert KEYS_FILE in str(exc)
        else:
            assert found == expected
    with MessageStore.open(store_path) as store:
        (problem,) = [p for p in store.recovery.problems if KEYS_FILE in p]
        assert "re-indexed from the log" in problem
        assert [m.message_id for m in store.query_by_key("t", "k3")] == expected
    assert list((store_path / "recovered").glob("keys.sqlite.*.damaged"))
    assert verify(store_path)[0] == 0
    with MessageStore.open(store_path, read_only=True) as store:
        assert [m.message_id for m in store.query_by_key("t", "k3")] == expected


def test_deleted_key_index_is_reported_and_rebuilt(store_path: Path) -> None:
    (store_path / KEYS_FILE).unlink()
    code, output = verify(store_path)
    assert code == 1 and KEYS_FILE in output, output
    with MessageStore.open(store_path) as store:
        assert any(KEYS_FILE in p for p in store.recovery.problems)
        assert len(store.query_by_key("t", "k3")) == 19


def test_store_summary_notes_the_deletion(store_path: Path) -> None:
    from equeue.inspect.summary import summarize_store

    assert summarize_store(store_path).problems == []
    chunks(store_path / MESSAGES_DIR)[0].unlink()
    (problem,) = summarize_store(store_path).problems
    assert problem.kind == "missing chunk" and "0..4095" in problem.reason


def test_deleted_queue_chunk_is_found_from_the_log_without_a_checkpoint(
    store_path: Path,
) -> None:
    """No trace left: the log still holds the messages whose entries are gone."""
    (store_path / "checkpoint.json").unlink()
    code, output = verify(store_path)
    assert code == 1 and "u/0" not in output, output  # only the checkpoint is missing
    chunks(store_path / QUEUES_DIR / "u" / "0")[0].unlink()
    code, output = verify(store_path)
    assert code == 1 and "queue u/0 at offsets 0..341" in output, output
