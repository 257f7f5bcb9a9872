"""The asyncio client's coalesced group written in parts (coalesce.PART_SENDS, the
coalescer's ``part``; 0 by default: at the turn's end): a group of a loop turn is written
once it holds ``part`` sends, while the turn's other tasks still run, so the broker
appends it (and starts its fdatasync) meanwhile; the rest of the turn follows as the next
part, or at the turn's end. What each caller gets is unchanged."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from client_helpers import WELCOME, FakeBroker, Peer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import short_dir, short_home

import equeue.aio
from equeue.client.coalesce import BODY_OVERHEAD, PART_SENDS
from equeue.errors import ConnectionLostError
from equeue.protocol.frames import BODIES_VERSION, FRAME_HEADER
from equeue.server import BrokerThread
from equeue.store.types import SendResult

home = pytest.fixture(short_home, name="home")
PART = 16  # (the tests' part: PART_SENDS is 0, off, by default)

Request = tuple[str, str, list[bytes]]  # op, topic, bodies


def _requests(data: bytes) -> Iterator[Request]:
    """The requests of one write (whole frames: the client writes no partial frame)."""
    start = 0
    while start < len(data):
        (length,) = FRAME_HEADER.unpack_from(data, start)
        _, op, args = msgpack.unpackb(data[start + 4 : start + 4 + length])
        start += 4 + length
        yield op, args["topic"], [args["body"]] if op == "send" else list(args["bodies"])


class _Recorder:
    """The connection's transport, its writes recorded with how many sends the turn had
    made by then."""

    def __init__(self, transport: Any, made: list[int]) -> None:
        self._transport = transport
        self._made = made
        self.writes: list[tuple[int, list[Request]]] = []

    def write(self, data: bytes) -> None:
        self.writes.append((self._made[0], list(_requests(bytes(data)))))
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


async def _turn(
    url: str, sends: list[tuple[str, bytes]], part: int
) -> tuple[list[Any], list[tuple[int, list[Request]]]]:
    """``sends`` made by as many tasks in one loop turn on one client whose group is
    written at ``part`` sends; each one's outcome, and the writes with the sends made
    before each."""
    client = await equeue.aio.connect(url, timeout=20)
    try:
        protocol = client._protocol
        assert protocol is not None and protocol.coalescer is not None
        protocol.coalescer.part = part
        made = [0]
        recorder = _Recorder(protocol.transport, made)
        protocol.transport = recorder  # type: ignore[assignment]
        # heard from "now" for the whole turn: the first send goes alone, at once (the
        # direct path), whatever the machine's load (HEARD_RECENTLY is 20 ms)
        protocol.heard = time.monotonic() + 3600

        async def one(topic: str, body: bytes) -> SendResult:
            made[0] += 1
            return await client.send(topic, body)

        async with asyncio.timeout(20):
            outcomes = await asyncio.gather(
                *(one(topic, body) for topic, body in sends), return_exceptions=True
            )
        protocol.transport = recorder._transport
        return list(outcomes), recorder.writes
    finally:
        await client.close()


def _model(
    sends: list[tuple[str, bytes]], part: int, budget: int
) -> list[tuple[int, list[Request]]]:
    """The writes a turn of ``sends`` makes (nothing in flight before it): the first
    alone, at once; the others grouped per topic (a group sealed when it would pass
    ``budget`` bytes of bodies), every group begun so far written when one reaches
    ``part`` sends; what is left at the turn's end."""
    writes: list[tuple[int, list[Request]]] = []
    first_topic, first_body = sends[0]
    writes.append((1, [("send", first_topic, [first_body])]))
    groups: dict[str, tuple[list[bytes], list[int]]] = {}  # bodies, [size]
    begun: list[tuple[str, list[bytes]]] = []  # every group not written, in the order begun

    def emit() -> list[Request]:
        requests = [("send" if len(b) == 1 else "send_bodies", t, b) for t, b in begun]
        begun.clear()
        groups.clear()
        return requests

    for made, (topic, body) in enumerate(sends[1:], start=2):
        group = groups.get(topic)
        if group is not None:
            size = group[1][0] + len(body) + BODY_OVERHEAD
            if size <= budget:
                group[0].append(body)
                group[1][0] = size
                if len(group[0]) == part:
                    writes.append((made, emit()))
                continue
        bodies = [body]
        groups[topic] = (bodies, [len(body) + BODY_OVERHEAD])
        begun.append((topic, bodies))
    if begun:
        writes.append((len(sends), emit()))
    return writes


def test_a_turns_group_is_written_in_parts_while_the_turn_goes_on(home: Path) -> None:
    sends = [("t", f"m{i}".encode()) for i in range(2 * PART + 9)]
    with BrokerThread(home / "store") as broker:
        outcomes, writes = asyncio.run(_turn(broker.urls[0], sends, PART))
        stored = [broker.store.get(o.message_id).body for o in outcomes]
    assert stored == [body for _, body in sends]  # each caller its own send's result
    bodies = [body for _, body in sends]
    # the first alone; a part once the group holds PART (later tasks not yet run);
    # the rest at the turn's end
    assert writes == [
        (1, [("send", "t", bodies[:1])]),
        (1 + PART, [("send_bodies", "t", bodies[1 : 1 + PART])]),
        (1 + 2 * PART, [("send_bodies", "t", bodies[1 + PART : 1 + 2 * PART])]),
        (len(sends), [("send_bodies", "t", bodies[1 + 2 * PART :])]),
    ]


def test_part_0_the_default_writes_the_group_at_the_turns_end(home: Path) -> None:
    assert PART_SENDS == 0
    sends = [("t", f"m{i}".encode()) for i in range(2 * PART + 9)]
    with BrokerThread(home / "store") as broker:
        _, writes = asyncio.run(_turn(broker.urls[0], sends, 0))
    assert [(made, [(op, len(b)) for op, _, b in requests]) for made, requests in writes] == [
        (1, [("send", 1)]),
        (len(sends), [("send_bodies", len(sends) - 1)]),
    ]


# A broker started once for every example (each example connects a client of its own)
@pytest.fixture(scope="module", name="shared_broker")
def _shared_broker() -> Iterator[BrokerThread]:
    directory = short_dir()
    with BrokerThread(directory / "store") as broker:
        for topic in ("t", "u", "v"):
            broker.store.create_topic(topic, 2)
        yield broker
    shutil.rmtree(directory, ignore_errors=True)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    topics=st.lists(st.sampled_from("tuv"), min_size=1, max_size=60),
    sizes=st.lists(st.sampled_from([0, 1, 100, 40_000]), min_size=60, max_size=60),
    part=st.sampled_from([0, 2, 3, 5, 16]),
)
def test_every_send_gets_its_own_result_in_the_parts_the_model_says(
    shared_broker: BrokerThread, topics: list[str], sizes: list[int], part: int
) -> None:
    sends = [
        (t, f"{i}:".encode() + b"x" * size)
        for i, (t, size) in enumerate(zip(topics, sizes[: len(topics)], strict=True))
    ]
    outcomes, writes = asyncio.run(_turn(shared_broker.urls[0], sends, part))
    assert all(type(o) is SendResult for o in outcomes), outcomes
    store = shared_broker.store
    assert [
        (store.get(o.message_id).topic, store.get(o.message_id).body) for o in outcomes
    ] == sends
    budget = shared_broker.broker.config.max_frame_bytes // 2
    assert writes == _model(sends, part, budget)


def test_a_broken_connection_fails_each_part_as_unanswered() -> None:
    # Parts written before the break: each of their callers' ConnectionLostError has its
    # own message as `unanswered` (written: it may be stored), as for a whole group.
    count = 2 * PART + 1
    seen: list[Any] = []

    def script(peer: Peer) -> None:
        peer.recv()
        peer.send({**WELCOME, "version": BODIES_VERSION})
        seen.extend(peer.recv()[1] for _ in range(3))  # the send, then the two parts
        # closed without an answer

    async def run(url: str) -> list[Any]:
        client = await equeue.aio.connect(url, timeout=5, connect_timeout=1)
        try:
            protocol = client._protocol
            assert protocol is not None and protocol.coalescer is not None
            protocol.coalescer.part = PART
            protocol.heard = time.monotonic() + 3600
            async with asyncio.timeout(10):
                return list(
                    await asyncio.gather(
                        *(client.send("t", b"%d" % i) for i in range(count)),
                        return_exceptions=True,
                    )
                )
        finally:
            await client.close()

    with FakeBroker(script) as fake:
        outcomes = asyncio.run(run(fake.url))
    assert seen == ["send", "send_bodies", "send_bodies"]
    for index, outcome in enumerate(outcomes):
        assert isinstance(outcome, ConnectionLostError), outcome
        assert [m.body for m in outcome.unanswered] == [b"%d" % index]
        assert outcome.unsent == []


def test_a_part_refused_whole_is_sent_again_one_by_one_and_the_others_stand(home: Path) -> None:
    # A body past the store's max_message_size in the first part: that part is refused
    # whole (nothing of it stored) and its sends go again one by one; the other parts are
    # stored as sent.
    bodies = [b"%d" % i for i in range(2 * PART + 3)]
    bodies[5] = b"x" * (5 << 20)
    with BrokerThread(home / "store") as broker:
        outcomes, writes = asyncio.run(_turn(broker.urls[0], [("t", b) for b in bodies], PART))
        stored = {broker.store.get(o.message_id).body for o in outcomes if type(o) is SendResult}
    assert [type(o).__name__ for o in outcomes] == [
        "MessageTooLargeError" if i == 5 else "SendResult" for i in range(len(bodies))
    ]
    assert stored == set(bodies) - {bodies[5]}
    assert [len(b) for _, requests in writes[:3] for _, _, b in requests] == [
        1,
        PART,
        PART,
    ]
