"""send_batch of plain bodies in one C call per run (store/bodies.py, cext/batch.c): the
same bytes on disk and the same results as the Python path, across log and queue chunk
rollovers; a rejected batch writes nothing; a SIGKILLed writer of such batches loses
nothing it acknowledged; a read_only handle in another process sees them; the broker's
send_bodies answers what MessageStore.send_batch returns."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from crash_checks import run_kill_iteration
from crash_writer import PLAIN_ENV, POLICIES
from server_helpers import short_home
from store_helpers import snapshot
from test_speedups import data_areas

from equeue import MessageStore, StoreConfig, speedups
from equeue.client import Client
from equeue.errors import InvalidTypeError, MessageTooLargeError, ProtocolError, ReadOnlyError
from equeue.protocol.records import pack_columns, unpack_send_columns
from equeue.server import BrokerThread
from equeue.store import bodies
from equeue.store.bodies import send_columns, send_packed
from equeue.store.types import SendColumns

needs_c = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="the C accelerator is not built")
# 64 KiB log chunks with disk blocks reserved 4 KiB at a time: a batch of 100 meets a
# reservation step or a new chunk every few runs; queue chunks of the least, 342 entries.
CONFIG = StoreConfig(chunk_data_size=65536, alloc_step=4096, queue_chunk_records=342, flush="async")
NOW_NS = 1_700_000_000_123_456_789


@pytest.fixture
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(time, "time_ns", lambda: NOW_NS)
    yield


def body(i: int) -> bytes:
    """100 B, one in seven 1 KiB; says which it is."""
    return (b"b%05d:" % i).ljust(1024 if i % 7 == 3 else 100, b"x")


def send_all(path: Path, batches: list[list[bytes]], columns: bool) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t", 3)
        for batch in batches:
            if columns:
                sent = send_columns(store, "t", batch).results()
            else:
                sent = store.send_batch("t", batch)
            out += [(r.message_id[8:], *r[1:]) for r in sent]
    return out


@needs_c
@pytest.mark.parametrize("columns", [False, True], ids=["results", "columns"])
def test_c_batches_write_the_bytes_of_the_python_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fixed_clock: None, columns: bool
) -> None:
    calls: list[int] = []
    appending = bodies.appending

    def counted(*args: Any) -> Any:
        calls.append(len(args[2]))
        return appending(*args)

    monkeypatch.setattr(bodies, "appending", counted)
    batches = [[body(100 * b + i) for i in range(100)] for b in range(20)]
    fast = send_all(tmp_path / "c", batches, columns)
    assert calls == [100] * 20  # every batch took the C path
    with monkeypatch.context() as m:
        m.setattr(speedups, "SPEEDUPS", None)
        slow = send_all(tmp_path / "python", batches, False)
    assert calls == [100] * 20  # and none of these
    assert fast == slow
    areas = data_areas(tmp_path / "c")
    assert areas == data_areas(tmp_path / "python")
    assert sum("messages" in name for name in areas) > 5  # log chunks rolled over
    assert sum("queues" in name for name in areas) >= 6  # and queue chunks
    with MessageStore.open(tmp_path / "c", CONFIG) as store:
        assert store.recovery.clean
        pulled = [m.body for q in range(3) for m in store.pull("t", q, 0, 1000).messages]
        assert sorted(pulled) == sorted(b for batch in batches for b in batch)


@needs_c
def test_the_packed_answer_is_the_columns_packed(tmp_path: Path, fixed_clock: None) -> None:
    """send_packed (the broker's, written by the C append as it goes) gives the bytes
    pack_columns gives for send_columns' columns, across rollovers (whose bodies go
    through Appender.append and are packed in Python)."""
    packer = msgpack.Packer(use_bin_type=True)
    batches = [[body(100 * b + i) for i in range(100)] for b in range(8)]
    with (
        MessageStore.open(tmp_path / "a", CONFIG) as a,
        MessageStore.open(tmp_path / "b", CONFIG) as b,
    ):
        for batch in batches:
            packed = send_packed(a, "t", batch)
            columns = send_columns(b, "t", batch)
            ids = [a._id_prefix + i[8:] for i in columns.message_ids]
            assert packed == pack_columns(columns._replace(message_ids=ids), packer)
        not_bodies: list[Any] = [b"ok", "not bytes"]
        assert send_packed(a, "t", not_bodies) is None


@pytest.mark.parametrize("bad", [b"x" * 5000, "text", None], ids=["too large", "str", "None"])
def test_a_rejected_batch_of_bodies_writes_nothing(tmp_path: Path, bad: object) -> None:
    config = StoreConfig(chunk_data_size=8192, max_message_size=4096, flush="async")
    with MessageStore.open(tmp_path / "s", config) as store:
        store.send_batch("t", [body(i) for i in range(150)])
        store.flush()
        before = snapshot(tmp_path / "s", skip=())
        items: list[Any] = [body(i) for i in range(50)] + [bad] + [body(i) for i in range(50)]
        error = MessageTooLargeError if isinstance(bad, bytes) else InvalidTypeError
        with pytest.raises(error):
            store.send_batch("t", items)
        with pytest.raises(error):
            send_columns(store, "t", items)
        store.flush()
        assert snapshot(tmp_path / "s", skip=()) == before  # not a byte written
        assert store.send_batch("t", [b"after"])[0].position > 0


@needs_c
@pytest.mark.parametrize("policy", POLICIES)
def test_sigkilled_writer_of_body_batches_loses_nothing_acknowledged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    """tests/crash_writer.py with its producer 3 sending bytes batches (PLAIN_ENV), SIGKILLed
    at random moments; every acknowledged message is there, offsets dense (crash_checks)."""
    monkeypatch.setenv(PLAIN_ENV, "1")
    for seed in (1, 2):
        (tmp_path / str(seed)).mkdir()
        result = run_kill_iteration(tmp_path / str(seed), policy, seed)
        assert not result.problems, result.describe()
        acked = [a for run in result.rounds for a in run.acks if a.producer == 3]
        assert acked or result.rounds[0].plan.mode in ("startup", "ready")


READER = """
import json, sys
from equeue import MessageStore
store = MessageStore.open(sys.argv[1], read_only=True)
for line in sys.stdin:
    store.refresh()
    queues = []
    for q in store.queue_ids("t"):
        first, end = store.queue_range("t", q)
        queues.append([m.body.decode()[:7] for m in store.pull("t", q, first, 10000).messages])
    print(json.dumps(queues), flush=True)
store.close()
"""


def test_a_read_only_handle_in_another_process_sees_body_batches(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t", 3)
        reader = subprocess.Popen(
            [sys.executable, "-c", READER, str(path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert reader.stdin is not None and reader.stdout is not None
        try:
            for b in range(4):
                store.send_batch("t", [body(100 * b + i) for i in range(100)])
                store.send_batch("t", [body(1000 + 100 * b + i) for i in range(100)])
                store.flush()  # what a reader sees: docs/durability.md
                reader.stdin.write("look\n")
                reader.stdin.flush()
                seen = json.loads(reader.stdout.readline())
                expected = [
                    [m.body.decode()[:7] for m in store.pull("t", q, 0, 10000).messages]
                    for q in range(3)
                ]
                assert seen == expected
                assert sum(map(len, seen)) == 200 * (b + 1)
        finally:
            reader.stdin.close()
            try:
                reader.wait(30)
            finally:
                reader.kill()


home = pytest.fixture(short_home, name="home")


def test_the_broker_answers_send_bodies_as_send_batch_returns(
    home: Path, fixed_clock: None
) -> None:
    batches = [[body(100 * b + i) for i in range(100)] for b in range(5)]
    expected = send_all(home / "local", batches, False)
    broker = BrokerThread(MessageStore.open(home / "served", CONFIG)).start()
    try:
        with Client(broker.urls[0]) as client:
            client.create_topic("t", 3)
            got = []
            for batch in batches:
                got += [(r.message_id[8:], *r[1:]) for r in client.send_batch("t", batch)]
    finally:
        broker.stop()
        broker.store.close()
    assert got == expected


def test_columns_pack_as_msgpack_packs_them() -> None:
    columns = SendColumns("t" * 40, ["a" * 24] * 20, list(range(20)), [0, 1, 300, 70_000] * 5,
                          [2**33, 2**64 - 1, 127, 128] * 5, [1.5] * 20)  # fmt: skip
    packer = msgpack.Packer(use_bin_type=True)
    packed = pack_columns(columns, packer)
    assert packed == msgpack.packb(list(columns), use_bin_type=True)
    decoded = msgpack.unpackb(packed)
    assert unpack_send_columns(decoded, "test") == columns.results()
    odd = columns._replace(queue_ids=[True] * 20)  # not the answer's types: msgpack packs it
    assert pack_columns(odd, packer) == msgpack.packb(list(odd), use_bin_type=True)


GOOD = ["t", ["a" * 24, "b" * 24], [0, 3], [5, 2**64 - 1], [2**63, 7], [1.5, 2.5]]


@pytest.mark.parametrize(
    "value",
    [
        GOOD,
        ["t", [], [], [], [], []],
        [*GOOD[:2], [True, 3], *GOOD[3:]],  # a bool is no uint on the wire
        [*GOOD[:3], [-1, 2], *GOOD[4:]],
        [*GOOD[:5], [1.5, 2]],
        [*GOOD[:1], ["a", 1], *GOOD[2:]],
        [*GOOD[:2], [0], *GOOD[3:]],  # columns of unequal length
        [1, *GOOD[1:]],
        GOOD[:5],
        ("t", *GOOD[1:]),
    ],
)
def test_columns_read_back_as_the_python_checks_read_them(
    monkeypatch: pytest.MonkeyPatch, value: object
) -> None:
    """The clients' C reading of a send_bodies answer (results_of_columns) takes what the
    Python checks take, and hands back the rest for them to refuse."""

    def outcome() -> object:
        try:
            return unpack_send_columns(value, "test")
        except ProtocolError as exc:
            return str(exc)

    fast = outcome()
    monkeypatch.setattr(speedups, "SPEEDUPS", None)
    assert outcome() == fast


def test_a_read_only_handle_refuses_the_columns_sends_with_read_only_error(
    tmp_path: Path,
) -> None:
    with MessageStore.open(tmp_path / "s") as store:
        store.create_topic("t", 2)
    with MessageStore.open(tmp_path / "s", read_only=True) as reader:
        for send in (send_columns, send_packed):
            with pytest.raises(ReadOnlyError, match="opened read-only"):
                send(reader, "t", [b"x", b"y"])
        assert reader.queue_range("t", 0) == (0, 0)
    with MessageStore.open(tmp_path / "s") as store:  # control: a writer sends them
        columns = send_columns(store, "t", [b"x", b"y"])
        assert len(columns.queue_ids) == 2
        assert sum(end - first for first, end in map(store.queue_range, "tt", (0, 1))) == 2
