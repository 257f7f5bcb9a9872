"""Two edges of the asyncio client, against a real broker (BrokerThread), with the C
accelerator and without it (EQUEUE_PURE_PYTHON=1, in a child process):

- coalesced sends lost to a broken connection: each caller gets a ConnectionLostError of
  its own that names its message (``unsent``: never written; ``unanswered``: written, no
  answer) and its place in the coalesced request, and the ones not written are not stored;
- a client called from a task on another event loop: WrongLoopError before anything is
  written (direct send, coalesced sends, a request, with the client's loop idle on this
  thread or running on another), and the client still works on its own loop.

A hang fails by a timeout (asyncio.wait_for, a bounded child process), not the suite."""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import pytest
from client_helpers import run_pure_python
from server_helpers import short_dir

import equeue
import equeue.aio
from equeue import speedups
from equeue.client.coalesce import _twin
from equeue.errors import (
    ConnectionLostError,
    EQueueError,
    StoreWriteError,
    WrongLoopError,
)
from equeue.server import BrokerThread
from equeue.store.types import OutgoingMessage

T = TypeVar("T")
BOUND = 10.0  # seconds any one await may take here: past it, a hang


@pytest.fixture
def url() -> Iterator[str]:
    home = short_dir()
    try:
        with BrokerThread(home / "s", listen=[f"unix:{home}/b.sock"]) as broker:
            with equeue.connect(broker.urls[0]) as admin:
                admin.create_topic("t", 2)
            yield broker.urls[0]
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _bodies(url: str) -> list[bytes]:
    """Every body stored in topic t, read through a blocking client."""
    found: list[bytes] = []
    with equeue.connect(url) as admin:
        for queue_id in admin.queue_ids("t"):
            first, end = admin.queue_range("t", queue_id)
            if end > first:
                found += [m.body for m in admin.pull("t", queue_id, first, end - first).messages]
    return found


def _in_child(scenario: str, url: str) -> None:
    """``scenario(url)`` of this module in a child process without the accelerator."""
    run_pure_python(f"import test_client_aio_edges as m; m.{scenario}({url!r})")


def _run(path: str, scenario: str, url: str) -> None:
    if path == "python":
        _in_child(scenario, url)
    elif speedups.SPEEDUPS is None:
        pytest.skip("the C accelerator is not built (or EQUEUE_PURE_PYTHON is set)")
    else:
        globals()[scenario](url)


# --- 1: coalesced sends lost to a broken connection ------------------------------------


def coalesced_sends_closed(url: str) -> None:
    asyncio.run(_coalesced_sends_closed(url))


async def _coalesced_sends_closed(url: str) -> None:
    """4 sends begun in one loop turn: the first goes alone (written at once), the other
    3 wait in the turn's coalesced group when the client is closed, before the group is
    written."""
    client = await equeue.aio.connect(url)
    await asyncio.wait_for(client.send("t", b"warm"), BOUND)  # (heard from just now)
    tasks = [asyncio.create_task(client.send("t", f"m{i}".encode())) for i in range(4)]
    await asyncio.sleep(0)  # each task runs up to its await: the group is not written yet
    protocol = client._protocol
    assert protocol is not None and protocol.coalescer is not None
    assert len(protocol.pending) == 1 and len(protocol.coalescer.groups["t"].futures) == 3
    await client.close()
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), BOUND)
    assert all(isinstance(o, ConnectionLostError) for o in outcomes), outcomes
    first, *grouped = outcomes
    assert isinstance(first, ConnectionLostError)
    assert first.unanswered == [OutgoingMessage(b"m0")] and first.unsent == []
    assert "was closed" in str(first)  # (its own error, also on the direct path)
    for index, error in enumerate(grouped, start=1):
        assert isinstance(error, ConnectionLostError)
        assert error.unsent == [OutgoingMessage(f"m{index}".encode())], (index, error.unsent)
        assert error.unanswered == [], (index, error.unanswered)
        assert f"send {index} of 3 coalesced into one request to topic 't'" in str(error)
        assert "was closed" in str(error) and "was not written" in str(error)
    assert len({id(e) for e in outcomes}) == 4  # each caller its own instance
    stored = await asyncio.to_thread(_bodies, url)
    assert not {b"m1", b"m2", b"m3"} & set(stored), stored  # not written: not stored
    assert b"warm" in stored


@pytest.mark.parametrize("path", ["c", "python"])
def test_coalesced_sends_lost_each_name_their_message(url: str, path: str) -> None:
    _run(path, "coalesced_sends_closed", url)


@pytest.mark.parametrize(
    "error",
    [
        ConnectionLostError("the broker at x closed the connection"),
        StoreWriteError("fdatasync of /s/chunk-000001 failed: [Errno 5] EIO"),
    ],
)
def test_a_twin_keeps_the_message_and_fields(error: EQueueError) -> None:
    """The instance each other caller of a failed group gets (OSError-based classes: their
    __new__ does not set args when the class has an __init__ of its own)."""
    if isinstance(error, ConnectionLostError):
        error.unanswered = [OutgoingMessage(b"x")]
    twin = _twin(error)
    assert twin is not error and type(twin) is type(error)
    assert str(twin) == str(error) and twin.args == error.args
    assert vars(twin) == vars(error)
    if isinstance(error, ConnectionLostError):
        assert isinstance(twin, ConnectionLostError)
        assert twin.unanswered is not error.unanswered  # its own list


# --- 2: a client called from a task on another loop ------------------------------------


async def _refused(client: equeue.aio.AsyncClient, label: str) -> list[str]:
    """Each way of calling the client from this (wrong) loop: WrongLoopError, no hang."""
    calls: list[tuple[str, Coroutine[Any, Any, Any]]] = [
        ("send", client.send("t", f"{label}-direct".encode())),
        ("send_batch", client.send_batch("t", [f"{label}-batch".encode()])),
        ("pull", client.pull("t", 0, 0)),
        ("send with a key", client.send("t", f"{label}-key".encode(), key="k")),
    ]
    problems = []
    for name, call in calls:
        try:
            await asyncio.wait_for(call, BOUND)
            problems.append(f"{name}: not refused")
        except WrongLoopError as exc:
            if "different loop" not in str(exc) or "nothing was sent" not in str(exc):
                problems.append(f"{name}: {exc}")
        except BaseException as exc:  # (what escaped instead: the report)
            problems.append(f"{name}: {type(exc).__name__}: {exc}")
    # several sends of one loop turn (the coalesced path on another loop)
    outcomes = await asyncio.wait_for(
        asyncio.gather(
            *(client.send("t", f"{label}-many{i}".encode()) for i in range(3)),
            return_exceptions=True,
        ),
        BOUND,
    )
    problems += [f"many: {o!r}" for o in outcomes if not isinstance(o, WrongLoopError)]
    return problems


async def _own_again(client: equeue.aio.AsyncClient) -> list[Any]:
    """A send, a burst (coalesced) and a batch, all on the client's own loop."""
    return await asyncio.gather(
        client.send("t", b"own-2"),
        *(client.send("t", f"own-burst{i}".encode()) for i in range(3)),
        client.send_batch("t", [b"own-batch"]),
    )


def other_loop_idle(url: str) -> None:
    """The client's loop idle on this thread (as after an asyncio.run that connected it)."""
    own = asyncio.new_event_loop()
    try:
        client = own.run_until_complete(equeue.aio.connect(url))
        own.run_until_complete(client.send("t", b"own-1"))
        problems = asyncio.run(_refused(client, "other"))
        assert not problems, problems
        # still the client of its own loop: a send, a burst (coalesced), a batch
        after = own.run_until_complete(asyncio.wait_for(_own_again(client), BOUND))
        assert len(after) == 5
        own.run_until_complete(client.close())
    finally:
        own.close()
    stored = _bodies(url)
    assert not [body for body in stored if body.startswith(b"other")], stored
    assert {b"own-1", b"own-2", b"own-batch", b"own-burst2"} <= set(stored)


def other_loop_on_a_thread(url: str) -> None:
    asyncio.run(_other_loop_on_a_thread(url))


async def _other_loop_on_a_thread(url: str) -> None:
    """The client's loop running on another thread, a long pull of its in flight (so a
    plain send from here takes the coalesced path, not the direct one)."""
    own = asyncio.new_event_loop()
    thread = threading.Thread(target=own.run_forever, daemon=True)
    thread.start()

    def on_own(coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, own).result(BOUND)

    try:
        client = on_own(equeue.aio.connect(url))
        on_own(client.send("t", b"own-1"))
        _, end = on_own(client.queue_range("t", 1))
        waiting = asyncio.run_coroutine_threadsafe(client.pull("t", 1, end, wait=BOUND), own)
        protocol = client._protocol
        assert protocol is not None
        for _ in range(500):  # until the pull is in flight (at most ~5 s)
            if protocol.pending:
                break
            await asyncio.sleep(0.01)
        assert protocol.pending
        problems = await _refused(client, "other")
        assert not problems, problems
        results = on_own(_own_again(client))  # (one of them to queue 1: the pull wakes)
        assert len(results) == 5
        waiting.result(BOUND)
        on_own(client.close())
    finally:
        own.call_soon_threadsafe(own.stop)
        thread.join(BOUND)
        own.close()
    stored = await asyncio.to_thread(_bodies, url)
    assert not [body for body in stored if body.startswith(b"other")], stored
    assert {b"own-1", b"own-2", b"own-batch", b"own-burst2"} <= set(stored)


@pytest.mark.parametrize("path", ["c", "python"])
@pytest.mark.parametrize("scenario", ["other_loop_idle", "other_loop_on_a_thread"])
def test_a_call_from_another_loop_is_refused_before_writing(
    url: str, path: str, scenario: str
) -> None:
    _run(path, scenario, url)


def closed_loop_then_close(url: str) -> None:
    """A client connected in one asyncio.run (its loop closed since), used and closed in
    the next: the send is refused, close() raises nothing (asyncio would raise "Event
    loop is closed" for a callback of that loop) and the broker sees the connection end."""
    client = asyncio.run(_connect_and_send(url))
    with equeue.connect(url) as admin:
        before = admin.stats()["connections"]

    async def later() -> None:
        with pytest.raises(WrongLoopError, match="different loop"):
            await asyncio.wait_for(client.send("t", b"other-late"), BOUND)
        await asyncio.wait_for(client.close(), BOUND)

    asyncio.run(later())
    assert client.closed
    with equeue.connect(url) as admin:
        for _ in range(500):  # until the broker has read the end (at most ~5 s)
            if admin.stats()["connections"] == before - 1:
                break
            threading.Event().wait(0.01)
        assert admin.stats()["connections"] == before - 1
    assert b"other-late" not in _bodies(url)


async def _connect_and_send(url: str) -> equeue.aio.AsyncClient:
    client = await equeue.aio.connect(url)
    await asyncio.wait_for(client.send("t", b"own-1"), BOUND)
    return client


@pytest.mark.parametrize("path", ["c", "python"])
def test_close_from_another_loop_after_its_own_closed(url: str, path: str) -> None:
    _run(path, "closed_loop_then_close", url)
