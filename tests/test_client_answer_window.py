"""The window between a request's entry leaving the asyncio client's ``pending`` and its
callers' answers (review15 R15-3): the read takes the entry (clientconn.c's answered and
group_read, aio.py's _answers), then gives each caller its result. Two things can happen
inside it. An error (no memory, an interrupt): the read raises, the transport ends the
connection, and fail() answers what is in ``pending``; the entry must be there again
while a caller waits, or that caller waits for ever. A caller's task, run at once inside
the read (groupwake.c), closing the client: fail() runs in the window; the group's other
callers, no longer in ``pending``, get their results (the broker's answer is in hand),
once each."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import msgpack
import pytest

from equeue import speedups
from equeue.client import aio
from equeue.client.coalesce import Answer, Coalescer
from equeue.client.loops import future_of
from equeue.errors import ConnectionLostError
from equeue.protocol.plainsend import conn_type

REQUEST_ID = 7
IN_C = speedups.SPEEDUPS is not None and conn_type is not None


class _Transport:
    def write(self, data: bytes) -> None:
        pass

    def abort(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


def _frame(value: Any) -> bytes:
    body: bytes = msgpack.packb([REQUEST_ID, 0, value], use_bin_type=True)
    return len(body).to_bytes(4, "big") + body


SEND_ANSWER = ["abcdefgh" + "0" * 16, "t", 0, 0, 0, 1.5e9]


def _columns(count: int) -> list[Any]:
    ids = [f"abcdefgh{p:016x}" for p in range(count)]
    return ["t", ids, [0] * count, list(range(count)), list(range(count)), [1.5e9] * count]


def _protocol() -> aio._Protocol:
    protocol = aio._Protocol(b"", "fake", 20.0, itertools.count(100).__next__)
    protocol.transport = _Transport()  # type: ignore[assignment]
    protocol.welcome.set_result(None)  # type: ignore[arg-type]
    protocol.welcomed = True
    protocol.reader.max_frame_bytes = protocol.limit = 1 << 20
    protocol.free = protocol.max_in_flight = 100
    protocol.coalescer = Coalescer(protocol, 1 << 20, 1000)
    return protocol


def _future(protocol: aio._Protocol) -> asyncio.Future[Any]:
    # the read's own kind: a Waiter (wakeup.c) with the accelerator
    fast = speedups.SPEEDUPS
    made = future_of(protocol) if fast is None else fast.group_future(protocol)
    assert made is not None
    return made


def _request(protocol: aio._Protocol, path: str) -> tuple[list[asyncio.Future[Any]], bytes]:
    """A request in flight by `path` and the read that answers it."""
    count = 1 if path in ("direct", "group of one") else 3
    futures = [_future(protocol) for _ in range(count)]
    deadline = 1e18
    if path == "direct":  # the plain send `direct` wrote, read by answered()
        protocol.pending[REQUEST_ID] = (futures[0], b"b0", deadline)
        protocol.waiting, protocol.waiting_topic = REQUEST_ID, "t"
        return futures, _frame(SEND_ANSWER)
    coalescer = protocol.coalescer
    assert coalescer is not None
    bodies = [b"b%d" % i for i in range(count)]
    answer = Answer(coalescer, "t", bodies, futures, None, REQUEST_ID)
    protocol.pending[REQUEST_ID] = (answer, None, deadline)
    if path == "group of one":  # a lone coalesced send: the general read, answered_slow
        return futures, _frame(SEND_ANSWER)
    if speedups.SPEEDUPS is not None:
        protocol.reader.columns.add(REQUEST_ID)
    return futures, _frame(_columns(count))


def _outcome(future: asyncio.Future[Any]) -> str:
    if not future.done():
        return "waiting"
    error = future.exception()
    return "result" if error is None else type(error).__name__


@pytest.mark.parametrize("path", ["direct", "group of one", "group", "group, general read"])
def test_an_error_inside_the_window_leaves_no_caller_waiting(path: str) -> None:
    # Each allocation of the read is made to fail in turn (_testcapi's seam); then fail()
    # runs, as the transport's connection_lost does for the error the read raised. Every
    # caller has its result or ConnectionLostError. On main, errors between the entry's
    # removal and the answers left the callers waiting on every path (direct 1, group of
    # one 8, group 2, general 2 of 120 allocations).
    _testcapi = pytest.importorskip("_testcapi")
    if path in ("direct", "group") and not IN_C:
        pytest.skip("read in C only")

    async def one(failing: int) -> tuple[bool, list[str]]:
        protocol = _protocol()
        futures, frame = _request(protocol, path)
        protocol.inbuf[: len(frame)] = frame
        raised: BaseException | None = None
        _testcapi.set_nomemory(failing, failing + 1)
        try:
            if path == "group, general read":
                protocol.data_received(frame)
            else:
                protocol.buffer_updated(len(frame))
        except MemoryError as error:
            raised = error
        finally:
            _testcapi.remove_mem_hooks()
        protocol.fail("the broker at fake closed the connection", raised)
        return raised is not None, [_outcome(future) for future in futures]

    seen = {}
    for failing in range(120):
        raised, outcomes = asyncio.run(one(failing))
        seen[(raised, tuple(outcomes))] = failing
        assert set(outcomes) <= {"result", "ConnectionLostError"}, (failing, outcomes)
    # (the seam reached the window: some reads raised with their callers unanswered)
    assert any(raised and "ConnectionLostError" in outcomes for raised, outcomes in seen)


def test_a_close_inside_the_window_answers_each_caller_once() -> None:
    # A group of three; the first caller's task, woken by the read, closes the connection
    # (what client.close() does on its own loop: fail()). With the accelerator that task
    # runs at once inside the read, the group already out of pending: the other two still
    # get their results, and fail() gives none of them ConnectionLostError as well.
    async def run() -> tuple[list[str], list[Any], bool]:
        protocol = _protocol()
        futures, frame = _request(protocol, "group")
        protocol.inbuf[: len(frame)] = frame
        reading = [False]
        closed_inside: list[bool] = []
        got: list[Any] = []

        async def caller(index: int) -> None:
            try:
                got.append((index, (await futures[index]).queue_offset))
            except ConnectionLostError:
                got.append((index, "lost"))
            if index == 0:
                closed_inside.append(reading[0])
                protocol.fail("the client of fake was closed", None)

        tasks = [asyncio.get_running_loop().create_task(caller(i)) for i in range(3)]
        await asyncio.sleep(0)  # (each waits on its future)

        def read() -> None:
            reading[0] = True
            try:
                protocol.buffer_updated(len(frame))
            finally:
                reading[0] = False

        asyncio.get_running_loop().call_soon(read)
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        return [_outcome(f) for f in futures], sorted(got), closed_inside == [True]

    outcomes, got, inside = asyncio.run(run())
    assert outcomes == ["result"] * 3
    assert got == [(0, 0), (1, 1), (2, 2)]
    # (without the accelerator the callers' tasks run after the read: no window to close in)
    assert inside or not IN_C
