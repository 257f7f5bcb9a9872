"""A process forked while the chunk maker (equeue/chunks/ahead.py) makes a file for a
store: the child has no maker thread and the job is the parent's, so nothing in the child
ever finishes it; the child's copy of the store still closes (it waited for the job for
ever), and the parent's store goes on as if nothing happened."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any

import pytest

import equeue.chunks.manager
from equeue import MessageStore, StoreConfig

CONFIG = StoreConfig(chunk_data_size=4096, default_queue_count=1, flush="os")
BODY = b"b" * 400  # 9 a 4 KiB chunk
CHILD_LIMIT = 10  # seconds the child's close may take before SIGALRM ends it


def test_a_child_forked_while_the_maker_works_closes_its_copy_of_the_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s"
    with MessageStore.open(path, CONFIG) as store:
        store.send("t", BODY)  # a log chunk: the next open has the next one made ahead
    started, release = threading.Event(), threading.Event()
    real = getattr(equeue.chunks.manager, "make_ahead_file")  # noqa: B009 - not exported

    def held(*args: Any, **kwargs: Any) -> Any:
        started.set()
        release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(equeue.chunks.manager, "make_ahead_file", held)
    store = MessageStore.open(path, CONFIG)
    try:
        assert started.wait(60), "the open asked the maker for no file"
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: only os._exit leaves it
            said = b"raised"
            try:
                signal.alarm(CHILD_LIMIT)
                store.close()
                said = b"closed"
            finally:
                os.write(write, said)
                os._exit(0)
        os.close(write)
        _, status = os.waitpid(pid, 0)
        with os.fdopen(read, "rb") as answer:
            said = answer.read()
        assert (said, os.waitstatus_to_exitcode(status)) == (b"closed", 0), (
            f"the child's close did not return in {CHILD_LIMIT} s"
            if os.WIFSIGNALED(status)
            else "the child raised"
        )
        release.set()
        for _ in range(20):  # the parent's maker finishes its file; roll-overs install it
            store.send("t", BODY)
    finally:
        release.set()
        store.close()
    with MessageStore.open(path, CONFIG, read_only=True) as reader:
        assert reader.queue_range("t", 0) == (0, 21)
