"""A writable open refused at a queue directory leaves topics.json and topics.journal
as they were: the journal's fold, the cut of its torn tail and the topics recovered from
the queue directories are written only once the open succeeds (TopicsFile.finish_open)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from store_helpers import killed_store, snapshot

from equeue import MessageStore, StoreConfig
from equeue.errors import StorePathError
from equeue.format.chunk import chunk_file_name
from equeue.format.topicsjournal import TOPICS_JOURNAL_FILE, check_header, pack_header
from equeue.store.meta import TOPICS_FILE

HERE = Path(__file__).parent
CONFIG = StoreConfig(flush="os", chunk_data_size=1 << 16, queue_chunk_records=1024)
TOPICS = {"a": 2, "b": 1}

# Creates the topics, sends one message to each queue, and is SIGKILLed: the journal
# holds the creations, not yet folded into topics.json.
_KILLED = """
import os, signal, sys
from equeue import MessageStore, StoreConfig
store = MessageStore.open(sys.argv[1], StoreConfig(flush="os", chunk_data_size=1 << 16,
                                                   queue_chunk_records=1024))
for topic, count in (("a", 2), ("b", 1)):
    store.create_topic(topic, count)
    for queue_id in range(count):
        store.send(topic, f"{topic}/{queue_id}".encode(), queue_id=queue_id)
store.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return killed_store(_KILLED, tmp_path_factory.mktemp("killed") / "store")


def _journal_header_only(store: Path) -> None:
    """The journal's records gone (its generation kept) and no topics.json: the open
    recovers the topics from the queue directories and would write them."""
    journal = store / TOPICS_JOURNAL_FILE
    generation, _ = check_header(journal.read_bytes(), str(journal))
    journal.write_bytes(pack_header(generation))
    (store / TOPICS_FILE).unlink(missing_ok=True)


@pytest.mark.parametrize("refusal", ["queue link", "queue file"])
@pytest.mark.parametrize("journal", ["records", "torn tail", "recovered topics"])
def test_a_refused_open_leaves_the_topics_files_and_the_next_open_folds(
    killed: Path, tmp_path: Path, journal: str, refusal: str
) -> None:
    """Seen failing before the fix: every case had rewritten topics.json and
    topics.journal (and the torn tail case had copied the tail to recovered/)."""
    store = tmp_path / "store"
    shutil.copytree(killed, store, symlinks=True)
    assert not (store / TOPICS_FILE).exists(), "the kill was to leave the journal unfolded"
    if journal == "torn tail":
        with open(store / TOPICS_JOURNAL_FILE, "ab") as f:
            f.write(b"\x07torn")
    elif journal == "recovered topics":
        _journal_header_only(store)
    queue = store / "queues" / "a" / "0"  # (a link at a/1 would hide it from recovery)
    outside = tmp_path / "outside"
    if refusal == "queue link":
        queue.rename(outside)
        queue.symlink_to(outside)
    else:
        (queue / chunk_file_name(0)).rename(outside)
        (queue / chunk_file_name(0)).mkdir()
    before = snapshot(store)
    with pytest.raises(StorePathError, match=str(queue)):
        MessageStore.open(store, CONFIG)
    assert snapshot(store) == before
    # The refusal undone, the next open folds what this one left and reads every message.
    if refusal == "queue link":
        queue.unlink()
    else:
        (queue / chunk_file_name(0)).rmdir()
    outside.rename(queue if refusal == "queue link" else queue / chunk_file_name(0))
    with MessageStore.open(store, CONFIG) as opened:
        assert {t: len(opened.queue_ids(t)) for t in opened.topics()} == TOPICS
        for topic, count in TOPICS.items():
            for queue_id in range(count):
                pulled = opened.pull(topic, queue_id, 0)
                assert [m.body for m in pulled.messages] == [f"{topic}/{queue_id}".encode()]
        cuts = [c.file for c in opened.recovery.cuts]
        assert cuts.count(str(store / TOPICS_JOURNAL_FILE)) == (journal == "torn tail")
        rebuilt = [p for p in opened.recovery.problems if "rebuilt from the directories" in p]
        assert len(rebuilt) == (journal == "recovered topics")
    assert (store / TOPICS_FILE).exists()
    assert (store / TOPICS_JOURNAL_FILE).stat().st_size == len(pack_header(0))


# Opens the store with its topics file's atomic writes patched to SIGKILL the process just
# before the one to FILE (argv[2]): the open's fold, now at its end, cut short.
_KILLED_IN_FOLD = """
import os, signal, sys
from pathlib import Path
from equeue import MessageStore, StoreConfig
from equeue.store import topicsfile
real = topicsfile.write_bytes
def write_bytes(path: Path, data: bytes) -> None:
    if path.name == sys.argv[2]:
        os.kill(os.getpid(), signal.SIGKILL)
    real(path, data)
topicsfile.write_bytes = write_bytes
MessageStore.open(sys.argv[1], StoreConfig(flush="os", chunk_data_size=1 << 16,
                                           queue_chunk_records=1024))
"""


@pytest.mark.parametrize("killed_before", [TOPICS_FILE, TOPICS_JOURNAL_FILE])
def test_an_open_killed_in_its_fold_leaves_a_store_the_next_open_accepts(
    killed: Path, tmp_path: Path, killed_before: str
) -> None:
    store = tmp_path / "store"
    shutil.copytree(killed, store, symlinks=True)
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    run = subprocess.run(
        [sys.executable, "-c", _KILLED_IN_FOLD, str(store), killed_before],
        env=env, timeout=60, capture_output=True,
    )  # fmt: skip
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert (store / TOPICS_FILE).exists() == (killed_before == TOPICS_JOURNAL_FILE)
    with MessageStore.open(store, CONFIG) as opened:
        assert {t: len(opened.queue_ids(t)) for t in opened.topics()} == TOPICS
        assert not opened.recovery.problems, opened.recovery.problems
        for topic, count in TOPICS.items():
            for queue_id in range(count):
                pulled = opened.pull(topic, queue_id, 0)
                assert [m.body for m in pulled.messages] == [f"{topic}/{queue_id}".encode()]
