"""A refused open closes what it had opened, with nothing written: an application that
retries it (an operator fixing the store meanwhile) keeps no descriptor a try (review9
R9-4: the log's ongoing chunk and the queues opened before the refusal stayed open, 2
descriptors a refused open, until RLIMIT_NOFILE)."""

from __future__ import annotations

import errno
import gc
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from store_helpers import snapshot
from test_topics_refused_open import _KILLED, CONFIG

from equeue import MessageStore
from equeue.atomicfile import write_bytes
from equeue.chunks.fileops import write_error
from equeue.errors import StorePathError, StoreWriteError
from equeue.store import topicsfile

HERE = Path(__file__).parent
TRIES = 50


def _killed(path: Path) -> Path:
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)])}
    run = subprocess.run(
        [sys.executable, "-c", _KILLED, str(path)], env=env, timeout=60, capture_output=True
    )
    assert run.returncode == -signal.SIGKILL, run.stderr
    return path


def _descriptors() -> set[tuple[str, int]]:
    """This process's open descriptors as (what /proc names, inode)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.add((os.readlink(f"/proc/self/fd/{fd}"), os.stat(f"/proc/self/fd/{fd}").st_ino))
        except OSError:  # (the listing's own descriptor, closed meanwhile)
            continue
    return found


def _link_out(store: Path, topic: str, queue_id: int) -> None:
    """queues/TOPIC/QUEUE_ID moved out of the store, a link to it in its place: the open
    refuses it (it follows no link inside a store)."""
    inside = store / "queues" / topic / str(queue_id)
    outside = store.parent / f"out-{topic}-{queue_id}"
    os.rename(inside, outside)
    os.symlink(outside, inside)


@pytest.mark.parametrize("read_only", [False, True], ids=["writable", "read_only"])
@pytest.mark.parametrize("refused", [("b", 0), ("a", 1)], ids=["b/0", "a/1"])
def test_refused_opens_keep_no_descriptor_and_write_nothing(
    tmp_path: Path, read_only: bool, refused: tuple[str, int]
) -> None:
    """A killed store whose queue b/0 (topic a's queues opened before it) or a/1 (a/0
    opened too, in the topic being opened) is a link out of the store: 50 refused opens,
    every one StorePathError naming it, no descriptor kept, no file changed."""
    store = _killed(tmp_path / "s")
    _link_out(store, *refused)
    before_files = snapshot(tmp_path)
    gc.collect()
    before = _descriptors()
    for _ in range(TRIES):
        with pytest.raises(
            StorePathError, match="queues/{}/{} is a symbolic link".format(*refused)
        ):
            MessageStore.open(store, CONFIG, read_only=read_only)
    gc.collect()
    assert _descriptors() - before == set()
    assert snapshot(tmp_path) == before_files


def test_an_open_failing_at_its_end_keeps_no_descriptor_or_thread_and_the_next_one_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EIO on topics.json's write at the end of a killed store's open (the fold of its
    journal, past every refusal): StoreWriteError naming topics.json, and the open's
    files and threads gone; the next open recovers the topics and every message."""
    store = _killed(tmp_path / "s")

    def failing(path: Path, data: bytes) -> None:
        if Path(path).name == "topics.json":
            raise write_error(OSError(errno.EIO, "Input/output error (test)"), "writing", path)
        write_bytes(path, data)

    gc.collect()
    before, threads = _descriptors(), set(threading.enumerate())
    monkeypatch.setattr(topicsfile, "write_bytes", failing)
    for _ in range(3):
        with pytest.raises(StoreWriteError, match=r"topics\.json"):
            MessageStore.open(store, CONFIG)
    monkeypatch.undo()
    gc.collect()
    assert _descriptors() - before == set()
    assert set(threading.enumerate()) - threads == set()
    with MessageStore.open(store, CONFIG) as opened:
        assert sorted(opened.topics()) == ["a", "b"]
        bodies = [
            [m.body for m in opened.pull(topic, queue_id, 0, 10).messages]
            for topic, queue_id in (("a", 0), ("a", 1), ("b", 0))
        ]
    assert bodies == [[b"a/0"], [b"a/1"], [b"b/0"]]
