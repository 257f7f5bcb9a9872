"""The edges of the broker's C read and release paths (cext/sendlane.c, release.c,
review 32a): a KeyboardInterrupt or SystemExit raised by a write while durable answers
are released goes through, as the Python loop let it; a closed connection is freed by
reference counting (the lane out of its dict), with the garbage collector off, on a real
broker; a subclass's own buffer_updated/get_buffer and a replaced ``_plain_send`` are
called, not bypassed by the lane."""

from __future__ import annotations

import asyncio
import gc
import shutil
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
from server_helpers import raw, short_dir
from test_server_fastsend import CountingRecorder, Recorder, _answers, _connect, _feed, _greeted

import equeue.server.release as module
from equeue import MessageStore, speedups
from equeue.protocol.frames import STATUS_OK, encode
from equeue.protocol.handshake import Hello
from equeue.server import BrokerThread
from equeue.server.config import ServerConfig
from equeue.server.connection import Connection, release_durable
from equeue.server.handlers import Frame
from equeue.server.serve import Broker

pytestmark = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="the lane is C")


class InterruptedRecorder(CountingRecorder):
    raises: type[BaseException] = KeyboardInterrupt

    def write(self, data: bytes) -> None:
        raise self.raises("a write interrupted")


async def _interrupted(
    directory: Path, raises: type[BaseException], in_flight: int, frames_in_c: bool
) -> tuple[str, list[list[Any]], int]:
    """A flushed batch of two connections' answers, the first one's write raising
    ``raises``: what got out of release_durable, the second's answers, bytes_out."""
    broker = Broker(directory, ServerConfig(flush="sync"))
    await broker.start()
    try:
        (first, first_transport), (second, second_transport) = _greeted(broker, 2)
        first.transport = broken = InterruptedRecorder()  # type: ignore[assignment]
        broken.raises = raises
        broken.protocol = first
        batch: list[Any] = []
        for connection in (first, second):
            connection.in_flight = in_flight
            for _ in range(in_flight):
                rid = len(batch) + 1
                batch.append((connection, rid, Frame(encode([rid, STATUS_OK, f"r{rid}"]))))
        saved = module.release_frames
        if not frames_in_c:
            module.release_frames = None
        before = broker.counters.bytes_out
        try:
            release_durable(batch, None)
            out = "returned"
        except BaseException as exc:  # (what the test is about)
            out = type(exc).__name__
        finally:
            module.release_frames = saved
            first.transport = first_transport  # type: ignore[assignment]
        return out, [a[:2] for a in _answers(second_transport)], broker.counters.bytes_out - before
    finally:
        await broker._drain()


@pytest.mark.parametrize("in_flight", [1, 2])
@pytest.mark.parametrize("raises", [KeyboardInterrupt, SystemExit])
def test_a_write_raising_keyboardinterrupt_is_not_swallowed_by_release_frames(
    raises: type[BaseException], in_flight: int
) -> None:
    """Review 32a F1: release_frames logged any exception of a write as a failed write and
    returned; the Python loop it replaces catches Exception only. Now a KeyboardInterrupt
    or SystemExit goes out of release_durable, C and Python alike, and in C the other
    connection of the batch is answered and bytes_out counted first (lone answers,
    in_flight 1, and grouped ones, in_flight 2)."""
    directory = short_dir()
    try:
        python = asyncio.run(_interrupted(directory / "p", raises, in_flight, False))
        in_c = asyncio.run(_interrupted(directory / "c", raises, in_flight, True))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert python[0] == raises.__name__
    out, answers, bytes_out = in_c
    assert out == raises.__name__
    rids = list(range(in_flight + 1, 2 * in_flight + 1))
    assert answers == [[rid, STATUS_OK] for rid in rids]
    # (counted before each write, the interrupted one's too, as _release_one does)
    every = range(1, 2 * in_flight + 1)
    assert bytes_out == sum(len(encode([rid, STATUS_OK, f"r{rid}"])) for rid in every)


@pytest.mark.parametrize("flush", ["sync", "async"])
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_closed_connections_are_freed_with_the_garbage_collector_off(
    flush: str, loop: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 32a F2: the lane in a connection's dict refers to the connection, a cycle
    only the cyclic GC broke: with it off (gc.disable, gc.freeze) closed connections were
    never freed. A real broker, 40 clients each connect, send (through the lane) and
    close, the GC off: every Connection is gone by the time the broker has seen them go
    (bounded wait), and each had its lane."""
    pytest.importorskip(loop)
    refs: list[weakref.ref[Connection]] = []
    lanes: list[bool] = []
    init = Connection.__init__

    def recorded(self: Connection, *args: Any) -> None:
        init(self, *args)
        refs.append(weakref.ref(self))
        lanes.append("buffer_updated" in self.__dict__)

    monkeypatch.setattr(Connection, "__init__", recorded)
    directory = short_dir()
    gc.collect()
    try:
        with BrokerThread(directory / "s", flush=flush, event_loop=loop) as running:
            gc.disable()
            for round_ in range(40):
                with raw(running.urls[0]) as client:
                    assert client.call("send", topic="t", body=b"%d" % round_)[1] == "t"
            deadline = time.monotonic() + 10
            while any(r() is not None for r in refs) and time.monotonic() < deadline:
                time.sleep(0.02)
            alive = sum(r() is not None for r in refs)
    finally:
        gc.enable()
        shutil.rmtree(directory, ignore_errors=True)
    assert len(refs) == 40 and all(lanes)
    assert alive == 0


async def _spied(directory: Path, what: str) -> tuple[list[str], list[list[Any]]]:
    calls: list[str] = []

    class Spy(Connection):
        if what == "buffer_updated":

            def buffer_updated(self, nbytes: int) -> None:
                calls.append("buffer_updated")
                super().buffer_updated(nbytes)

        elif what == "get_buffer":

            def get_buffer(self, sizehint: int) -> memoryview:
                calls.append("get_buffer")
                return super().get_buffer(sizehint)

    broker = Broker(directory, ServerConfig(flush="async"))
    await broker.start()
    try:
        if what == "_plain_send":
            connection, transport = _connect(broker)
            plain = connection._plain_send
            assert plain is not None

            def spy(*args: Any) -> Any:
                calls.append("_plain_send")
                return plain(*args)

            connection._plain_send = spy
        else:
            transport = Recorder()
            connection = Spy(broker, "test", 1)
            transport.protocol = connection
            connection.connection_made(transport)  # type: ignore[arg-type]
        _feed(connection, encode(Hello(client="t").pack()))
        calls.clear()
        for rid in range(1, 4):
            _feed(connection, encode([rid, "send", {"topic": "t", "body": b"x"}]))
        return calls, [a[:2] for a in _answers(transport)[1:]]
    finally:
        await broker._drain()


@pytest.mark.parametrize("what", ["buffer_updated", "get_buffer", "_plain_send"])
def test_a_subclass_method_or_a_replaced_plain_send_is_called_not_bypassed(what: str) -> None:
    """Review 32a F3, F7: the lane in the instance dict shadowed a subclass's own
    buffer_updated/get_buffer, and called plain_send_parts whatever ``_plain_send`` held.
    Now the lane is installed only under Connection's own methods and takes a read only
    while ``_plain_send`` is the function it was made with: each of 3 sends calls the
    override or the spy, and is answered."""
    directory = short_dir()
    try:
        calls, answers = asyncio.run(_spied(directory / "s", what))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert calls == [what] * 3
    assert answers == [[rid, STATUS_OK] for rid in range(1, 4)]


async def _store_send_changed(directory: Path, how: str) -> tuple[list[str], list[Any], int]:
    """A send through the lane, then the store's send changed (``how``), then two more:
    which send the lane called for those, their answers, the messages stored."""
    calls: list[str] = []
    broker = Broker(directory, ServerConfig(flush="async"))
    await broker.start()
    try:
        store = broker.store
        remembered = store.__dict__["send"]  # the C sender's call (MessageStore.__init__)
        connection, transport = _connect(broker)
        _feed(connection, encode(Hello(client="t").pack()))
        with pytest.MonkeyPatch.context() as patch:

            def spy(topic: str, body: bytes, **kwargs: Any) -> Any:
                calls.append(f"{how} {topic} {body!r}")
                return remembered(topic, body, **kwargs)

            if how == "deleted":  # the class's send, found once the instance's is gone

                def on_class(self: MessageStore, topic: str, body: bytes, **kwargs: Any) -> Any:
                    return spy(topic, body, **kwargs)

                patch.setattr(MessageStore, "send", on_class)
            _feed(connection, encode([1, "send", {"topic": "t", "body": b"1"}]))
            if how == "replaced":  # the dict changed, the type not
                store.__dict__["send"] = spy
            elif how == "deleted":
                del store.__dict__["send"]
            else:  # a data descriptor on the class wins over the instance's dict
                patch.setattr(MessageStore, "send", property(lambda self: spy))
            for rid in (2, 3):
                _feed(connection, encode([rid, "send", {"topic": "t", "body": str(rid).encode()}]))
            stored = sum(len(store.pull("t", q, 0, 100).messages) for q in store.queue_ids("t"))
        return calls, [a[:2] for a in _answers(transport)[1:]], stored
    finally:
        await broker._drain()


@pytest.mark.parametrize("how", ["replaced", "deleted", "property"])
def test_a_store_send_changed_after_the_lane_found_it_is_the_one_called(how: str) -> None:
    """The lane remembers where it found store.send (cext/sendlane.c, store_send: the
    store, its dict and its version, the type's version tag) instead of a generic look-up
    per read: a send replaced in the instance dict, deleted from it (the class's then),
    or shadowed by a data descriptor on the class after the first read is what the
    next reads call, as PyObject_GetAttr would find it."""
    directory = short_dir()
    try:
        calls, answers, stored = asyncio.run(_store_send_changed(directory / "s", how))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert calls == [f"{how} t b'2'", f"{how} t b'3'"]
    assert answers == [[rid, STATUS_OK] for rid in (1, 2, 3)]
    assert stored == 3
