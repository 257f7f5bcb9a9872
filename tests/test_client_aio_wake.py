"""The waiter of the asyncio client's direct send (equeue/cext/wakeup.c): given its answer
in C, it runs its task's wake-up at once instead of through call_soon, where that is safe;
everything a caller sees stays a Future's: cancellation, wait_for / gather / shield /
wait / create_task, contextvars, errors from the await, KeyboardInterrupt and SystemExit
from a woken task, sends again from inside the read, debug mode, a broken connection, a
task on another loop, a caller waiting for the only place. Against a real broker."""

from __future__ import annotations

import asyncio
import contextvars
import random
import select
import shutil
import threading
from typing import Any

import pytest
from client_helpers import WELCOME, FakeBroker, Peer, counting_loop, temporary_broker
from server_helpers import broker_with_topic_t, short_dir

import equeue.aio
from equeue import MessageStore, speedups
from equeue.client import rawconn
from equeue.errors import ConnectionLostError, TopicNotFoundError
from equeue.protocol.frames import PROTOCOL_VERSION
from equeue.server import BrokerThread
from equeue.store.types import OutgoingMessage, SendResult

needs_c = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="no C accelerator")
RESULT: list[Any] = ["0123456789abcdef01234567", "t", 1, 2, 3, 1.5e9]


broker = pytest.fixture(broker_with_topic_t, scope="module", name="broker")


def _stored(broker: BrokerThread, result: SendResult) -> bytes:
    return broker.store.get(result.message_id).body


def _settled(client: equeue.aio.AsyncClient) -> bool:
    """Every place given back, nothing in flight or waiting."""
    protocol = client._protocol
    assert protocol is not None
    return protocol.free == protocol.max_in_flight and not protocol.pending and not protocol.queued


@needs_c
@pytest.mark.parametrize("mode", ["asyncio", "debug", "uvloop"])
def test_an_answer_read_in_c_wakes_its_task_without_call_soon(
    broker: BrokerThread, mode: str
) -> None:
    """40 sends one at a time: read in C, each task woken in the read (no call_soon a
    send; before: one each). In debug mode and on uvloop every wake-up goes through
    call_soon."""
    loop = counting_loop(mode)

    async def main() -> tuple[list[SendResult], int, int]:
        client = await equeue.aio.connect(broker.urls[0])
        try:
            await client.send("t", b"warm")
            before = loop.soon
            results = [await client.send("t", b"%d" % n) for n in range(40)]
            protocol = client._protocol
            assert protocol is not None and _settled(client)
            return results, loop.soon - before, protocol.read_in_c
        finally:
            await client.close()

    try:
        results, soon, read_in_c = loop.run_until_complete(main())
    finally:
        loop.close()
    assert [_stored(broker, r) for r in results] == [b"%d" % n for n in range(40)]
    assert read_in_c >= 30
    if mode != "asyncio":
        assert soon >= read_in_c - 1
    else:
        assert soon <= 40 - read_in_c + 5  # (the answers read the general way: call_soon)


def test_a_cancelled_send_reports_its_message_and_its_late_answer_is_dropped(
    broker: BrokerThread,
) -> None:
    async def main() -> tuple[list[Any], SendResult, bool]:
        client = await equeue.aio.connect(broker.urls[0])
        seen: list[Any] = []

        async def one() -> None:
            try:
                await client.send("t", b"cancelled")
            except asyncio.CancelledError as exc:
                seen.append(exc.args)
                raise

        try:
            await client.send("t", b"warm")
            task = asyncio.get_running_loop().create_task(one())
            await asyncio.sleep(0)  # (it wrote its send and waits; not read yet)
            task.cancel("why")
            with pytest.raises(asyncio.CancelledError):
                await task
            after = await client.send("t", b"after")  # (the late answer came first)
            return seen, after, _settled(client)
        finally:
            await client.close()

    seen, after, settled = asyncio.run(main())
    assert seen == [("why",)] and settled
    assert _stored(broker, after) == b"after"
    # the cancelled send was stored all the same (its answer dropped)
    bodies = [m.body for q in range(4) for m in broker.store.pull("t", q, 0, 10_000).messages]
    assert b"cancelled" in bodies


def test_sends_under_wait_for_gather_shield_wait_and_create_task(broker: BrokerThread) -> None:
    async def main() -> list[SendResult]:
        client = await equeue.aio.connect(broker.urls[0])
        try:
            out = [await asyncio.wait_for(client.send("t", b"wait_for"), 30)]
            out += await asyncio.gather(client.send("t", b"gather"))
            out.append(await asyncio.shield(client.send("t", b"shield")))
            task = asyncio.get_running_loop().create_task(client.send("t", b"task"))
            done, _ = await asyncio.wait([task], timeout=30)
            out.append(done.pop().result())
            out.append(await asyncio.create_task(client.send("t", b"create_task")))
            assert _settled(client)
            return out
        finally:
            await client.close()

    results = asyncio.run(main())
    assert [_stored(broker, r) for r in results] == [
        b"wait_for", b"gather", b"shield", b"task", b"create_task"
    ]  # fmt: skip


def test_a_send_past_wait_for_times_out_and_its_late_answer_is_dropped() -> None:
    """The broker holds the first answer until the second request: wait_for cancels the
    first send (TimeoutError); its answer, after the second's, is dropped; a third send
    (alone again, read in C where built) is answered."""

    def script(peer: Peer) -> None:
        peer.recv()
        peer.send({**WELCOME, "version": PROTOCOL_VERSION})
        first = peer.recv()[0]
        second = peer.recv()[0]
        peer.send([second, 0, RESULT])
        peer.send([first, 0, RESULT])
        while True:
            peer.send([peer.recv()[0], 0, RESULT])

    async def main(url: str) -> list[Any]:
        client = await equeue.aio.connect(url, timeout=10)
        try:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.send("t", b"first"), 0.2)
            async with asyncio.timeout(30):
                second = await client.send("t", b"second")
                for _ in range(20):  # (until the first answer was read and dropped)
                    if _settled(client):
                        break
                    await asyncio.sleep(0.01)
                third = await client.send("t", b"third")
            return [second, third, _settled(client)]
        finally:
            await client.close()

    with FakeBroker(script) as fake:
        second, third, settled = asyncio.run(main(fake.url))
    assert second == third == SendResult(*RESULT) and settled


def test_each_task_sees_its_own_context_after_the_await(broker: BrokerThread) -> None:
    var: contextvars.ContextVar[int] = contextvars.ContextVar("var", default=-1)

    async def main() -> list[int]:
        clients = [await equeue.aio.connect(broker.urls[0]) for _ in range(4)]
        wrong: list[int] = []

        async def one(index: int) -> None:
            var.set(index)
            for n in range(10):
                await clients[index % 4].send("t", b"ctx")
                if var.get() != index + n:
                    wrong.append(index)
                var.set(index + n + 1)  # (kept by the task's context to the next await)

        try:
            await asyncio.gather(*(one(i * 100) for i in range(8)))
            assert var.get() == -1  # (the main task's context untouched)
            return wrong
        finally:
            for client in clients:
                await client.close()

    assert asyncio.run(main()) == []


@pytest.mark.parametrize("raised", [KeyboardInterrupt, SystemExit])
def test_keyboardinterrupt_from_a_woken_task_leaves_the_loop_and_the_client_works_on(
    broker: BrokerThread, raised: type[BaseException]
) -> None:
    loop = asyncio.new_event_loop()

    async def interrupted(client: equeue.aio.AsyncClient) -> None:
        await client.send("t", b"before the interrupt")
        raise raised

    try:
        client = loop.run_until_complete(equeue.aio.connect(broker.urls[0]))
        try:
            loop.run_until_complete(client.send("t", b"warm"))
            task = loop.create_task(interrupted(client))
            with pytest.raises(raised):
                loop.run_until_complete(task)
            assert task.done() and isinstance(task.exception(), raised)
            result = loop.run_until_complete(client.send("t", b"after"))
            assert _settled(client)
        finally:
            loop.run_until_complete(client.close())
    finally:
        loop.close()
    assert _stored(broker, result) == b"after"


def test_a_woken_task_sends_again_on_this_and_another_client(broker: BrokerThread) -> None:
    """Each send made from inside the read that woke its task (the direct path), on the
    same and on another connection, by 8 tasks at once."""

    async def main() -> list[tuple[bytes, SendResult]]:
        a = await equeue.aio.connect(broker.urls[0])
        b = await equeue.aio.connect(broker.urls[0])
        out: list[tuple[bytes, SendResult]] = []

        async def one(index: int) -> None:
            for n in range(10):
                for name, client in (("a", a), ("a", a), ("b", b)):
                    body = f"{index}{name}{n}".encode()
                    out.append((body, await client.send("t", body)))

        try:
            await asyncio.gather(*(one(i) for i in range(8)))
            assert _settled(a) and _settled(b)
            return out
        finally:
            await a.close()
            await b.close()

    sent = asyncio.run(main())
    assert len(sent) == 240 and len({r.message_id for _, r in sent}) == 240
    assert all(_stored(broker, result) == body for body, result in sent)


@needs_c
def test_an_answer_read_while_another_task_runs_wakes_its_task_through_call_soon(
    broker: BrokerThread,
) -> None:
    """The read made from inside another task (its transport's read_ready called there):
    the woken task may not be stepped inside that one (a C Task refuses: "Cannot enter
    into task ... while another task ... is being executed"), so it goes through call_soon
    and its answer comes after the reading task yields. Round 12 reads the running task
    from asyncio's dict instead of calling current_task."""
    loop = counting_loop("asyncio")
    handled: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: handled.append(context))

    async def main() -> SendResult:
        client = await equeue.aio.connect(broker.urls[0])
        try:
            await client.send("t", b"warm")
            protocol = client._protocol
            assert protocol is not None
            transport: Any = protocol.transport
            assert isinstance(transport, rawconn.RawTransport)
            sender = asyncio.ensure_future(client.send("t", b"answered inside a task"))
            await asyncio.sleep(0)  # (its frame written by `direct`: the task waits)
            assert protocol.waiting and not sender.done()
            readable, _, _ = select.select([transport.fd], [], [], 10.0)
            assert readable, "no answer within 10 s"
            soon, read_in_c = loop.soon, protocol.read_in_c
            transport.read_ready()  # (inside this task, which is running)
            # (checked before awaiting it: a task stepped inside this one is lost for good)
            assert loop.soon - soon == 1 and handled == [], handled
            assert protocol.read_in_c == read_in_c + 1 and not sender.done()
            return await asyncio.wait_for(sender, 10.0)
        finally:
            await client.close()

    try:
        result = loop.run_until_complete(main())
    finally:
        loop.close()
    assert handled == []
    assert _stored(broker, result) == b"answered inside a task"


@needs_c  # (without it, or with sends in flight: the coalesced path, as before; see client.md)
def test_a_task_on_another_loop_is_refused_and_the_client_goes_on(broker: BrokerThread) -> None:
    own = asyncio.new_event_loop()
    other = asyncio.new_event_loop()
    try:
        client = own.run_until_complete(equeue.aio.connect(broker.urls[0]))
        try:
            own.run_until_complete(client.send("t", b"warm"))
            with pytest.raises(RuntimeError, match="different loop"):
                other.run_until_complete(client.send("t", b"from another loop"))
            result = own.run_until_complete(client.send("t", b"on its own loop"))
        finally:
            own.run_until_complete(client.close())
    finally:
        own.close()
        other.close()
    assert _stored(broker, result) == b"on its own loop"


def test_a_caller_waiting_for_the_only_place_is_not_overtaken() -> None:
    """max_in_flight 1: a task sending 30 times, one at a time, and a second caller that
    waits for the place. The place goes to the waiting caller first (as through
    call_soon), not to the woken sender sending again from inside the read."""

    async def main(url: str) -> tuple[int, int]:
        client = await equeue.aio.connect(url, timeout=10)
        done: list[str] = []

        async def many() -> None:
            for _ in range(30):
                await client.send("t", b"many")
            done.append("many")

        async def once() -> None:
            await client.send("t", b"once")
            done.append("once")

        try:
            async with asyncio.timeout(30):
                await client.send("t", b"warm")
                first = asyncio.get_running_loop().create_task(many())
                await asyncio.sleep(0)  # (its first send in flight: the place taken)
                await asyncio.gather(first, once())
            assert _settled(client)
            return done.index("once"), done.index("many")
        finally:
            await client.close()

    directory = short_dir()
    try:
        with BrokerThread(directory / "s", max_in_flight=1) as running:
            running.store.create_topic("t", 4)
            once_at, many_at = asyncio.run(main(running.urls[0]))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    assert once_at < many_at


def test_sends_in_flight_when_the_broker_is_sigkilled_are_reported_or_stored() -> None:
    """16 tasks on 16 connections sending one at a time under --flush sync, the broker
    SIGKILLed under them: each send is acknowledged (and found in the store after the
    restart) or raises ConnectionLostError naming its message; the clients reconnect."""
    with temporary_broker("--flush", "sync") as running:
        with equeue.connect(running.url) as admin:
            admin.create_topic("t", 4)
        acked: list[tuple[bytes, SendResult]] = []
        lost: list[tuple[bytes, ConnectionLostError]] = []
        killed = threading.Event()

        async def main() -> None:
            clients = [await equeue.aio.connect(running.url, timeout=10) for _ in range(16)]

            async def one(index: int) -> None:
                for n in range(100_000):  # (bounded: until the kill)
                    body = f"{index}:{n}".encode()
                    try:
                        acked.append((body, await clients[index].send("t", body)))
                    except ConnectionLostError as exc:
                        lost.append((body, exc))
                        return
                    if n == 50 and index == 0:
                        await asyncio.to_thread(running.kill)
                        killed.set()

            try:
                async with asyncio.timeout(60):
                    await asyncio.gather(*(one(i) for i in range(16)))
            finally:
                for client in clients:
                    await client.close()

        asyncio.run(main())
        assert killed.is_set() and len(lost) == 16
        # in flight at the kill: unanswered; sent after it: unsent (the reconnect failed)
        named = [[*exc.unanswered, *exc.unsent] == [OutgoingMessage(body)] for body, exc in lost]
        assert all(named), [(body, exc.unanswered, exc.unsent) for body, exc in lost]
        assert any(exc.unanswered for _, exc in lost)
        running.stop()
        with MessageStore.open(running.store, read_only=True) as store:
            assert all(store.get(r.message_id).body == body for body, r in acked)
        running.start()

        async def again() -> SendResult:
            async with await equeue.aio.connect(running.url) as client:
                return await client.send("t", b"after the restart")

        assert asyncio.run(again()).topic == "t"


def test_random_sends_cancellations_and_broken_connections(broker: BrokerThread) -> None:
    """Seeded: 12 tasks on 4 clients; each step a send awaited, a send cancelled after 0-2
    loop turns, or a connection aborted under the sends in flight. Every outcome is a
    result (stored with its body), CancelledError (a cancelled one) or ConnectionLostError
    (naming its message); at the end nothing is in flight or waiting on any client."""
    rng = random.Random(34)
    bad: list[str] = []

    async def main() -> int:
        clients = [await equeue.aio.connect(broker.urls[0]) for _ in range(4)]
        results: list[tuple[bytes, SendResult]] = []
        unwritten: list[bytes] = []

        async def one(index: int) -> None:
            for n in range(40):
                client = clients[rng.randrange(4)]
                body = f"random {index}:{n}".encode()
                roll = rng.random()
                task = asyncio.get_running_loop().create_task(client.send("t", body))
                if roll < 0.2:
                    for _ in range(rng.randrange(3)):
                        await asyncio.sleep(0)
                    task.cancel()
                elif roll < 0.25 and client._protocol is not None:
                    await asyncio.sleep(0)
                    if client._protocol.transport is not None:
                        client._protocol.transport.abort()
                try:
                    results.append((body, await task))
                except asyncio.CancelledError:
                    if roll >= 0.2:
                        bad.append(f"{body!r} cancelled")
                except ConnectionLostError as exc:
                    if [*exc.unanswered, *exc.unsent] == [OutgoingMessage(body)]:
                        continue
                    # A coalesced group dropped before it was written names no message
                    # (coalesce.py's drop, as before): it must not be stored.
                    if exc.unanswered or exc.unsent:
                        bad.append(f"{body!r}: {exc.unanswered} {exc.unsent} {exc}")
                    unwritten.append(body)

        try:
            async with asyncio.timeout(60):
                await asyncio.gather(*(one(i) for i in range(12)))
                for client in clients:
                    await client.ping()  # (reconnected where it broke)
                    for _ in range(100):  # (the dropped answers read)
                        if _settled(client):
                            break
                        await asyncio.sleep(0.01)
                    if not _settled(client):
                        bad.append(f"{client._protocol} not settled")
            for body, result in results:
                if _stored(broker, result) != body:
                    bad.append(f"{body!r} stored as {_stored(broker, result)!r}")
            stored = {
                m.body for q in range(4) for m in broker.store.pull("t", q, 0, 1 << 20).messages
            }
            bad.extend(
                f"{body!r} reported unwritten, stored" for body in unwritten if body in stored
            )
            return len(results)
        finally:
            for client in clients:
                await client.close()

    assert asyncio.run(main()) > 100
    assert bad == []


@needs_c
def test_the_waiter_keeps_the_future_protocol() -> None:
    waiter_type = speedups.SPEEDUPS.client_waiter_type()  # type: ignore[union-attr]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        w: Any = waiter_type(loop)
        assert asyncio.isfuture(w) and w.get_loop() is loop and not w.done()
        with pytest.raises(asyncio.InvalidStateError):
            w.result()
        with pytest.raises(asyncio.InvalidStateError):
            w.exception()
        called: list[Any] = []
        w.add_done_callback(called.append)
        other: Any = len
        w.add_done_callback(other)
        assert w.remove_done_callback(other) == 1
        w.set_result((1, 2))
        with pytest.raises(asyncio.InvalidStateError):
            w.set_result(3)
        assert w.cancel() is False and w.result() == (1, 2) and w.exception() is None
        await asyncio.sleep(0)
        assert called == [w]
        w.add_done_callback(called.append)  # (done: scheduled at once)
        await asyncio.sleep(0)
        assert called == [w, w] and await w == (1, 2)

        c: Any = waiter_type(loop)
        assert c.cancel(msg="m") is True and c.cancelled() and c.cancel() is False
        with pytest.raises(asyncio.CancelledError, match="m"):
            c.result()
        e: Any = waiter_type(loop)
        with pytest.raises(TypeError):
            e.set_exception(StopIteration())
        e.set_exception(TopicNotFoundError("t"))
        with pytest.raises(TopicNotFoundError):
            await e
        assert isinstance(e.exception(), TopicNotFoundError)

    asyncio.run(main())


@needs_c
def test_the_waiters_task_attributes_by_interned_name_and_by_an_equal_string() -> None:
    """The names a Task asks for (answered by identity of the interned string, round 11)
    give what the generic lookup gives for an equal string that is another object."""
    waiter_type = speedups.SPEEDUPS.client_waiter_type()  # type: ignore[union-attr]

    def fresh(name: str) -> str:
        made = "".join(list(name))
        assert made == name and made is not name
        return made

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for spell in (str, fresh):
            w: Any = waiter_type(loop)
            blocking = spell("_asyncio_future_blocking")
            assert getattr(w, blocking) is False
            setattr(w, blocking, 1)
            assert getattr(w, blocking) is True and w._asyncio_future_blocking is True
            setattr(w, blocking, False)
            assert w._asyncio_future_blocking is False
            with pytest.raises(AttributeError, match="cannot delete"):
                delattr(w, blocking)
            get_loop = getattr(w, spell("get_loop"))
            assert get_loop.__self__ is w and get_loop.__name__ == "get_loop"
            assert get_loop() is loop
            add = getattr(w, spell("add_done_callback"))
            assert add.__self__ is w and add.__name__ == "add_done_callback"
            called: list[Any] = []
            context = contextvars.copy_context()
            add(called.append, context=context)
            w.set_result(7)
            await asyncio.sleep(0)
            assert called == [w]
            with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
                getattr(w, spell("nothing"))
            # `result` by its characters (task_wakeup asks with a new string each time)
            result = getattr(w, spell("result"))
            assert result.__self__ is w and result.__name__ == "result" and result() == 7
            for near in ("resulT", "results", "resul", "r\u00e9sult"):
                with pytest.raises(AttributeError, match="has no attribute"):
                    getattr(w, spell(near))
            with pytest.raises(AttributeError):
                setattr(w, spell("nothing"), 1)

        class Name(str):
            pass

        w = waiter_type(asyncio.get_running_loop())
        w.set_result(8)
        assert getattr(w, Name("result"))() == 8  # (a str subclass: the generic way)

    asyncio.run(main())


@needs_c
def test_a_callback_whose_eq_removes_callbacks_does_not_crash() -> None:
    # review 34b: remove_done_callback compared a borrowed entry that the comparison freed
    waiter_type = speedups.SPEEDUPS.client_waiter_type()  # type: ignore[union-attr]

    async def main() -> None:
        loop = asyncio.get_running_loop()
        w: Any = waiter_type(loop)
        called: list[Any] = []
        w.add_done_callback(called.append)

        class Evil:
            done = False

            def __eq__(self, other: object) -> bool:
                if not Evil.done:
                    Evil.done = True
                    w.remove_done_callback(self)  # frees the entry the outer call compares
                    [bytes(64) for _ in range(1000)]  # reuse the freed memory
                return False

            __hash__ = object.__hash__

        w.add_done_callback(Evil())
        w.add_done_callback(called.append)
        assert w.remove_done_callback(abs) == 0
        w.set_result(1)
        await asyncio.sleep(0)
        assert called == [w, w]  # the Evil one was removed by its own comparison

    asyncio.run(main())


class _DebugInterrupted(asyncio.SelectorEventLoop):
    armed = False

    def get_debug(self) -> bool:
        if self.armed:
            self.armed = False
            raise KeyboardInterrupt("Ctrl-C landing in get_debug()")
        return super().get_debug()


@needs_c
def test_an_interrupt_while_deciding_the_wake_up_still_wakes_the_task(
    broker: BrokerThread,
) -> None:
    # review 34b: the waiter was marked done before the check that raised, and its task
    # was never woken (pending for good, and cancel() could not free it)
    loop = _DebugInterrupted()
    try:
        client = loop.run_until_complete(equeue.aio.connect(broker.urls[0]))
        loop.run_until_complete(client.send("t", b"warm"))

        async def start() -> asyncio.Task[SendResult]:
            task = loop.create_task(client.send("t", b"woken?"))
            await asyncio.sleep(0)  # written, awaiting its waiter
            later = loop.create_future()
            loop.call_later(0.2, later.set_result, None)
            loop.armed = True
            await later
            return task

        with pytest.raises(KeyboardInterrupt):
            loop.run_until_complete(start())
        loop.armed = False
        (task,) = [t for t in asyncio.all_tasks(loop) if "send" in repr(t.get_coro())]
        # (asyncio.wait, not wait_for: a task whose waiter refuses the cancel would hang it)
        done, _ = loop.run_until_complete(asyncio.wait({task}, timeout=5))
        assert done == {task}, "the send's task was never woken"
        assert _stored(broker, task.result()) == b"woken?"
        loop.run_until_complete(client.close())
    finally:
        loop.close()


@needs_c
def test_raising_a_waiters_exception_again_does_not_grow_its_traceback() -> None:
    # review 34b: each result() added its frame to the exception (1,000 calls: 1,000 entries)
    waiter_type = speedups.SPEEDUPS.client_waiter_type()  # type: ignore[union-attr]

    def depth(exc: BaseException) -> int:
        tb, n = exc.__traceback__, 0
        while tb is not None:
            tb, n = tb.tb_next, n + 1
        return n

    async def main() -> list[int]:
        depths = []
        for w in (
            waiter_type(asyncio.get_running_loop()),
            asyncio.get_running_loop().create_future(),
        ):
            w.set_exception(TopicNotFoundError("t"))
            for _ in range(50):
                with pytest.raises(TopicNotFoundError) as raised:
                    w.result()
            depths.append(depth(raised.value))
        return depths

    waiter_depth, future_depth = asyncio.run(main())
    assert waiter_depth == future_depth <= 2
