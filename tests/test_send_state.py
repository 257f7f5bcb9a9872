"""The C Sender remembers the write state between sends (equeue/cext/sendstate.c): the
log chunk's and each queue chunk's counters, the store's flags, the clock. Here that
state changes underneath it, by Python code, and every send must land where the Python
path would put it: the same results, the same bytes, the same messages pulled, and a
read-only handle in another process sees every one."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from equeue import MessageStore, OutgoingMessage, StoreConfig, speedups
from equeue.format.chunk import HEADER_SIZE
from equeue.store.config import min_open_files
from equeue.store.queuecache import FILES_PER_QUEUE

needs_c = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="the C accelerator is not built")
QUEUES = 12
BASE = StoreConfig(chunk_data_size=8192, queue_chunk_records=342, flush="os")
# Room for 5 open queues of the 12: a round robin evicts and reopens them all the time.
CONFIG = dataclasses.replace(
    BASE, max_open_files=min_open_files(BASE.max_open_chunks) + FILES_PER_QUEUE
)


@pytest.fixture
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(time, "time_ns", lambda: 1_700_000_000_123_456_789)
    yield


def data_areas(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes()[HEADER_SIZE:-128]
        for path in sorted(directory.rglob("chunk-*"))
        if path.suffix != ".tmp"
    }


def plan_run(store: MessageStore, sends: int) -> list[Any]:
    """Plain sends (the C path) with, between them, what changes its state: sends the
    Python path stores (properties, batches), queues closed and reopened (evictions, and
    all of them at once with a collection, so new objects may take the old addresses),
    log and queue chunks filling up, the store's flush error set and cleared."""
    results: list[Any] = []
    for i in range(sends):
        body = b"%d:" % i + b"b" * (i % 300)
        results.append(store.send("t", body))
        if i % 7 == 3:
            results.append(store.send("t", body, properties={"i": str(i)}))
        if i % 13 == 5:
            results.extend(store.send_batch("t", [body, OutgoingMessage(body, queue_id=i % 3)]))
        if i % 17 == 9:
            results.append(store.send("t", body, key=f"k{i % 5}", tag="x"))
        if i % 97 == 50:
            store._files.close_idle()
            gc.collect()
        if i % 211 == 100:
            store.send_batch("u", [body])  # another topic's queue takes a slot
    return [(r.topic, r.queue_id, r.queue_offset, r.position, r.message_id[8:]) for r in results]


def pulled(store: MessageStore, topic: str = "t") -> list[list[Any]]:
    return [
        [m._replace(message_id=m.message_id[8:]) for m in store.pull(topic, q, 0, 10_000).messages]
        for q in store.queue_ids(topic)
    ]


def run(path: Path, sends: int) -> tuple[list[Any], list[list[Any]], int]:
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t", QUEUES)
        store.create_topic("u", 1)
        results = plan_run(store, sends)
        return results, pulled(store), store._files.closed


@needs_c
def test_evictions_rollovers_and_python_sends_between_c_sends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fixed_clock: None
) -> None:
    fast = run(tmp_path / "c", 1500)
    with monkeypatch.context() as m:
        m.setattr(speedups, "SPEEDUPS", None)
        slow = run(tmp_path / "python", 1500)
    assert fast[0] == slow[0]
    assert fast[1] == slow[1]
    assert data_areas(tmp_path / "c") == data_areas(tmp_path / "python")
    messages = sum(map(len, fast[1]))
    assert messages == sum(r[0] == "t" for r in fast[0]) > 2000
    areas = data_areas(tmp_path / "c")
    assert sum("queues" not in name for name in areas) > 50  # log chunks rolled over
    assert fast[2] > 1000  # queues were closed and reopened that often


@needs_c
def test_state_set_from_python_between_c_sends(tmp_path: Path) -> None:
    """What Python sets on the store between two sends is what the next send sees."""
    with MessageStore.open(tmp_path, BASE) as store:
        store.create_topic("t", 1)
        for _ in range(3):
            store.send("t", b"warm")  # remembered from here on
        store._closed = True
        with pytest.raises(Exception, match="closed"):
            store.send("t", b"refused")
        store._closed = False
        first = store.send("t", b"after")
        # The queue's next offset, moved by Python (as a rebuild does): the next entry
        # goes where it says, not where the last C send left it.
        queue = store._queues["t"][0]
        assert queue.next_offset == first.queue_offset + 1
        chunk = store._writer._chunk
        assert chunk is not None
        end, count = chunk.data_end, chunk.record_count
        second = store.send("t", b"next")
        assert second.position == first.position + (end - (first.position - chunk.base))
        assert (chunk.data_end > end, chunk.record_count) == (True, count + 1)
        assert [m.body for m in store.pull("t", 0, 0, 100).messages][-2:] == [b"after", b"next"]


READER = """
import json, sys
from equeue import MessageStore
with MessageStore.open(sys.argv[1], read_only=True) as store:
    print(json.dumps({str(q): [m.body.decode() for m in store.pull("t", q, 0, 10_000).messages]
                      for q in store.queue_ids("t")}))
"""


@needs_c
def test_read_only_handle_in_another_process_sees_every_c_send(tmp_path: Path) -> None:
    """Writer open (not closed), C sends across rollovers and evictions, a flush: a
    read-only open in another process pulls every message, in order."""
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.create_topic("t", QUEUES)
        sent: dict[str, list[str]] = {str(q): [] for q in range(QUEUES)}
        for i in range(2000):
            body = f"m{i}" + "p" * (i % 200)
            result = store.send("t", body.encode())
            sent[str(result.queue_id)].append(body)
        store.flush()
        out = subprocess.run(
            [sys.executable, "-c", READER, str(tmp_path / "s")],
            capture_output=True, text=True, timeout=120, env=dict(os.environ),
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == sent
        assert store._files.closed > 100


@needs_c
def test_threads_sending_at_once(tmp_path: Path) -> None:
    """Four threads of C sends and one of Python-path sends, on the write lock the C
    path takes in place when it is free: every message stored once, each queue's
    offsets dense, the lock free at the end."""
    with MessageStore.open(tmp_path, BASE) as store:
        store.create_topic("t", 3)
        errors: list[BaseException] = []

        def sender(name: str, python_path: bool) -> None:
            try:
                for i in range(1500):
                    props = {"p": "1"} if python_path else None
                    store.send("t", f"{name}/{i}".encode(), properties=props)
            except BaseException as exc:  # reported by the assert below
                errors.append(exc)

        threads = [threading.Thread(target=sender, args=(f"c{n}", False)) for n in range(4)]
        threads.append(threading.Thread(target=sender, args=("py", True)))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert not errors and not any(t.is_alive() for t in threads)
        assert store._lock.acquire(blocking=False)  # not held by any thread
        store._lock.release()
        bodies = []
        for q in store.queue_ids("t"):
            messages = store.pull("t", q, 0, 10_000).messages
            assert [m.queue_offset for m in messages] == list(range(len(messages)))
            bodies += [m.body.decode() for m in messages]
        names = ["c0", "c1", "c2", "c3", "py"]
        assert sorted(bodies) == sorted(f"{n}/{i}" for n in names for i in range(1500))
