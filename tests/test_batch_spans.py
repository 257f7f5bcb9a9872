"""The broker's send_bodies read in C from the frame, its bodies left there
(cext/bodyspans.c, handlers.send_spans): what msgpack reads, the same answers and bytes
on disk as the general path, nothing stored for a refused request, and what a read-only
reader in another process sees (a SIGKILL mid-batch: test_columns_answer.py)."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import raw, short_dir, short_home
from test_speedups import data_areas

import equeue
from equeue import MessageStore, StoreConfig, speedups
from equeue.protocol.frames import check_answer
from equeue.server import BrokerThread
from equeue.server.handlers import Handlers

pytestmark = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="the C accelerator is not built")
home = pytest.fixture(short_home, name="home")
# 64 KiB log chunks, disk blocks reserved 4 KiB at a time, queue chunks of 342 entries: a
# batch meets a rollover or a reservation every few requests.
CONFIG = StoreConfig(
    chunk_data_size=65536, alloc_step=4096, queue_chunk_records=342, max_message_size=1024,
    flush="async",
)  # fmt: skip
MAX_BATCH = 100
NOW_NS = 1_700_000_000_123_456_789


def _read(frame: bytes) -> Any:
    """bodies_body's reading as msgpack would give it, or None."""
    assert speedups.SPEEDUPS is not None
    read = speedups.SPEEDUPS.bodies_body(frame, 1 << 24)
    if read is None:
        return None
    rid, topic, spans = read
    bodies = [spans[i] for i in range(len(spans))]
    with pytest.raises(IndexError):
        spans[len(spans)]
    return [rid, "send_bodies", {"topic": topic, "bodies": bodies}]


def _decoded(frame: bytes) -> Any:
    try:
        return msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception:
        return None


bodies_st = st.lists(
    st.binary(max_size=300) | st.sampled_from([b"", b"x" * 255, b"y" * 256, b"z" * 70_000]),
    min_size=1,
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(
    rid=st.integers(1, 2**64 - 1),
    topic=st.text(max_size=40),
    bodies=bodies_st,
    topic_first=st.booleans(),
)
def test_a_send_bodies_frame_is_read_as_msgpack_reads_it(
    rid: int, topic: str, bodies: list[bytes], topic_first: bool
) -> None:
    args = {"topic": topic, "bodies": bodies} if topic_first else {"bodies": bodies, "topic": topic}
    frame = msgpack.packb([rid, "send_bodies", args])
    assert _read(frame) == [rid, "send_bodies", {"topic": topic, "bodies": bodies}]


def _mutate(frame: bytes, data: st.DataObject) -> bytes:
    how = data.draw(st.sampled_from(["cut", "flip", "insert", "append"]))
    at = data.draw(st.integers(0, len(frame) - 1))
    if how == "cut":
        return frame[:at]
    if how == "flip":
        return frame[:at] + bytes([data.draw(st.integers(0, 255))]) + frame[at + 1 :]
    if how == "insert":
        return frame[:at] + data.draw(st.binary(min_size=1, max_size=4)) + frame[at:]
    return frame + data.draw(st.binary(min_size=1, max_size=4))


ODD_REQUESTS: list[Any] = [
    [0, "send_bodies", {"topic": "t", "bodies": [b"a"]}],  # the connection's own id
    [-1, "send_bodies", {"topic": "t", "bodies": [b"a"]}],
    [1, "send_bodies", {"topic": "t", "bodies": []}],
    [1, "send_bodies", {"topic": "t", "bodies": [b"a", "b"]}],
    [1, "send_bodies", {"topic": "t", "bodies": [b"a", None, b"c"]}],
    [1, "send_bodies", {"topic": "t", "bodies": [b"a", [b"b"]]}],
    [1, "send_bodies", {"topic": "t", "bodies": b"a"}],
    [1, "send_bodies", {"topic": b"t", "bodies": [b"a"]}],
    [1, "send_bodies", {"topic": "t", "bodies": [b"a"], "extra": 1}],
    [1, "send_bodies", {"topic": "t"}],
    [1, "send_batch", {"topic": "t", "bodies": [b"a"]}],
    [1, "send_bodies", {"topic": "t", "bodies": [b"a"]}, 4],
    [1, "send_bodies", ["t", [b"a"]]],
]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    request=st.sampled_from(ODD_REQUESTS)
    | st.builds(lambda b: [7, "send_bodies", {"topic": "tt", "bodies": b}], bodies_st),
    data=st.data(),
)
def test_any_other_frame_is_left_to_msgpack_or_read_as_it_reads_it(
    request: list[Any], data: st.DataObject
) -> None:
    """Hostile frames (cut, a byte changed, bytes inserted or appended, wrong types, an
    empty array): either None (the general path decodes and refuses it) or exactly
    what msgpack decodes, a request the general path would serve the same way."""
    frame = msgpack.packb(request)
    frame = _mutate(frame, data) if data.draw(st.booleans()) else frame
    read = _read(frame)
    if read is not None:
        assert read == _decoded(frame)
        assert read[0] > 0 and read[2]["bodies"]
    for special in (b"\x93\x01\xabsend_bodies\x82\xa5topic\xa1t\xa6bodies\xde\x00\x01\xc4\x01a",
                    b"\x93\x01\xabsend_bodies\xde\x00\x02\xa5topic\xa1t\xa6bodies\x91\xc4\x01a",
                    b"\x93\x01\xabsend_bodies\x82\xa5topic\xa2\xff\xfe\xa6bodies\x91\xc4\x01a",
                    b"\x93\x01\xabsend_bodies\x82\xa5topic\xa1t\xa5topic\xa1t"):  # fmt: skip
        assert _read(special) is None


@pytest.fixture
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(time, "time_ns", lambda: NOW_NS)
    yield


def _request_st() -> st.SearchStrategy[list[Any]]:
    plain = st.binary(max_size=300)
    hostile = st.sampled_from([b"o" * (CONFIG.max_message_size + 1), "str", 5, None, [b"x"]])
    good = st.lists(plain, min_size=1, max_size=MAX_BATCH)
    bad = st.tuples(good, hostile, st.integers(0, MAX_BATCH)).map(
        lambda t: [*t[0][: t[2]], t[1], *t[0][t[2] :]]
    )
    over = st.builds(lambda n: [b"m"] * n, st.integers(MAX_BATCH + 1, MAX_BATCH + 30))
    topic = st.sampled_from(["t", "t", "t", "u", "é" * 3, "equeue.mine"])
    bodies: st.SearchStrategy[list[Any]] = good | good | good | bad | over | st.just([])
    return st.tuples(topic, bodies).map(list)


def _serve(path: Path, requests: list[list[Any]]) -> tuple[list[Any], int]:
    """Each request on a connection to a broker of path (a new connection after one is
    closed): its answers, ids without the store's prefix and paths named the same; and
    how many were answered by send_spans. A refused request leaves the files as they were."""
    answered = [0]
    real = Handlers.send_spans

    def counted(self: Handlers, *args: Any) -> object:
        result = real(self, *args)
        answered[0] += result is not None
        return result

    answers: list[Any] = []
    with (
        pytest.MonkeyPatch.context() as patch,
        MessageStore.open(path, CONFIG) as store,
        BrokerThread(store, max_batch_messages=MAX_BATCH) as broker,
    ):
        if Handlers.send_spans is real:
            patch.setattr(Handlers, "send_spans", counted)
        store.create_topic("t", 3)
        connection: Any = None
        with contextlib.ExitStack() as stack:
            for rid, (topic, bodies) in enumerate(requests, 1):
                if connection is None:
                    connection = stack.enter_context(raw(broker.urls[0]))
                before = {p: p.read_bytes() for p in sorted(path.rglob("chunk-*"))}
                frame = msgpack.packb([rid, "send_bodies", {"topic": topic, "bodies": bodies}])
                connection.send_raw(len(frame).to_bytes(4, "big") + frame)
                got, status, payload = check_answer(connection.recv(), "test")
                if status == 0:
                    payload[1] = [i[8:] for i in payload[1]]
                else:
                    payload = {k: str(v).replace(str(path), "STORE") for k, v in payload.items()}
                    assert {p: p.read_bytes() for p in sorted(path.rglob("chunk-*"))} == before
                answers.append((got, status, payload))
                if got == 0:  # the connection is closed: the next request gets another
                    connection = None
    return answers, answered[0]


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(requests=st.lists(_request_st(), min_size=1, max_size=12))
def test_the_frame_path_answers_and_writes_as_the_general_path(
    fixed_clock: None, requests: list[list[Any]]
) -> None:
    """Random and hostile send_bodies (a body over max_message_size or not bin anywhere
    in the batch, more than max_batch_messages, none, a reserved topic, a new topic, a
    topic name the store refuses)
    against a broker with the frame path and one without: the same answers (errors
    included: the frame path leaves each refusal to the general path), the same bytes
    in every chunk's data area, and nothing written by any refused request."""
    directory = short_dir()
    try:
        fast, used = _serve(directory / "a", requests)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Handlers, "send_spans", lambda self, *args: None)
            slow, unused = _serve(directory / "b", requests)
        assert unused == 0
        assert fast == slow
        assert data_areas(directory / "a") == data_areas(directory / "b")
        plain = [
            r for r in requests
            if r[0] in ("t", "u") and 0 < len(r[1]) <= MAX_BATCH
            and all(type(b) is bytes and len(b) <= CONFIG.max_message_size for b in r[1])
        ]  # fmt: skip
        assert used == len(plain)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


READER = """
import json, sys, time
from equeue import MessageStore
store = MessageStore.open(sys.argv[1], read_only=True)
total, seen, deadline = int(sys.argv[2]), {}, time.monotonic() + 60
while time.monotonic() < deadline:
    store.refresh()
    for q in store.queue_ids("t"):
        got = seen.setdefault(q, [])
        got += [m.body.decode() for m in store.pull("t", q, len(got), 1000).messages]
    if sum(map(len, seen.values())) >= total:
        break
    time.sleep(0.001)
print(json.dumps(seen), flush=True)
store.close()
"""


def test_a_read_only_handle_in_another_process_reads_batches_as_they_arrive(home: Path) -> None:
    """A reader process (read_only) pulling every queue while a client's batches arrive
    through the broker (unflushed: the reader sees the page cache, docs/durability.md):
    it reads each queue in order, every body as sent, no gap."""
    batches = 60
    with MessageStore.open(home / "store", CONFIG) as store:
        store.create_topic("t", 3)
    with MessageStore.open(home / "store", CONFIG) as store, BrokerThread(store) as broker:
        reader = subprocess.Popen(
            [sys.executable, "-c", READER, str(home / "store"), str(batches * 100)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            expected: dict[int, list[str]] = {0: [], 1: [], 2: []}
            with equeue.connect(broker.urls[0]) as client:
                for b in range(batches):
                    bodies = [f"{b}-{i}-".ljust(20 + i % 200, "x") for i in range(100)]
                    for sent, text in zip(
                        client.send_batch("t", [t.encode() for t in bodies]), bodies, strict=True
                    ):
                        expected[sent.queue_id].append(text)
            out, _ = reader.communicate(timeout=90)
        finally:
            reader.kill()
            reader.wait(10)
    assert {int(q): bodies for q, bodies in json.loads(out).items()} == expected


def test_bodies_past_the_limit_are_left_to_the_general_path() -> None:
    assert speedups.SPEEDUPS is not None
    read = speedups.SPEEDUPS.bodies_body
    for count in (1, 3, 100):
        frame = msgpack.packb([7, "send_bodies", {"topic": "t", "bodies": [b""] * count}])
        assert len(read(frame, count)[2]) == count
        assert read(frame, count - 1) is None


# A frame of 4,000,000 empty bodies (2 bytes each): before, bodies_body took 16 bytes a
# body (61 MiB) before the limit refused it. The broker in a process of its own, its peak
# memory (ru_maxrss) taken around the refusal.
_FLOOD = """
import resource, struct, sys, tempfile
from pathlib import Path
from server_helpers import raw
from equeue import MessageStore, StoreConfig
from equeue.protocol.frames import check_answer
from equeue.server import BrokerThread
n = 4_000_000
body = (b"\\x93\\x01\\xabsend_bodies\\x82\\xa5topic\\xa1t\\xa6bodies\\xdd" + struct.pack(">I", n)
        + b"\\xc4\\x00" * n)
path = Path(sys.argv[1]) / "s"
with MessageStore.open(path, StoreConfig(flush="async")) as store, BrokerThread(store) as broker:
    store.create_topic("t", 1)
    with raw(broker.urls[0]) as connection:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        connection.send_raw(len(body).to_bytes(4, "big") + body)
        rid, status, error = check_answer(connection.recv(), "test")
        grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(json.dumps([rid, status, error, grew << 10, len(body), store.queue_range("t", 0)]))
"""


def test_a_frame_of_many_empty_bodies_is_refused_without_memory_per_body() -> None:
    directory = short_dir()
    try:
        out = subprocess.run(
            [sys.executable, "-c", "import json\n" + _FLOOD, str(directory)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=Path(__file__).parent,
            check=True,
        ).stdout
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    rid, status, error, grew, size, queue = json.loads(out)
    assert (rid, status, error["code"]) == (0, 1, "ProtocolError")
    assert "4000000 exceeds max_array_len(131072)" in error["message"]  # the decoder's refusal
    assert "max_batch_messages=65536" in error["message"]
    assert queue == [0, 0]
    # The frame read and copied, a few times its size (measured 22 MiB); not 16 B a body
    assert grew < 4_000_000 * 12, (grew, size)
