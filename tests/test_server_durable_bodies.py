"""A ``send_bodies`` under ``--flush sync`` (the asyncio client's coalesced sends: one
client shared by many tasks) waits for its fdatasync as its whole answer frame, a Frame,
so the group commit's release answers it in C (cext/release.c, release_frames) as it
answers plain sends, not answer by answer in Python (release._release_each: finish,
_answer, a header packed, a join, a write). Its bytes are the ones ``--flush async``
answers at once. The requests are fed to a real Broker's Connection as a socket read
would (test_server_fastsend.py's way); the store, the fdatasync and the C flusher are
real."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
from server_helpers import short_dir
from test_server_fastsend import Recorder, _feed

from equeue import speedups
from equeue.protocol.frames import STATUS_OK, FrameReader, encode
from equeue.protocol.handshake import Hello
from equeue.server import release
from equeue.server.config import ServerConfig
from equeue.server.connection import Connection
from equeue.server.serve import Broker

pytestmark = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="release_frames is C")
LIMIT_S = 10.0
BODIES = [b"first", b"second", b"third"]


async def _answer(directory: Path, flush: str) -> tuple[list[Any], int, int]:
    """The answer to one send_bodies, the connection's in_flight after it, and the
    flushed batches release._release_each answered."""
    answered_each = []
    each = release._release_each

    def spy(batch: list[Any], error: BaseException | None) -> None:
        answered_each.append(len(batch))
        each(batch, error)

    broker = Broker(directory, ServerConfig(flush=flush))  # type: ignore[arg-type]
    await broker.start()
    try:
        release._release_each = spy
        connection = Connection(broker, "test", 1)
        transport = Recorder()
        transport.protocol = connection
        connection.connection_made(transport)  # type: ignore[arg-type]
        _feed(connection, encode(Hello(client="t").pack()))
        transport.data.clear()  # the welcome
        _feed(connection, encode([6, "send_bodies", {"topic": "t", "bodies": BODIES}]))
        deadline = time.monotonic() + LIMIT_S
        while not transport.data and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        frames = FrameReader(1 << 20, "t").feed(bytes(transport.data))
        return [msgpack.unpackb(f) for f in frames], connection.in_flight, len(answered_each)
    finally:
        release._release_each = each
        await broker._drain()


def test_a_durable_send_bodies_is_answered_as_a_frame_by_the_c_release() -> None:
    directory = short_dir()
    try:
        synced, in_flight, answered_each = asyncio.run(_answer(directory / "sync", "sync"))
        at_once, _, _ = asyncio.run(_answer(directory / "async", "async"))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert len(synced) == 1 and synced[0][:2] == [6, STATUS_OK]
    assert answered_each == 0  # not answer by answer in Python
    assert in_flight == 0
    # the same answer as --flush async's, but for what differs between two stores: the
    # store id heading each message id, the stored times
    assert _same_store_free(synced[0][2]) == _same_store_free(at_once[0][2])
    topic, ids, queues, offsets, positions, times = synced[0][2]
    assert (topic, queues, offsets, len(ids), len(times)) == ("t", [0, 1, 2], [0, 0, 0], 3, 3)
    assert positions[0] == 0 and positions == sorted(positions)


def _same_store_free(columns: list[Any]) -> list[Any]:
    topic, ids, queues, offsets, positions, _times = columns
    return [topic, [i[8:] for i in ids], queues, offsets, positions]
