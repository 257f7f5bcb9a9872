"""A connection's end on shared rings (a client's half-close at the broker, the broker's
socket end at the client): what its peer published before the end is all read, and none
of the group's other rings is read with it (review9 R9-2: the end's unbudgeted drain(-1)
read every ring of the group, a flooding ring 16 reads x 4 passes at each half-close)."""

from __future__ import annotations

import os
import secrets
import socket
import time
from typing import Any

import pytest
from shm_helpers import RawShm
from test_shm import _answers_until_the_end, _broker, _frames, _mux, _url

from equeue.protocol import shmrings
from equeue.protocol.frames import FRAME_HEADER, encode
from equeue.server import BrokerThread

pytestmark = pytest.mark.skipif(not shmrings.AVAILABLE, reason="needs the C accelerator, Linux")

DEADLINE_S = 20.0


@pytest.fixture(name="broker")
def _default_broker() -> Any:
    yield from _broker()


class _Reader:
    """A ring's protocol that takes whole reads and, while ``refills`` lasts, puts as
    much again in its ring (a producer as fast as the reader)."""

    def __init__(self, size: int, refill: Any, refills: int) -> None:
        self.buffer = bytearray(size)
        self.taken = 0
        self.refill = refill
        self.refills = refills

    def get_buffer(self, hint: int) -> memoryview:
        return memoryview(self.buffer)

    def buffer_updated(self, n: int) -> None:
        self.taken += n
        if self.refills > 0:
            self.refills -= 1
            self.refill()


def _pair(ring_bytes: int) -> tuple[Any, Any]:
    total = shmrings.region_bytes(ring_bytes)
    fd = os.memfd_create("t", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, total)
        client = shmrings.ShmRing(fd, total, shmrings.CLIENT)
        client.waker = shmrings.ShmWaker(-1, lambda fire: fire())  # (no wake-ups needed)
        return client, shmrings.ShmRing(fd, total, shmrings.BROKER)
    finally:
        os.close(fd)


def test_drain_ring_reads_that_ring_past_a_budget_and_no_other() -> None:
    """Ring A refilled on every read (the N10 flood), ring B holding more than a drain's
    budget (256 KiB) before its end: drain_ring(B) takes all of B and nothing of A; a B
    that keeps refilling (a hostile peer writing after its end) stops at 16 reads x 4
    passes."""
    ring_bytes = 1 << 16
    (a_client, a_broker), (b_client, b_broker) = _pair(ring_bytes), _pair(ring_bytes)
    a_broker.protocol = _Reader(ring_bytes, lambda: a_client.put(b"a" * ring_bytes), 1 << 30)
    b_broker.protocol = _Reader(ring_bytes, lambda: b_client.put(b"b" * ring_bytes), 6)
    mux, scheduled = _mux(a_broker, b_broker)
    a_client.put(b"a" * ring_bytes)
    b_client.put(b"b" * ring_bytes)
    mux.drain_ring(b_broker)
    assert b_broker.protocol.taken == 7 * ring_bytes  # (448 KiB: past one budget)
    assert a_broker.protocol.taken == 0
    assert scheduled == [] and mux.drains == 0 and mux.ring_drains == 1
    # the group's own drain still takes A, a budget's worth
    mux.drain(-1)
    assert a_broker.protocol.taken == 4 * ring_bytes
    # a B that refills for ever: bounded
    b_broker.protocol = _Reader(ring_bytes, lambda: b_client.put(b"b" * ring_bytes), 1 << 30)
    b_client.put(b"b" * ring_bytes)
    mux.drain_ring(b_broker)
    assert b_broker.protocol.taken == 64 * ring_bytes
    with pytest.raises(TypeError, match="takes a ShmRing"):
        mux.drain_ring(object())


def _sends(first_id: int, count: int, body: bytes) -> bytes:
    return b"".join(
        encode([first_id + i, "send", {"topic": "t", "body": body}]) for i in range(count)
    )


def test_a_half_close_reads_its_own_ring_and_not_the_groups_others(broker: BrokerThread) -> None:
    """Two raw connections of one group, each publishing without a wake-up: A 200 sends,
    B one send and then its half-close. The broker's read at B's end answers B's send
    and leaves A's requests where they are (it read them all, in place, before); A's
    wake-up then has the group's drain read them."""
    path = _url(broker)[5:]
    group = secrets.token_hex(8)
    quiet, closing = RawShm(path, group), RawShm(path, group)
    try:
        for peer in (quiet, closing):  # (publish only: no wake-up byte on the group's socket)
            peer.ring.waker = shmrings.ShmWaker(-1, lambda fire: fire())
        waiting = _sends(1, 200, b"q" * 100)
        assert quiet.write(waiting) == len(waiting)
        room = quiet.ring.room()
        assert room == quiet.ring_bytes - len(waiting)
        last = _sends(1, 1, b"closing")
        assert closing.write(last) == len(last)
        closing.sock.shutdown(socket.SHUT_WR)
        answers = _frames(_answers_until_the_end(closing))
        assert len(answers) == 1
        assert quiet.ring.room() == room  # (was: the ring read empty, 200 sends stored)
        assert broker.store.queue_range("t", 0) == (0, 1)
        quiet.wake()
        deadline = time.monotonic() + DEADLINE_S
        got = b""
        while len(_complete(got)) < 200 and time.monotonic() < deadline:
            got += quiet.read_all()
            time.sleep(0.005)
        assert len(_complete(got)) == 200
        assert broker.store.queue_range("t", 0) == (0, 201)
    finally:
        quiet.close()
        closing.close()


def _complete(data: bytes) -> list[bytes]:
    """The whole frames at the start of ``data`` (answers still arriving)."""
    frames, at = [], 0
    while at + 4 <= len(data):
        (length,) = FRAME_HEADER.unpack_from(data, at)
        if at + 4 + length > len(data):
            break
        frames.append(data[at + 4 : at + 4 + length])
        at += 4 + length
    return frames
