"""A topics.journal left by a crash, then a topics.json rewritten by an equeue without the
journal (a rollback of the deploy), then this version again (review i F1): the journal's
records are older than the file, and replaying them would undo that version's changes (a
deleted topic back with its messages, added queues hidden). A journal of generation 1 or
more beside a topics.json without a generation whose last record of a topic would undo the
file is refused, naming both files, by every reader, and nothing is changed; its other
records are replayed (review4 R1); this version never writes such a pair itself.

The older version is played by what it writes: ``write_json`` of its view of the topics
(no generation), as every equeue before the journal wrote topics.json."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from store_helpers import snapshot

from equeue import MessageStore, StoreConfig
from equeue.atomicfile import read_json, write_json
from equeue.cli import main
from equeue.errors import CorruptionError
from equeue.format.topicsjournal import HEADER_SIZE, TOPICS_JOURNAL_FILE
from equeue.store import topicsfile
from equeue.store.meta import TOPICS_FILE

CONFIG = StoreConfig(flush="os", chunk_data_size=1 << 20, queue_chunk_records=1024)
ROOT = Path(__file__).resolve().parent.parent

# A writer that journals topic x (2 queues, compact), sends 20 keyed messages, and is
# SIGKILLed before any fold: x is in topics.journal only.
_CRASH = """
import os, signal, sys
from equeue import MessageStore, StoreConfig
config = StoreConfig(flush="os", chunk_data_size=1 << 20, queue_chunk_records=1024)
store = MessageStore.open(sys.argv[1], config)
if sys.argv[2] == "keep":
    store.create_topic("keep", 1)
    store.send("keep", b"k0")
store.create_topic("x", 2, cleanup="compact")
for i in range(20):
    store.send("x", b"secret-%d" % i, key="k%d" % (i % 5))
store.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


def _crash(path: Path, first: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", _CRASH, str(path), first], env=env, timeout=120, check=False
    )
    assert done.returncode == -signal.SIGKILL


def _old_version_rewrites(path: Path, change: str) -> None:
    """What an equeue before the journal leaves after its open (x rebuilt from its queue
    directories, default policy) and ``delete_topic("x")`` or ``create_topic("x", 4)``."""
    file = path / TOPICS_FILE
    body = read_json(file) if file.exists() else {}
    default = {"cleanup": "delete", "retention_seconds": None, "delete_retention_seconds": 86400.0}
    for topic in os.listdir(path / "queues"):  # its open's rebuild, with default policies
        count = len(os.listdir(path / "queues" / topic))
        body.setdefault(topic, {"queue_count": count, **default})
    if change == "delete":
        body["x"] = {"deleted_before": 1 << 20}
        shutil.rmtree(path / "queues" / "x")
    else:
        body["x"] = {"queue_count": 4, **default}
    write_json(file, body)


def _verify(path: Path) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["verify", str(path)])
    return code, out.getvalue()


@pytest.mark.parametrize("change", ["delete", "grow"])
@pytest.mark.parametrize("first", ["keep", "new store"])
def test_a_journal_older_than_an_old_versions_topics_json_is_refused(
    tmp_path: Path, change: str, first: str
) -> None:
    """Seen failing before the fix: both opens replayed the journal (x back with 2
    queues and its deleted messages; "new store": a journal of generation 0)."""
    if first == "keep":
        with MessageStore.open(tmp_path, CONFIG) as store:
            store.create_topic("keep", 1)
            store.send("keep", b"k0")
    _crash(tmp_path, "" if first == "keep" else "keep")
    journal = tmp_path / TOPICS_JOURNAL_FILE
    assert journal.stat().st_size > HEADER_SIZE  # x is in the journal only
    _old_version_rewrites(tmp_path, change)
    before = snapshot(tmp_path)
    for read_only in (True, False):
        with pytest.raises(CorruptionError) as raised:
            MessageStore.open(tmp_path, CONFIG, read_only=read_only).close()
        message = str(raised.value)
        assert raised.value.file == str(tmp_path / TOPICS_FILE)
        assert str(journal) in message and "'x'" in message and "move" in message
        assert snapshot(tmp_path) == before
    with pytest.raises(CorruptionError):  # a consumer's commit reads it so
        topicsfile.read_topics_body(tmp_path)
    code, out = _verify(tmp_path)
    assert code == 1 and "topics.json has no generation" in out
    # rebuild-topics (the remedy of a damaged journal) would replay it: it refuses too.
    out_err = io.StringIO()
    with contextlib.redirect_stdout(out_err), contextlib.redirect_stderr(out_err):
        assert main(["rebuild-topics", str(tmp_path)]) != 0
    assert "topics.json has no generation" in out_err.getvalue()
    assert snapshot(tmp_path) == before
    # The remedy: the journal moved out; the old version's topics are read, as it left them.
    journal.rename(tmp_path.parent / "kept.journal")
    with MessageStore.open(tmp_path, CONFIG) as store:
        assert "keep" in store.topics() and not store.recovery.problems
        if change == "delete":
            assert "x" not in store.topics() and "x" in store.deleted_topics()
        else:
            assert store.queue_ids("x") == [0, 1, 2, 3]
            assert store.topic_policy("x").cleanup == "delete"


def test_control_a_crash_without_a_downgrade_replays_the_journal(tmp_path: Path) -> None:
    _crash(tmp_path, "keep")
    for read_only in (True, False):
        with MessageStore.open(tmp_path, CONFIG, read_only=read_only) as store:
            assert store.topics() == ["keep", "x"] and not store.recovery.problems
            assert store.topic_policy("x").cleanup == "compact"


def test_an_old_versions_topics_json_gets_a_generation_before_any_record(
    tmp_path: Path,
) -> None:
    """A store an equeue before the journal wrote (topics.json without a generation, no
    journal): the first topic change folds (topics.json at a generation) instead of
    appending, so that a record never lies beside a file without one; a crash after it
    is replayed. Seen failing before the fix: the change was appended beside the file."""
    with MessageStore.open(tmp_path, CONFIG) as store:
        store.create_topic("old", 1)
    body = read_json(tmp_path / TOPICS_FILE)
    write_json(tmp_path / TOPICS_FILE, body)  # as the older version wrote it
    (tmp_path / TOPICS_JOURNAL_FILE).unlink()
    _crash(tmp_path, "")
    assert topicsfile.file_generation(tmp_path / TOPICS_FILE) >= 1
    assert b'"x"' in (tmp_path / TOPICS_FILE).read_bytes()  # folded, not journaled
    with MessageStore.open(tmp_path, CONFIG) as store:
        assert store.topics() == ["old", "x"] and not store.recovery.problems


def test_topics_rebuilt_from_queue_directories_are_written_at_a_generation(
    tmp_path: Path,
) -> None:
    """topics.json lost: the writable open rebuilds it from the queue directories and
    writes it at a generation (it wrote write_json's head, an older version's, before the
    fix: seen failing), so that a change journaled after it is replayed, not refused."""
    with MessageStore.open(tmp_path, CONFIG) as store:
        store.create_topic("a", 2)
        store.send("a", b"m", queue_id=1)
    (tmp_path / TOPICS_FILE).unlink()
    with MessageStore.open(tmp_path, CONFIG) as store:
        assert store.topics() == ["a"] and store.recovery.problems
        assert topicsfile.file_generation(tmp_path / TOPICS_FILE) >= 1
        store.create_topic("b", 1)
        store._topics_file.close_fd()  # (no fold at the close: "b" in the journal only)
    assert json.loads((tmp_path / TOPICS_FILE).read_bytes())["generation"] >= 1
    with MessageStore.open(tmp_path, CONFIG) as store:
        assert store.topics() == ["a", "b"] and not store.recovery.problems


@pytest.mark.parametrize("file_has_x", [False, True])
def test_a_journal_beside_a_topics_json_it_does_not_undo_is_replayed(
    tmp_path: Path, file_has_x: bool
) -> None:
    """review4 R1: the equeue before this fix left the pair itself. Its recovery rebuilt a
    lost topics.json from the queue directories without a generation, then journaled
    the next topic change (x), then crashed. Replaying x undoes nothing topics.json says
    (it lacks x, or agrees on its queues): the store opens with x and its policy, as it
    did before. Seen failing with the refusal of every such pair (CorruptionError)."""
    with MessageStore.open(tmp_path, CONFIG) as store:
        store.create_topic("keep", 1)
        store.send("keep", b"k0")
    _crash(tmp_path, "")
    journal = tmp_path / TOPICS_JOURNAL_FILE
    assert journal.stat().st_size > HEADER_SIZE  # x is in the journal only
    default = {"cleanup": "delete", "retention_seconds": None, "delete_retention_seconds": 86400.0}
    body: dict[str, object] = {"keep": {"queue_count": 1, **default}}
    if file_has_x:  # rebuilt after x's directories were made: the same queues
        body["x"] = {"queue_count": 2, **default}
    write_json(tmp_path / TOPICS_FILE, body)  # as that recovery wrote it: no generation
    for read_only in (True, False):
        with MessageStore.open(tmp_path, CONFIG, read_only=read_only) as store:
            assert store.topics() == ["keep", "x"]
            assert store.queue_ids("x") == [0, 1]
            assert store.topic_policy("x").cleanup == "compact"  # the journal's, kept
            assert len(store.query_by_key("x", "k1")) == 4
    code, out = _verify(tmp_path)
    assert code == 0, out


_GROW = """
import os, signal, sys
from equeue import MessageStore, StoreConfig
config = StoreConfig(flush="os", chunk_data_size=1 << 20, queue_chunk_records=1024)
store = MessageStore.open(sys.argv[1], config)
store.create_topic("x", 2, cleanup="compact")
store.send("x", b"v", key="k")
store.create_topic("x", 4, cleanup="compact")  # a second record of x: 4 queues
store.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_only_a_topics_last_record_is_held_against_the_file(tmp_path: Path) -> None:
    """x created with 2 queues, then grown to 4, journaled, beside a topics.json without a
    generation that has x with 4 (rebuilt from its queue directories): the first record
    alone would hide queues, but the last one, which the replay ends with, agrees."""
    with MessageStore.open(tmp_path, CONFIG) as store:
        store.create_topic("keep", 1)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", _GROW, str(tmp_path)], env=env, timeout=120)
    assert done.returncode == -signal.SIGKILL
    default = {"cleanup": "delete", "retention_seconds": None, "delete_retention_seconds": 86400.0}
    body = {"keep": {"queue_count": 1, **default}, "x": {"queue_count": 4, **default}}
    write_json(tmp_path / TOPICS_FILE, body)
    with MessageStore.open(tmp_path, CONFIG, read_only=True) as store:
        assert store.queue_ids("x") == [0, 1, 2, 3]
        assert store.topic_policy("x").cleanup == "compact"
    body["x"] = {"queue_count": 6, **default}  # the file has more: the last record undoes it
    write_json(tmp_path / TOPICS_FILE, body)
    with pytest.raises(CorruptionError, match="'x'"):
        MessageStore.open(tmp_path, CONFIG, read_only=True).close()
