"""Coalescer.add's per-send cases in C (equeue/cext/coalesceadd.c) against the Python
``add_slow`` they replace: the same script of sends, on a connection of the real
ClientConn type, leaves the same groups, sealed groups, places, scheduled writes, parts
and errors. The C add hands every case it does not take to ``add_slow`` before it
changes anything; the counts below show which cases it took."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import short_home

import equeue.aio
from equeue import speedups
from equeue.client import coalesce, core
from equeue.client.coalesce import BODY_OVERHEAD, Coalescer
from equeue.errors import EQueueError, WrongLoopError
from equeue.protocol.plainsend import conn_type
from equeue.protocol.records import columns_answer
from equeue.server import BrokerThread

pytestmark = pytest.mark.skipif(
    speedups.SPEEDUPS is None or conn_type is None,
    reason="the C accelerator is not built (or EQUEUE_PURE_PYTHON is set)",
)
home = pytest.fixture(short_home, name="home")


def _protocol_type() -> type:
    assert conn_type is not None

    class Protocol(conn_type):  # type: ignore[misc,valid-type]
        """The fields and calls of aio.py's _Protocol that add reads and makes."""

        def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
            self.loop, self.where, self.max_in_flight = loop, "fake", 1000
            self.pending: dict[int, Any] = {1: "a request in flight"}
            self.flushing, self.closed, self.free = False, False, 1000
            self.heard = 0.0
            self.calls: list[str] = []

        def schedule(self) -> None:
            self.calls.append("schedule")
            self.flushing = True

        def write_out(self) -> None:
            self.calls.append("write_out")

        def write_now(self) -> None:
            self.calls.append("write_now")

    return Protocol


class _Recorded(Coalescer):
    """Requests recorded instead of encoded and put in flight."""

    def __init__(self, protocol: Any, max_frame_bytes: int, most: int) -> None:
        super().__init__(protocol, max_frame_bytes, most)
        self.requests: list[tuple[str, list[bytes], int]] = []
        self.slow = 0

    def _request(self, topic: str, bodies: list[bytes], futures: list[Any], givens: Any) -> None:
        self.requests.append((topic, list(bodies), len(futures)))

    def add_slow(self, topic: str, body: bytes) -> asyncio.Future[Any] | None:
        self.slow += 1
        return super().add_slow(topic, body)


class _PyRecorded(_Recorded):
    """The same, every send through the Python code (the fallback's add)."""

    add = _Recorded.add_slow


def _state(coalescer: _Recorded, protocol: Any) -> Any:
    def group(g: Any) -> Any:
        return list(g.bodies), len(g.futures), g.size

    return (
        {topic: group(g) for topic, g in coalescer.groups.items()},
        [(topic, group(g)) for topic, g in coalescer.sealed],
        coalescer.requests,
        protocol.free,
        protocol.flushing,
        protocol.calls,
    )


Step = tuple[str, Any]  # ("send", (topic, body)), ("emit", None), ("idle", None)


def _play(kind: type[_Recorded], steps: list[Step], budget: int, most: int, part: int) -> Any:
    async def run() -> Any:
        protocol = _protocol_type()(asyncio.get_running_loop())
        coalescer = kind(protocol, budget * 2, most)
        coalescer.part = part
        outcomes: list[Any] = []
        for step, arg in steps:
            if step == "send":
                future = coalescer.add(*arg)
                outcomes.append(None if future is None else future.done())
            elif step == "emit":
                coalescer.emit()
                protocol.flushing = False
            else:  # nothing in flight now, and heard from just now: the lone case
                protocol.pending.clear()
                protocol.heard = 1e18
        return outcomes, _state(coalescer, protocol), coalescer.slow

    return asyncio.run(run())


_sends = st.tuples(st.sampled_from(["t", "u"]), st.binary(max_size=40))
_steps = st.lists(
    st.one_of(
        st.tuples(st.just("send"), _sends),
        st.tuples(st.just("emit"), st.none()),
        st.tuples(st.just("idle"), st.none()),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(
    steps=_steps,
    budget=st.integers(BODY_OVERHEAD, 120),
    most=st.integers(1, 6),
    part=st.integers(0, 4),
)
def test_the_c_add_leaves_what_the_python_add_leaves(
    steps: list[Step], budget: int, most: int, part: int
) -> None:
    c_outcomes, c_state, _ = _play(_Recorded, steps, budget, most, part)
    py_outcomes, py_state, _ = _play(_PyRecorded, steps, budget, most, part)
    assert c_outcomes == py_outcomes
    assert c_state == py_state


def test_the_c_add_takes_the_sends_that_join_or_begin_a_group() -> None:
    # 1 + 3 sends to t fit (budget: 4 bodies of 10 and their headers), the 5th seals the
    # group and begins the next; u begins its own while t's is open (a write is due)
    budget = 4 * (10 + BODY_OVERHEAD)
    steps: list[Step] = [("send", ("t", b"x" * 10)) for _ in range(5)]
    steps.append(("send", ("u", b"y")))
    outcomes, (groups, sealed, requests, free, flushing, calls), slow = _play(
        _Recorded, steps, budget, 100, 0
    )
    assert outcomes == [False] * 6
    assert groups == {"t": ([b"x" * 10], 1, 15), "u": ([b"y"], 1, 6)}
    assert sealed == [("t", ([b"x" * 10] * 4, 4, budget))]
    assert (requests, free, flushing, calls) == ([], 994, True, ["schedule"])
    assert slow == 1  # only the send that sealed t's group


def test_the_c_add_writes_a_part_at_part_sends() -> None:
    steps: list[Step] = [("send", ("t", bytes([i]))) for i in range(5)]
    _, (groups, sealed, requests, free, _, calls), slow = _play(_Recorded, steps, 1000, 100, 3)
    assert requests == [("t", [b"\x00", b"\x01", b"\x02"], 3)]
    assert groups == {"t": ([b"\x03", b"\x04"], 2, 2 + 2 * BODY_OVERHEAD)} and not sealed
    assert calls == ["schedule", "write_out"] and free == 995 and slow == 0


def test_the_lone_send_of_an_idle_connection_goes_to_add_slow() -> None:
    steps: list[Step] = [("idle", None), ("send", ("t", b"a")), ("send", ("t", b"b"))]
    _, (groups, sealed, requests, free, _, calls), slow = _play(_Recorded, steps, 1000, 100, 0)
    # each alone, written at once (the fake's _request puts nothing in flight, so the
    # second finds the connection idle too)
    assert slow == 2 and requests == [("t", [b"a"], 1), ("t", [b"b"], 1)]
    assert calls == ["write_now", "write_now"] and free == 998 and not groups and not sealed


def _on_another_loop(add: Callable[[Any, str, bytes], Any]) -> tuple[str, Any]:
    other = asyncio.new_event_loop()
    try:
        protocol = _protocol_type()(other)
    finally:
        other.close()

    async def run() -> tuple[str, Any]:
        coalescer = _Recorded(protocol, 1000, 100)
        coalescer.groups["t"] = coalesce._Group(b"z", asyncio.get_running_loop().create_future())
        with pytest.raises(WrongLoopError) as raised:
            add(coalescer, "t", b"a")
        # (the loops' addresses differ from run to run)
        return re.sub("0x[0-9a-f]+", "0x", str(raised.value)), _state(coalescer, protocol)

    return asyncio.run(run())


def test_a_send_from_another_loop_is_refused_and_changes_nothing() -> None:
    message, state = _on_another_loop(Coalescer.add)
    py_message, py_state = _on_another_loop(Coalescer.add_slow)
    assert message == py_message and "fake" in message
    assert state == py_state
    groups, sealed, requests, free, _, calls = state
    assert groups == {"t": ([b"z"], 1, 1 + BODY_OVERHEAD)} and free == 1000
    assert not sealed and not requests and not calls


def test_a_body_not_exactly_bytes_goes_to_add_slow() -> None:
    steps: list[Step] = [("send", ("t", b"a")), ("send", ("t", bytearray(b"b")))]
    _, (groups, *_), slow = _play(_Recorded, steps, 1000, 100, 0)
    assert slow == 1 and groups == {"t": ([b"a", bytearray(b"b")], 2, 2 + 2 * BODY_OVERHEAD)}


def _shared_sends(url: str, topic: str, tasks: int, rounds: int) -> tuple[list[Any], set[int]]:
    """``tasks`` tasks sharing one client, ``rounds`` sends each: what each send gave (a
    SendResult or the error), and the request ids left in the reader's columns."""

    async def run() -> tuple[list[Any], set[int]]:
        async with await equeue.aio.connect(url, timeout=20) as client:

            async def one(task: int) -> list[Any]:
                out: list[Any] = []
                for n in range(rounds):
                    try:
                        out.append(await client.send(topic, b"%d.%d" % (task, n)))
                    except EQueueError as exc:
                        out.append(exc)
                return out

            done = await asyncio.gather(*(one(task) for task in range(tasks)))
            protocol = client._protocol
            assert protocol is not None
            return [r for rs in done for r in rs], set(protocol.reader.columns)

    return asyncio.run(run())


def test_a_coalesced_groups_answer_is_read_in_c(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The group's send_bodies answer is read from the frame's bytes (columns_answer),
    # not decoded by msgpack first; its request id leaves the reader's set once answered
    read: list[int] = []

    def counted(payload: Any, request_ids: set[int]) -> Any:
        body = columns_answer(payload, request_ids)
        if body is not None:
            read.append(len(body[2][0]))
        return body

    monkeypatch.setattr(core, "columns_answer", counted)
    with BrokerThread(home / "store") as broker:
        broker.store.create_topic("t", 4)
        results, left = _shared_sends(broker.urls[0], "t", 8, 5)
        bodies = sorted(broker.store.get(r.message_id).body for r in results)
    assert bodies == sorted(b"%d.%d" % (t, n) for t in range(8) for n in range(5))
    assert read and sum(read) <= 40 and min(read) > 1
    assert left == set()


def test_a_refused_groups_id_leaves_the_readers_columns(home: Path) -> None:
    with BrokerThread(home / "store") as broker:
        results, left = _shared_sends(broker.urls[0], "no/such topic", 6, 3)
    assert len(results) == 18 and all(isinstance(r, EQueueError) for r in results)
    assert len({id(r) for r in results}) == 18  # (each caller its own)
    assert left == set()


def test_add_called_with_other_than_two_arguments_raises_type_error() -> None:
    async def run() -> None:
        protocol = _protocol_type()(asyncio.get_running_loop())
        coalescer = _Recorded(protocol, 1000, 100)
        calls: list[tuple[Any, ...]] = [("t",), ("t", b"a", b"b"), ()]
        for args in calls:
            with pytest.raises(TypeError):
                coalescer.add(*args)
        assert coalescer.groups == {} and protocol.free == 1000 and coalescer.slow == 0

    asyncio.run(run())
