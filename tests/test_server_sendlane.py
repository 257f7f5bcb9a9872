"""A connection's reads in C (cext/sendlane.c, SendLane) and a flushed batch's answers in C
(cext/release.c, release_frames) against the Python they replace: the same answers,
counters, in_flight and store, for the common case and the rare ones the C leaves to
Python (a stats request between sends, held pulls, answers queued, a closed,
half-closed or failing connection), and over real sockets a client that leaves with
answers pending."""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import shutil
import socket
import weakref
from pathlib import Path
from typing import Any, Literal

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import raw, short_dir
from test_server_fastsend import CountingRecorder, _answers, _connect, _feed, _greeted

from equeue import MessageStore, speedups
from equeue.protocol.frames import STATUS_OK, FrameReader, encode
from equeue.protocol.handshake import Hello
from equeue.server import BrokerThread
from equeue.server.config import ServerConfig
from equeue.server.connection import Connection, release_durable
from equeue.server.handlers import Frame
from equeue.server.serve import Broker
from equeue.server.stats import COUNTERS

Flush = Literal["sync", "async"]
Mode = Literal["lane", "python", "general"]
pytestmark = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="the lane is C")


def _mode(connection: Connection, mode: Mode) -> None:
    """lane: as the broker runs (SendLane); python: Connection.buffer_updated's own fast
    path; general: the frame reader and msgpack for every read."""
    if mode != "lane":
        del connection.__dict__["buffer_updated"], connection.__dict__["get_buffer"]
    if mode == "general":
        connection._plain_send = connection._send_body = None


def _normal(answer: list[Any]) -> list[Any]:
    """What differs between two stores taken out: the store id and time of a send's
    result; a stats answer reduced to its counters."""
    rid, status, payload = answer
    if status == 0 and type(payload) is list and len(payload) == 6:
        payload = [payload[0][8:], *payload[1:5]]
    if status == 0 and type(payload) is dict and "requests" in payload:
        # (bytes_out counts the stats answers before, whose length varies with their times)
        payload = {k: payload[k] for k in COUNTERS if k in payload and k != "bytes_out"}
    return [rid, status, payload]


async def _serve(directory: Path, reads: list[bytes], mode: Mode, flush: Flush) -> tuple[Any, ...]:
    broker = Broker(directory, ServerConfig(flush=flush))
    await broker.start()
    try:
        connection, transport = _connect(broker)
        _mode(connection, mode)
        _feed(connection, encode(Hello(client="t").pack()))
        for read in reads:
            if connection.closed:
                break
            _feed(connection, read)
            if broker.commit is not None and read.endswith(b"\x00"):  # now and then
                await broker.commit.drain()
                await asyncio.sleep(0)
        if broker.commit is not None:
            await broker.commit.drain()
        await asyncio.sleep(0)  # answers written in a callback
        _welcome, *frames = FrameReader(1 << 30, "t").feed(bytes(transport.data))
        answers = [_normal(msgpack.unpackb(b)) for b in frames]
        store = broker.store
        stored = []
        for topic in sorted(store.topics()):
            for queue_id in store.queue_ids(topic):
                found = store.pull(topic, queue_id, 0, 10_000)
                stored += [(topic, queue_id, m.queue_offset, m.body) for m in found.messages]
        # bytes_out: every byte written (a stats answer's length varies with its times)
        totals = dict(zip(COUNTERS, broker.counters.totals(), strict=True))
        totals["bytes_out"] -= len(transport.data)
        return answers, stored, totals, connection.in_flight, connection.closed
    finally:
        await broker._drain()


@st.composite
def frames(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 9))
    rid = draw(st.integers(1, 300))
    topic = draw(st.sampled_from(["t", "u", "equeue.retry.x", ""]))
    body = draw(st.binary(max_size=200))
    if kind <= 5:
        return encode([rid, "send", {"topic": topic, "body": body}])
    if kind == 6:
        return encode([rid, "stats", {}])
    if kind == 7:
        return encode([rid, "ping", {}])
    if kind == 8:  # a plain send's bytes, damaged
        frame = bytearray(encode([rid, "send", {"topic": topic, "body": body}]))
        frame[draw(st.integers(4, len(frame) - 1))] = draw(st.integers(0, 255))
        return bytes(frame)
    return encode([rid, "send_batch", {"topic": topic, "messages": [body]}])


@st.composite
def streams(draw: st.DrawFn) -> list[bytes]:
    parts = draw(st.lists(frames(), min_size=1, max_size=14))
    data = b"".join(parts)
    cuts: set[int] = set(itertools.accumulate(len(p) for p in parts))
    cuts |= set(draw(st.lists(st.integers(1, len(data) - 1), max_size=2)))
    bounds = [0, *sorted(c for c in cuts if 0 < c < len(data)), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reads=streams(), flush=st.sampled_from(["async", "sync"]))
def test_the_lane_answers_counts_and_stores_as_python_and_the_general_path(
    reads: list[bytes], flush: Flush
) -> None:
    """Every counter (a stats request between sends sees them), answer, in_flight and the
    store, through SendLane, Connection.buffer_updated's fast path and the general one.
    (All three release --flush sync answers through release_frames, C: its equivalence
    with the Python release rests on the release tests below.)"""
    directory = short_dir()
    try:
        seen = {
            mode: asyncio.run(_serve(directory / mode, reads, mode, flush))
            for mode in ("lane", "python", "general")
        }
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert seen["lane"] == seen["python"] == seen["general"]


def test_the_lane_takes_a_plain_send_without_python() -> None:
    """The control of the test above: a plain send's read calls none of the Python
    methods the lane falls back to."""
    calls: list[str] = []

    async def run(directory: Path) -> tuple[int, int]:
        broker = Broker(directory, ServerConfig(flush="sync"))
        await broker.start()
        try:
            connection, transport = _connect(broker)
            _feed(connection, encode(Hello(client="t").pack()))
            with pytest.MonkeyPatch.context() as patch:
                for name in ("_plain_sent", "_read_general", "data_received", "buffer_updated"):
                    real = getattr(Connection, name)

                    def spy(self: Connection, *args: Any, _real: Any = real, _n: str = name) -> Any:
                        calls.append(_n)
                        return _real(self, *args)

                    patch.setattr(Connection, name, spy)
                for rid in range(1, 4):
                    _feed(connection, encode([rid, "send", {"topic": "t", "body": b"x"}]))
            assert broker.commit is not None
            await broker.commit.drain()
            await asyncio.sleep(0)
            return len(_answers(transport)), broker.counters.sends
        finally:
            await broker._drain()

    directory = short_dir()
    try:
        answered, sends = asyncio.run(run(directory / "s"))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert (answered, sends) == (4, 3)  # the welcome and three answers
    assert calls == []


async def _held(directory: Path, mode: Mode) -> tuple[Any, ...]:
    """A pull held on t/0 by one connection, then a plain send to t/0 on another."""
    broker = Broker(directory, ServerConfig(flush="sync"))
    await broker.start()
    try:
        (puller, pulled), (sender, sent) = _greeted(broker, 2)
        _mode(sender, mode)
        broker.store.create_topic("t", 1)
        _feed(sender, encode([1, "send", {"topic": "t", "body": b"first"}]))
        assert broker.commit is not None
        await broker.commit.drain()
        await asyncio.sleep(0)
        args = {"topic": "t", "queue_id": 0, "offset": 1, "wait_ms": 5000}
        _feed(puller, encode([7, "pull", args]))
        assert broker.holds.count == 1
        _feed(sender, encode([2, "send", {"topic": "t", "body": b"second"}]))
        await broker.commit.drain()
        for _ in range(3):
            await asyncio.sleep(0)
        got = _answers(pulled)
        bodies = [m[9] for m in got[0][2][0]] if got and got[0][1] == STATUS_OK else got
        return bodies, len(_answers(sent)), broker.holds.count
    finally:
        await broker._drain()


def test_a_plain_send_through_the_lane_answers_a_held_pull() -> None:
    directory = short_dir()
    try:
        lane = asyncio.run(_held(directory / "lane", "lane"))
        python = asyncio.run(_held(directory / "python", "python"))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert lane == python
    assert lane == ([b"second"], 2, 0)  # both sends answered, the pull too


async def _queued(directory: Path, mode: Mode, flush: Flush) -> list[Any]:
    """An answer queued outside a read (not yet written) when a plain send's read comes:
    the queued one goes first."""
    broker = Broker(directory, ServerConfig(flush=flush))
    await broker.start()
    try:
        ((connection, transport),) = _greeted(broker, 1)
        _mode(connection, mode)
        connection._queue(encode([99, STATUS_OK, "queued"]))
        _feed(connection, encode([1, "send", {"topic": "t", "body": b"x"}]))
        if broker.commit is not None:
            await broker.commit.drain()
        await asyncio.sleep(0)
        return [[a[0], a[1]] for a in _answers(transport)] + [broker.counters.totals()]
    finally:
        await broker._drain()


@pytest.mark.parametrize("flush", ["sync", "async"])
def test_answers_queued_before_a_plain_send_go_first(flush: Flush) -> None:
    directory = short_dir()
    try:
        lane = asyncio.run(_queued(directory / "lane", "lane", flush))
        python = asyncio.run(_queued(directory / "python", "python", flush))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert lane[:2] == [[99, STATUS_OK], [1, STATUS_OK]]
    assert lane == python


def _release_durable(batch: list[Any], frames_in_c: bool) -> None:
    """release_durable, with release_frames (C) or without (the Python it replaces)."""
    import equeue.server.release as module

    saved = module.release_frames
    if not frames_in_c:
        module.release_frames = None
    try:
        release_durable(batch, None)
    finally:
        module.release_frames = saved


class FailingRecorder(CountingRecorder):
    def write(self, data: bytes) -> None:
        raise OSError(32, "a write failed (EPIPE)")


async def _release_mixed(directory: Path, frames_in_c: bool, in_flight: int) -> dict[str, Any]:
    """One flushed batch, in_flight answers each (1: release_frames' lone path, the
    commonest; 2: its grouped one): a connection with answers queued, one whose write
    raises, one in a read's batch, one half-closed (_ended), one closed, and one plain."""
    broker = Broker(directory, ServerConfig(flush="sync"))
    await broker.start()
    try:
        peers = _greeted(broker, 6)
        (queued, _), (failing, _), (batching, _), (ended, _), (_closed, gone), _plain = peers
        failing.transport = broken = FailingRecorder()  # type: ignore[assignment]
        broken.protocol = failing  # (closed at the drain like the others)
        for connection, _t in peers:
            connection.in_flight = in_flight
        queued._out.append(encode([50, STATUS_OK, "before"]))
        queued._out_bytes = len(queued._out[0])
        batching._batching = True
        ended._ended = True
        gone.close()  # (connection_lost: its answers after it are dropped)
        count = len(peers) * in_flight
        frame = {rid: Frame(encode([rid, STATUS_OK, f"r{rid}"])) for rid in range(1, count + 1)}
        batch = [(c, in_flight * i + k + 1, frame[in_flight * i + k + 1])
                 for k in range(in_flight) for i, (c, _) in enumerate(peers)]  # fmt: skip
        out_before = broker.counters.bytes_out
        _release_durable(batch, frames_in_c)
        batching._batching = False
        batching._write_out()
        return {
            "answers": [[a[0] for a in _answers(t)] for _c, t in peers],
            "in_flight": [c.in_flight for c, _ in peers],
            "bytes_out": broker.counters.bytes_out - out_before,
            "closed": [c.closed for c, _ in peers],
        }
    finally:
        await broker._drain()


@pytest.mark.parametrize("in_flight", [1, 2])
def test_release_frames_leaves_the_rare_connections_to_python_and_survives_a_failed_write(
    caplog: pytest.LogCaptureFixture, in_flight: int
) -> None:
    directory = short_dir()
    try:
        with caplog.at_level(logging.ERROR, logger="equeue.server"):
            in_c = asyncio.run(_release_mixed(directory / "c", True, in_flight))
        python = asyncio.run(_release_mixed(directory / "py", False, in_flight))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    rids = [list(range(in_flight * i + 1, in_flight * (i + 1) + 1)) for i in range(6)]
    assert in_c["answers"] == [[50, *rids[0]], [], rids[2], rids[3], [], rids[5]]
    assert in_c["in_flight"] == [0] * 6
    assert in_c["closed"] == [False, False, False, True, True, False]
    assert "writing its answers failed" in caplog.text and "EPIPE" in caplog.text
    assert in_c == python


def test_a_closed_connection_and_its_lane_are_collected() -> None:
    """The lane and the connection refer to each other (its instance dict holds the lane)
    until connection_lost takes the lane out; either way the connection goes (SendLane's
    traverse and clear; test_server_lane_edges.py: freed with the GC off)."""

    async def run(directory: Path) -> weakref.ref[Connection]:
        broker = Broker(directory, ServerConfig(flush="sync"))
        await broker.start()
        try:
            connection, transport = _connect(broker)
            _feed(connection, encode(Hello(client="t").pack()))
            _feed(connection, encode([1, "send", {"topic": "t", "body": b"x"}]))
            assert broker.commit is not None
            await broker.commit.drain()
            await asyncio.sleep(0)
            transport.close()
            ref = weakref.ref(connection)
            del connection, transport
            return ref
        finally:
            await broker._drain()

    directory = short_dir()
    try:
        ref = asyncio.run(run(directory / "s"))
        gc.collect()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert ref() is None


def test_a_client_leaving_with_durable_answers_pending_does_not_disturb_the_others() -> None:
    """Over real sockets, --flush sync: clients that send a burst and close (or shut down
    their writing half) before the answers; the broker serves another client throughout
    and stores every message of a half-closed client (it reads its answers). A client
    that closes outright may lose the tail of its burst, never acknowledged: an answer
    written to its closed socket fails (EPIPE) and closes the connection before the
    broker read the rest (seen in 1 of 15 runs of 20 rounds, base and branch alike);
    what the broker read, it stored, in order."""
    directory = short_dir()
    running = BrokerThread(directory / "s", flush="sync")
    try:
        with running, raw(running.urls[0]) as good:
            for round_ in range(20):
                with raw(running.urls[0]) as leaving:
                    for i in range(5):
                        leaving.request("send", topic="gone", body=b"%d-%d" % (round_, i))
                    if round_ % 2:
                        leaving.sock.shutdown(socket.SHUT_WR)  # half-closed: answered, closed
                        got = leaving.answers(5)
                        assert all(status == 0 for status, _ in got.values())
                assert len(good.call("send", topic="ok", body=b"%d" % round_)) == 6
            stats = good.call("stats")
        with MessageStore.open(directory / "s", read_only=True) as reader:
            queues = reader.queue_ids("gone")
            bodies = {m.body for q in queues for m in reader.pull("gone", q, 0, 1000).messages}
        for round_ in range(20):
            kept = [b"%d-%d" % (round_, i) in bodies for i in range(5)]
            if round_ % 2:
                assert all(kept), (round_, kept)
            else:  # a prefix of the burst: read in order until the connection closed
                assert kept == sorted(kept, reverse=True), (round_, kept)
        assert stats["sends"] == len(bodies) + 20 and len(bodies) >= 50
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.parametrize("read_first", [False, True])
def test_a_c_built_send_result_is_answered_as_its_fields_pack(read_first: bool) -> None:
    """send_answer packs a C send's result from its C values (sendframe.c's
    answer_of_fields), the fields never made: byte for byte what msgpack packs of the
    fields, whether or not they were read before, for send and send_batch (one stored_at
    shared) results and request ids up to 2**64 - 1. (A fresh store's positions and
    offsets are small; a topic long enough to need answer_of_fields' fallback is refused
    by the store: review 32a tried 250-400 byte topics, all answered the same.)"""
    from equeue import MessageStore
    from equeue.store.types import SendResult

    fast = speedups.SPEEDUPS
    assert fast is not None
    directory = short_dir()
    try:
        with MessageStore.open(directory / "s") as store:
            # a topic's first send to each of its 4 queues makes the queue's writer on the
            # Python path (its result's fields made there); the C send's results follow,
            # their positions' hex digits in letters as well as numbers
            sizes = (1, 200, 3000, 1, 200, 3000, 77, 5000, 9, 40)
            results = [store.send("t", b"x" * n) for n in sizes]
            results += store.send_batch("t.batch", [b"a", b"b"])
            assert all(type(r) is SendResult for r in results)
            assert any(set(f"{r.position:x}") & set("abcdef") for r in results[4:10])
            rids = (1, 2**40, 2**64 - 1, 7, 8, 2**32, 300, 2**64 - 2, 0x7F, 0x80, 5, 6)
            for rid, result in zip(rids, results, strict=True):
                if read_first:
                    tuple(result)
                answer = fast.send_answer(rid, result)
                assert answer == encode([rid, STATUS_OK, list(result)])
                assert fast.send_answer(rid, result, Frame) == answer
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def _lone(directory: Path, frames_in_c: bool) -> tuple[list[Any], list[int], list[int]]:
    """Lone answers (in_flight 1) and a connection whose in_flight undercounts its answers
    in the batch (not the broker's state, but the order must hold)."""
    broker = Broker(directory, ServerConfig(flush="sync"))
    await broker.start()
    try:
        peers = _greeted(broker, 3)
        (a, _), (b, _), (c, _) = peers
        a.in_flight, b.in_flight, c.in_flight = 1, 1, 2
        frame = {rid: Frame(encode([rid, STATUS_OK, f"r{rid}"])) for rid in range(1, 6)}
        batch = [(a, 1, frame[1]), (b, 2, frame[2]), (c, 3, frame[3]), (b, 4, frame[4])]
        batch.append((c, 5, frame[5]))
        _release_durable(batch, frames_in_c)
        return (
            [[x[0] for x in _answers(t)] for _c, t in peers],
            [t.writes for _c, t in peers],
            [x.in_flight for x, _t in peers],
        )
    finally:
        await broker._drain()


def test_lone_answers_are_written_as_they_are_and_in_batch_order() -> None:
    directory = short_dir()
    try:
        in_c = asyncio.run(_lone(directory / "c", True))
        python = asyncio.run(_lone(directory / "py", False))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert in_c[0] == python[0] == [[1], [2, 4], [3, 5]]
    assert in_c[2] == python[2] == [0, -1, 0]
    assert in_c[1] == [1, 2, 1]  # b, in_flight 1 with two answers: each written alone
