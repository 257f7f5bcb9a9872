"""Exactly what a writable open refused after its log recovery leaves written (round 17,
docs/durability.md "What a refused open leaves"): the message log's torn tail cut (the
chunk's bytes from the cut zeroed, a copy in messages/recovered/), and nothing else. The
temp files of atomic writes a crash left stay until an open succeeds (before round 17
every refused open removed them first).

The store: a writer SIGKILLed after its sends, a torn frame written after the log's
last record (a sector of a frame that never completed), a temp file a crash left, and a
queue directory replaced by a symbolic link (StorePathError, refused as the topics load).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from store_helpers import killed_store, snapshot

from equeue import MessageStore, StoreConfig
from equeue.errors import StorePathError
from equeue.format.chunk import HEADER_SIZE
from equeue.inspect.verify import verify_store

CONFIG = StoreConfig(flush="os", chunk_data_size=1 << 16)
SENT = 40
TORN = b"\x40\x00\x00\x00torn"  # a frame's length and the first bytes of its payload
LEFT_TEMP = "offsets.json.5f0e0c8a4c2d4c7fa2b3c4d5e6f70819.tmp"

_KILLED = """
import os, signal, sys
from equeue import MessageStore, StoreConfig
store = MessageStore.open(sys.argv[1], StoreConfig(flush="os", chunk_data_size=1 << 16))
store.create_topic("t", 2)
for i in range(40):
    store.send("t", b"m%03d" % i, queue_id=i % 2)
store.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return killed_store(_KILLED, tmp_path_factory.mktemp("killed") / "store")


def _damaged_copy(killed: Path, tmp_path: Path) -> tuple[Path, Path, int]:
    """The copy, its last log chunk, and the file offset where the torn frame starts."""
    store = tmp_path / "store"
    shutil.copytree(killed, store)
    with MessageStore.open(store, CONFIG, read_only=True) as reader:
        path, data_end = reader.chunk_files()[-1]
    chunk, at = Path(path), HEADER_SIZE + data_end
    with chunk.open("r+b") as f:
        f.seek(at)
        f.write(TORN)
    (store / LEFT_TEMP).write_bytes(b"half an atomic write")
    return store, chunk, at


def test_a_refused_open_leaves_the_logs_tail_cut_and_nothing_else(
    killed: Path, tmp_path: Path
) -> None:
    store, chunk, at = _damaged_copy(killed, tmp_path)
    queue = store / "queues" / "t" / "1"
    aside = tmp_path / "queue-1"
    shutil.move(queue, aside)
    queue.symlink_to(aside)
    before = snapshot(store)
    with pytest.raises(StorePathError, match="symbolic link"):
        MessageStore.open(store, CONFIG)
    after = snapshot(store)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    side = [k for k in changed if k.startswith("messages/recovered/chunk-")]
    assert len(side) == 1 and f".{at}." in side[0] and side[0] not in before, changed
    # (messages/recovered/ itself may be new too: made for the side file)
    assert [k for k in changed if k != "messages/recovered/"] == sorted(
        [str(chunk.relative_to(store)), side[0]]
    ), changed
    # The cut: the torn bytes are in the side file and zeroed in the chunk.
    assert (store / side[0]).read_bytes().startswith(TORN)
    assert chunk.read_bytes()[at : at + len(TORN)] == bytes(len(TORN))
    assert (store / LEFT_TEMP).exists()

    # The refusal undone, the next open succeeds, with every message, and removes the
    # temp file; the cut was the refused open's (its report went with the refusal).
    queue.unlink()
    shutil.move(aside, queue)
    with MessageStore.open(store, CONFIG) as opened:
        assert opened.recovery.cuts == [] and opened.recovery.problems == []
        bodies = sorted(m.body for q in (0, 1) for m in opened.pull("t", q, 0, 100))
        assert bodies == [b"m%03d" % i for i in range(SENT)]
    assert not (store / LEFT_TEMP).exists()
    assert verify_store(store) == []


def test_the_control_open_cuts_the_same_tail_and_removes_the_temp_file(
    killed: Path, tmp_path: Path
) -> None:
    store, chunk, at = _damaged_copy(killed, tmp_path)
    with MessageStore.open(store, CONFIG) as opened:
        assert [(c.file, c.offset) for c in opened.recovery.cuts] == [(str(chunk), at)]
        assert sum(opened.queue_range("t", q)[1] for q in (0, 1)) == SENT
    assert not (store / LEFT_TEMP).exists()
    assert verify_store(store) == []
