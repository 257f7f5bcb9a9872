"""Answer.answered's plain case in C (equeue/cext/groupanswer.c) against the Python
``answered_slow`` it replaces: the same answers, on a connection of the real ClientConn
type, leave the same futures, places, columns, scheduled writes and failures. The C
method hands every case it does not take to ``answered_slow`` before it changes
anything; the counts below show which cases it took."""

from __future__ import annotations

import asyncio
from collections import deque
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import short_home

import equeue.aio
from equeue import speedups
from equeue.client import aio, coalesce
from equeue.client.coalesce import Answer, Coalescer
from equeue.errors import EQueueError, StoreWriteError
from equeue.protocol.faults import pack_error
from equeue.protocol.plainsend import conn_type
from equeue.server import BrokerThread

pytestmark = pytest.mark.skipif(
    speedups.SPEEDUPS is None or conn_type is None,
    reason="the C accelerator is not built (or EQUEUE_PURE_PYTHON is set)",
)
home = pytest.fixture(short_home, name="home")
REQUEST_ID = 7


class _Reader:
    def __init__(self, columns: set[int]) -> None:
        self.columns = columns


def _protocol_type() -> type:
    assert conn_type is not None

    class Protocol(conn_type):  # type: ignore[misc,valid-type]
        """The fields and calls of aio.py's _Protocol that answered reads and makes."""

        def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
            self.loop, self.where, self.max_in_flight = loop, "fake", 1000
            self.queued: deque[asyncio.Future[None]] = deque()
            self.reader = _Reader({REQUEST_ID, 99})
            self.flushing, self.closed, self.free = False, False, 10
            self.calls: list[Any] = []

        def schedule(self) -> None:
            self.calls.append(("schedule", self.flushing))
            self.flushing = True

        def give_back(self, places: int) -> None:
            self.free += places
            for _ in range(min(places, len(self.queued))):
                waiter = self.queued.popleft()
                if not waiter.done():
                    waiter.set_result(None)

        def fail(self, reason: str, cause: BaseException | None) -> None:
            self.calls.append(("fail", reason))
            self.closed = True

    return Protocol


class _Counted(Answer):
    __slots__ = ("slow",)
    slow: int

    def answered_slow(self, status: int, payload: Any) -> None:
        self.slow += 1
        super().answered_slow(status, payload)


class _PyCounted(_Counted):
    __slots__ = ()
    answered = _Counted.answered_slow


def _outcome(future: asyncio.Future[Any]) -> Any:
    if not future.done():
        return "pending"
    if future.cancelled():
        return "cancelled"
    error = future.exception()
    return future.result() if error is None else (type(error).__name__, str(error))


def _play(kind: type[_Counted], count: int, status: int, payload_shape: str, extra: int,
          cancelled: int, queued: int, flushing: bool, closed: bool) -> Any:  # fmt: skip
    async def run() -> Any:
        loop = asyncio.get_running_loop()
        protocol = _protocol_type()(loop)
        protocol.flushing, protocol.closed = flushing, closed
        coalescer = Coalescer(protocol, 10_000, 100)
        futures = [speedups.SPEEDUPS.group_future(protocol) for _ in range(count)]  # type: ignore[union-attr]
        seen: list[Any] = []  # what each caller's task saw as it woke: inside flushing?

        async def caller(future: asyncio.Future[Any]) -> None:
            try:
                await future
            except asyncio.CancelledError:
                seen.append("cancelled")
                return
            except EQueueError as error:
                seen.append(type(error).__name__)
                return
            seen.append(protocol.flushing)

        tasks = [loop.create_task(caller(future)) for future in futures]
        await asyncio.sleep(0)  # (each waits on its future)
        for future in futures[:cancelled]:
            future.cancel()
        waiting = [loop.create_future() for _ in range(queued)]
        protocol.queued.extend(waiting)
        answer = kind(coalescer, "t", [b"%d" % i for i in range(count)], futures, None, REQUEST_ID)
        answer.slow = 0
        results = [f"result {i}" for i in range(count + extra)]
        payload: Any = (results,) if payload_shape == "tuple" else results
        # from a callback of the loop, as a read is: the callers' tasks run at once there
        loop.call_soon(answer.answered, status, payload)
        for _ in range(3):
            await asyncio.sleep(0)  # (what was scheduled runs)
        await asyncio.gather(*tasks)
        return (
            [_outcome(f) for f in futures],
            seen,
            [w.done() for w in waiting],
            protocol.free,
            sorted(protocol.reader.columns),
            protocol.flushing,
            protocol.calls,
            answer.slow,
        )

    return asyncio.run(run())


@settings(max_examples=200, deadline=None)
@given(
    count=st.integers(1, 5),
    payload_shape=st.sampled_from(["tuple", "list"]),
    extra=st.sampled_from([0, 0, 0, -1, 1]),
    cancelled=st.integers(0, 2),
    queued=st.sampled_from([0, 0, 1, 3]),
    flushing=st.booleans(),
    closed=st.sampled_from([False, False, True]),
)
def test_the_c_answered_leaves_what_the_python_answered_leaves(
    count: int, payload_shape: str, extra: int, cancelled: int, queued: int,
    flushing: bool, closed: bool,
) -> None:  # fmt: skip
    shape = (count, 0, payload_shape, extra, min(cancelled, count), queued, flushing, closed)
    *c_state, c_slow = _play(_Counted, *shape)
    *py_state, py_slow = _play(_PyCounted, *shape)
    assert c_state == py_state
    plain = count > 1 and payload_shape == "tuple" and extra == 0 and queued == 0
    assert (c_slow, py_slow) == (0 if plain else 1, 1)


def test_the_c_answered_gives_each_caller_its_result_and_schedules_the_turns_write() -> None:
    outcomes, seen, _, free, columns, flushing, calls, slow = _play(
        _Counted, 3, 0, "tuple", 0, 1, 0, False, False
    )
    assert outcomes == ["cancelled", "result 1", "result 2"]
    assert seen == ["cancelled", True, True]  # run at once, inside flushing
    assert (free, columns, slow) == (12, [99], 0)  # two places back: the third is answers'
    # woken inside flushing (their next sends: one group), then the write scheduled
    assert calls == [("schedule", False)] and flushing is True


def test_a_closed_connection_schedules_no_write() -> None:
    *_, flushing, calls, slow = _play(_Counted, 2, 0, "tuple", 0, 0, 0, False, True)
    assert (flushing, calls, slow) == (False, [], 0)


def test_an_error_answer_goes_to_answered_slow() -> None:
    async def run() -> tuple[int, list[Any]]:
        protocol = _protocol_type()(asyncio.get_running_loop())
        coalescer = Coalescer(protocol, 10_000, 100)
        futures = [asyncio.get_running_loop().create_future() for _ in range(2)]
        answer = _Counted(coalescer, "t", [b"a", b"b"], futures, None, REQUEST_ID)
        answer.slow = 0
        answer.answered(1, pack_error(StoreWriteError("disk gone")))
        return answer.slow, [type(f.exception()).__name__ for f in futures]

    slow, errors = asyncio.run(run())
    assert slow == 1 and errors == ["StoreWriteError", "StoreWriteError"]


def test_answered_called_with_other_than_two_arguments_raises_type_error() -> None:
    async def run() -> None:
        protocol = _protocol_type()(asyncio.get_running_loop())
        answer = _Counted(Coalescer(protocol, 1000, 100), "t", [b"a"], [], None, REQUEST_ID)
        answer.slow = 0
        calls: list[tuple[Any, ...]] = [(0,), (0, (["r"],), None), ()]
        for args in calls:
            with pytest.raises(TypeError):
                answer.answered(*args)
        assert answer.slow == 0 and protocol.free == 10

    asyncio.run(run())


def test_a_shared_clients_groups_are_answered_in_c(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 16 tasks sharing one client against a real broker: every send stored once, each
    # caller its own result, and the groups' answers given in C (answered_slow only for
    # a group of one, if any)
    slow_counts: list[int] = []
    answered_slow = Answer.answered_slow

    def counted(self: Answer, status: int, payload: Any) -> None:
        slow_counts.append(len(self.futures))
        answered_slow(self, status, payload)

    monkeypatch.setattr(Answer, "answered_slow", counted)

    async def run(url: str) -> tuple[list[Any], int]:
        async with await equeue.aio.connect(url, timeout=20) as client:

            async def one(task: int) -> list[Any]:
                return [await client.send("t", b"%d.%d" % (task, n)) for n in range(20)]

            done = await asyncio.gather(*(one(task) for task in range(16)))
            protocol = client._protocol
            assert protocol is not None
            return [r for rs in done for r in rs], protocol.free

    with BrokerThread(home / "store") as broker:
        broker.store.create_topic("t", 4)
        results, free = asyncio.run(run(broker.urls[0]))
        bodies = sorted(broker.store.get(r.message_id).body for r in results)
    assert bodies == sorted(b"%d.%d" % (t, n) for t in range(16) for n in range(20))
    assert len({r.message_id for r in results}) == 320
    assert all(count == 1 for count in slow_counts)
    assert free > 0
    assert coalesce.Answer.answered is not coalesce.Answer.answered_slow


def test_a_groups_answer_alone_in_a_read_is_taken_without_the_python_read(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # clientconn.c's group_read: a read holding one group's answer is given to its Answer
    # without data_received (and AnswerReader.feed); each caller still gets its own send's
    # result (the body stored under its message id is the one it sent)
    reading: list[bool] = [False]
    groups: list[tuple[int, bool]] = []  # (sends in the group, read by data_received?)
    data_received = aio._Protocol.data_received
    answered = Answer.answered

    def spied_read(self: Any, data: Any) -> None:
        reading[0] = True
        try:
            data_received(self, data)
        finally:
            reading[0] = False

    def spied_answered(self: Answer, status: int, payload: Any) -> None:
        groups.append((len(self.futures), reading[0]))
        answered(self, status, payload)

    monkeypatch.setattr(aio._Protocol, "data_received", spied_read)
    monkeypatch.setattr(Answer, "answered", spied_answered)

    async def run(url: str) -> list[tuple[bytes, Any]]:
        async with await equeue.aio.connect(url, timeout=20) as client:

            async def one(task: int) -> list[tuple[bytes, Any]]:
                sent = []
                for n in range(20):
                    body = b"%d.%d" % (task, n)
                    sent.append((body, await client.send("t", body)))
                return sent

            done = await asyncio.gather(*(one(task) for task in range(16)))
            protocol = client._protocol
            assert protocol is not None
            # every place back, nothing left in flight or in the reader's columns
            left.extend([protocol.free - protocol.max_in_flight, len(protocol.pending)])
            left.append(len(protocol.reader.columns))
            return [pair for pairs in done for pair in pairs]

    left: list[int] = []
    with BrokerThread(home / "store") as broker:
        broker.store.create_topic("t", 4)
        sent = asyncio.run(run(broker.urls[0]))
        stored = [broker.store.get(result.message_id).body for _, result in sent]
    assert stored == [body for body, _ in sent]
    assert any(count > 1 and not read for count, read in groups)
    assert left == [0, 0, 0]


def test_two_groups_answered_in_one_read_each_get_their_answers(home: Path) -> None:
    # review15 R15-1: group_read takes a read only when it is exactly one frame. Two topics
    # make two groups a turn, and under --flush sync one fdatasync releases both answers,
    # written together: a read holding both must give each group's callers their results
    # (group_read loosened to "at least one frame" answered the first and left the
    # second's callers waiting for ever: the wait_for below fails then)
    async def run(url: str) -> tuple[list[Any], list[int]]:
        async with await equeue.aio.connect(url, timeout=20) as client:

            async def one(task: int) -> list[Any]:
                topic = "t" if task % 2 else "u"
                return [await client.send(topic, b"%d.%d" % (task, n)) for n in range(30)]

            done = await asyncio.wait_for(asyncio.gather(*(one(t) for t in range(16))), 30)
            protocol = client._protocol
            assert protocol is not None
            left = [protocol.free - protocol.max_in_flight, len(protocol.pending)]
            return [r for rs in done for r in rs], [*left, len(protocol.reader.columns)]

    with BrokerThread(home / "store", flush="sync") as broker:
        for topic in ("t", "u"):
            broker.store.create_topic(topic, 2)
        results, left = asyncio.run(run(broker.urls[0]))
        bodies = sorted(broker.store.get(r.message_id).body for r in results)
    assert bodies == sorted(b"%d.%d" % (t, n) for t in range(16) for n in range(30))
    assert left == [0, 0, 0]


def _columns_frame(rid: int, count: int) -> bytes:
    ids = [f"abcdefgh{p:016x}" for p in range(count)]
    value = ["t", ids, [0] * count, list(range(count)), list(range(count)), [1.5e9] * count]
    body: bytes = msgpack.packb([rid, 0, value], use_bin_type=True)
    return len(body).to_bytes(4, "big") + body


class _Given(Answer):
    __slots__ = ()

    def answered(self, status: int, payload: Any) -> None:
        pass


def test_no_memory_in_group_read_raises_memory_error_not_system_error() -> None:
    # review15 R15-2: group_read released its memoryview of the read (a method call) with
    # columns_answer's MemoryError still set; CPython's call check then raised SystemError
    # in its place. Each allocation of the read is made to fail in turn (_testcapi's
    # seam): what comes out is the MemoryError, or the read is taken whole (by C, or by
    # the general read), never a SystemError (allocations 2-8 gave one before the fix).
    _testcapi = pytest.importorskip("_testcapi")
    frame = _columns_frame(REQUEST_ID, 3)
    outcomes: dict[str, int] = {}
    for failing in range(60):
        protocol = _protocol_type()(None)
        protocol.data_received = lambda data: None
        inbuf = bytearray(1024)
        inbuf[: len(frame)] = frame
        protocol.inbuf, protocol.pending = memoryview(inbuf), {}
        protocol.coalescer, protocol.welcomed, protocol.heard = 1, True, 0.0
        protocol.limit = 1 << 20
        protocol.reader._buffer = bytearray()
        protocol.pending[REQUEST_ID] = (_Given.__new__(_Given), None, None)
        _testcapi.set_nomemory(failing, failing + 1)
        try:
            protocol.buffer_updated(len(frame))
            outcome = "taken" if REQUEST_ID not in protocol.pending else "read generally"
        except MemoryError:
            outcome = "MemoryError"
        except SystemError as error:
            outcome = f"SystemError at allocation {failing}: {error}"
        finally:
            _testcapi.remove_mem_hooks()
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert set(outcomes) <= {"taken", "read generally", "MemoryError"}, outcomes
    assert outcomes.get("MemoryError", 0) > 0 and outcomes.get("taken", 0) > 0
