"""The clients' group members take the options of the store's Consumer as it does (review
37b finding 3), against ``equeue serve`` in a subprocess: ``start``, the checks of
``timeout`` (of the member, ``poll`` and ``run``), a zero timeout meaning "what is there
now", the group name, ``tags=[]``, ``batch_size``'s range and ``poll_batch``. Each bad
value raises the class and message the store's Consumer raises for it."""

from __future__ import annotations

import asyncio
import math
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from client_helpers import BrokerProcess, temporary_broker

import equeue
import equeue.aio
from equeue import MessageStore
from equeue.client.consumer_aio import AsyncGroupConsumer
from equeue.errors import EQueueError

TOPIC = "opts"
WAITING = [b"m0", b"m1", b"m2", b"m3", b"m4", b"m5"]
BAD_SECONDS: list[object] = [-1, -0.5, math.nan, math.inf, "1", True, b"1"]


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    with temporary_broker() as running, equeue.connect(running.url) as client:
        client.create_topic(TOPIC, 2)
        client.send_batch(TOPIC, [{"body": b, "queue_id": i % 2} for i, b in enumerate(WAITING)])
        yield running


@pytest.fixture(scope="module")
def store() -> Iterator[MessageStore]:
    with (
        tempfile.TemporaryDirectory(prefix="eqopts") as directory,
        MessageStore.open(directory) as opened,
    ):
        opened.create_topic(TOPIC, 2)
        yield opened


def refusal(call: Callable[[], object]) -> tuple[str, str]:
    """(class name, message) of what ``call`` raised; a builtin exception fails the test."""
    try:
        made = call()
    except EQueueError as exc:
        return type(exc).__name__, str(exc)
    close = getattr(made, "close", None)
    if close is not None:
        close()
    return "accepted", ""


async def async_refusal(call: Callable[[], Awaitable[object]]) -> tuple[str, str]:
    try:
        await call()
    except EQueueError as exc:
        return type(exc).__name__, str(exc)
    return "accepted", ""


def options_cases() -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    cases: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        (("", TOPIC), {}),
        ((5, TOPIC), {}),
        (("g", TOPIC), {"tags": []}),
        (("g", TOPIC), {"tags": ["a", 5]}),
        (("g", TOPIC), {"start": "newest"}),
        (("g", TOPIC), {"start": None}),
        (("g", TOPIC), {"batch_size": 0}),
        (("g", TOPIC), {"batch_size": (1 << 20) + 1}),
        (("g", TOPIC), {"batch_size": 2.0}),
        (("g", []), {}),
        (("g", [TOPIC, 5]), {}),
    ]
    cases += [(("g", TOPIC), {"timeout": bad}) for bad in BAD_SECONDS]
    return cases


@pytest.mark.parametrize(("args", "options"), options_cases())
def test_bad_options_are_refused_as_the_store_refuses_them(
    broker: BrokerProcess, store: MessageStore, args: tuple[Any, ...], options: dict[str, Any]
) -> None:
    expected = refusal(lambda: store.consumer(*args, **options))
    assert expected[0] != "accepted"
    with equeue.connect(broker.url) as client:
        assert refusal(lambda: client.consumer(*args, **options)) == expected

    async def main() -> tuple[str, str]:
        client = await equeue.aio.connect(broker.url)
        try:
            return refusal(lambda: client.consumer(*args, **options))
        finally:
            await client.close()

    assert asyncio.run(main()) == expected


def test_the_store_range_of_batch_size_is_taken(broker: BrokerProcess) -> None:
    # the store takes up to 2**20; the broker cuts each pull to its max_pull_count (65536)
    with (
        equeue.connect(broker.url) as client,
        client.consumer("big-batch", TOPIC, batch_size=1 << 20, timeout=1.0) as consumer,
    ):
        assert sorted(m.body for m in consumer) == WAITING


@pytest.mark.parametrize("bad", BAD_SECONDS)
def test_bad_timeouts_of_poll_and_run_are_refused_as_the_store_refuses_them(
    broker: BrokerProcess, store: MessageStore, bad: object
) -> None:
    with store.consumer("g", TOPIC) as embedded:
        expected = refusal(lambda: embedded.poll(timeout=bad))  # type: ignore[arg-type]
    assert expected[0] != "accepted"
    with equeue.connect(broker.url) as client, client.consumer("bad-t", TOPIC) as consumer:
        assert refusal(lambda: consumer.poll(bad)) == expected  # type: ignore[arg-type]
        assert refusal(lambda: consumer.poll_batch(None, bad)) == expected  # type: ignore[arg-type]
        run = consumer.run
        assert refusal(lambda: run(lambda m: None, timeout=bad)) == expected  # type: ignore[arg-type]

    async def main() -> list[tuple[str, str]]:
        client = await equeue.aio.connect(broker.url)
        try:
            async with client.consumer("bad-t-aio", TOPIC) as member:
                return [
                    await async_refusal(lambda: member.poll(bad)),  # type: ignore[arg-type]
                    await async_refusal(lambda: member.poll_batch(None, bad)),  # type: ignore[arg-type]
                    await async_refusal(lambda: member.run(print, timeout=bad)),  # type: ignore[arg-type]
                ]
        finally:
            await client.close()

    assert asyncio.run(main()) == [expected] * 3


def test_a_zero_timeout_hands_out_what_is_there_now(broker: BrokerProcess) -> None:
    # a fresh member: its first pulls are not answered yet; 0 waits for them (one round trip)
    with equeue.connect(broker.url) as client:
        with client.consumer("zero-iter", TOPIC, timeout=0) as consumer:
            assert sorted(m.body for m in consumer) == WAITING
        with client.consumer("zero-poll", TOPIC) as consumer:
            first = consumer.poll(0)
            assert first is not None and first.body in WAITING
        with client.consumer("zero-run", TOPIC) as consumer:
            assert consumer.run(lambda m: None, timeout=0) == len(WAITING)
        with client.consumer("zero-iter", TOPIC, timeout=0) as consumer:
            assert list(consumer) == []  # the control: everything was committed

    async def main() -> tuple[list[bytes], bytes | None, int, list[bytes]]:
        client = await equeue.aio.connect(broker.url)
        try:
            async with client.consumer("zero-iter-aio", TOPIC, timeout=0) as member:
                bodies = sorted([m.body async for m in member])
            async with client.consumer("zero-poll-aio", TOPIC) as member:
                first = await member.poll(0)
            async with client.consumer("zero-run-aio", TOPIC) as member:
                ran = await member.run(lambda m: None, timeout=0)
            async with client.consumer("zero-iter-aio", TOPIC, timeout=0) as member:
                again = [m.body async for m in member]
            return bodies, None if first is None else first.body, ran, again
        finally:
            await client.close()

    bodies, first_body, ran, again = asyncio.run(main())
    assert bodies == WAITING and first_body in WAITING and ran == len(WAITING) and again == []


def test_start_applies_where_the_group_committed_nothing(broker: BrokerProcess) -> None:
    with equeue.connect(broker.url) as client:
        client.create_topic("starts", 1)
        client.send("starts", b"before")
        client.commit_offset("kept", "starts", 0, 1)  # a group that committed past "before"
        with client.consumer("late", "starts", start="latest", timeout=0.5) as consumer:
            assert list(consumer) == []  # nothing committed: from the next offset
            client.send("starts", b"after")
            assert [m.body for m in consumer] == [b"after"]
        with client.consumer("early", "starts", start="earliest", timeout=0.5) as consumer:
            assert [m.body for m in consumer] == [b"before", b"after"]
        client.send("starts", b"third")
        # a commit wins over start: the group's members share it
        with client.consumer("late", "starts", start="earliest", timeout=0.5) as consumer:
            assert [m.body for m in consumer] == [b"third"]
        with client.consumer("kept", "starts", start="latest", timeout=0.5) as consumer:
            assert [m.body for m in consumer] == [b"after", b"third"]

    async def main() -> tuple[list[bytes], list[bytes]]:
        client = await equeue.aio.connect(broker.url)
        try:
            async with client.consumer("late-aio", "starts", start="latest", timeout=0.5) as m:
                before = [x.body async for x in m]
                await client.send("starts", b"fourth")
                after = [x.body async for x in m]
            return before, after
        finally:
            await client.close()

    assert asyncio.run(main()) == ([], [b"fourth"])


def test_poll_batch_has_the_store_polls_shape(broker: BrokerProcess, store: MessageStore) -> None:
    store.send_batch(TOPIC, [{"body": b, "queue_id": i % 2} for i, b in enumerate(WAITING)])
    with store.consumer("pb", TOPIC) as embedded:
        assert len(embedded.poll_batch(4, 1.0)) == 4
        assert len(embedded.poll_batch()) == 2 and embedded.poll_batch() == []
    with equeue.connect(broker.url) as client:
        with client.consumer("pb", TOPIC, auto_commit=False) as consumer:
            first = consumer.poll_batch(4, 5.0)
            assert 1 <= len(first) <= 4
            rest = consumer.poll_batch(timeout=1.0)
            while len(first) + len(rest) < len(WAITING):
                more = consumer.poll_batch(timeout=1.0)
                assert more
                rest += more
            assert sorted(m.body for m in first + rest) == WAITING
            assert consumer.poll_batch() == []
            consumer.commit()
        assert sum(client.committed_offset("pb", TOPIC, q) or 0 for q in (0, 1)) == 6

    async def main() -> list[bytes]:
        client = await equeue.aio.connect(broker.url)
        try:
            got: list[bytes] = []
            member: AsyncGroupConsumer = client.consumer("pb-aio", TOPIC)
            async with member:
                while len(got) < len(WAITING):
                    batch = await member.poll_batch(4, 5.0)
                    assert 1 <= len(batch) <= 4
                    got += [m.body for m in batch]
                assert await member.poll_batch() == []
            return sorted(got)
        finally:
            await client.close()

    assert asyncio.run(main()) == WAITING


def test_a_poll_batch_left_by_an_exception_comes_again(broker: BrokerProcess) -> None:
    # as the store's poll: the last batch counts as processed only once the caller comes back
    with equeue.connect(broker.url) as client:
        client.create_topic("pbx", 1)
        client.send_batch("pbx", [b"a", b"b", b"c"])
        with pytest.raises(RuntimeError), client.consumer("pbx", "pbx") as consumer:
            assert [m.body for m in consumer.poll_batch(3, 5.0)] == [b"a", b"b", b"c"]
            raise RuntimeError("the handler failed")
        assert client.committed_offset("pbx", "pbx", 0) in (None, 0)
        with client.consumer("pbx", "pbx", timeout=0.5) as consumer:
            assert [m.body for m in consumer] == [b"a", b"b", b"c"]


def test_a_poll_batch_over_batches_left_by_an_exception_comes_again(
    broker: BrokerProcess,
) -> None:
    # a poll_batch handing out the messages of several pulls (2 queues, batch_size 2):
    # none of them counts as processed before the caller comes back. A zero timeout: the
    # first poll pulls both queues at once and reads both answers (up to 1 s) before it
    # hands any out; with a timeout it returns once the first answer is read, and on a
    # loaded machine the other came late for each of the 6 polls (nothing spanned).
    with equeue.connect(broker.url) as client:
        client.create_topic("pby", 2)
        client.send_batch("pby", [{"body": b"%d" % i, "queue_id": i % 2} for i in range(12)])
        spanned: list[equeue.Message] = []
        with pytest.raises(RuntimeError), client.consumer("pby", "pby", batch_size=2) as consumer:
            for _ in range(100):  # (bounded: an empty poll takes up to 1 s)
                got = consumer.poll_batch(12, 0.0)
                if len(got) > 2:  # more than one pull's: hand them back unprocessed
                    spanned = got
                    raise RuntimeError("the handler failed")
            raise RuntimeError("no poll_batch spanned two pulls")
        assert len(spanned) > 2
        wanted = {m.body for m in spanned}
        again: set[bytes] = set()
        # (until they all came again, or none came for 30 s: 0.5 s was a window a loaded
        # machine's join and first pulls could pass)
        with client.consumer("pby", "pby", timeout=30.0) as consumer:
            for message in consumer:
                again.add(message.body)
                if wanted <= again:
                    break
        assert wanted <= again


def test_start_latest_still_reads_the_groups_retry_queue_from_its_start(
    broker: BrokerProcess,
) -> None:
    # the retry queue holds only the group's own nacked copies: "latest" never skips them
    with equeue.connect(broker.url) as client:
        client.create_topic("lr", 1)
        options: dict[str, Any] = {"start": "latest", "auto_commit": False, "timeout": 2.0}
        with client.consumer("lr-g", "lr", **options) as first:
            client.send("lr", b"m")
            message = next(iter(first))
            first.nack(message, delay=0)  # nothing committed: neither queue has an offset
        with client.consumer("lr-g", "lr", start="latest", timeout=2.0) as second:
            assert [m.body for m in second] == [b"m"]  # the copy, at its original place


def test_a_bad_timeout_after_good_ones_is_still_refused(broker: BrokerProcess) -> None:
    # poll remembers the last timeout it checked (the same object is not checked again):
    # a bad one after it, in a loop of the good one, is refused each time and takes nothing
    good = 5.0
    expected = ("InvalidMessageError", "timeout=-1.0 must be a finite number of seconds >= 0")
    with equeue.connect(broker.url) as client, client.consumer("good-bad", TOPIC) as consumer:
        bodies = []
        for bad in (-1.0, -1.0):
            found = consumer.poll(good)
            assert found is not None
            bodies.append(found.body)
            assert refusal(lambda: consumer.poll(bad)) == expected  # noqa: B023
            assert refusal(lambda: consumer.poll(math.nan))[0] == "InvalidMessageError"
        bodies += [m.body for m in consumer.poll_batch(len(WAITING), good)]
        while len(bodies) < len(WAITING) and (found := consumer.poll(good)) is not None:
            bodies.append(found.body)
        assert sorted(bodies) == WAITING

    async def main() -> list[bytes]:
        client = await equeue.aio.connect(broker.url)
        try:
            async with client.consumer("good-bad-aio", TOPIC) as member:
                got = []
                for bad in (-1.0, -1.0):
                    found = await member.poll(good)
                    assert found is not None
                    got.append(found.body)
                    assert await async_refusal(lambda: member.poll(bad)) == expected  # noqa: B023
                while len(got) < len(WAITING) and (found := await member.poll(good)) is not None:
                    got.append(found.body)
                return sorted(got)
        finally:
            await client.close()

    assert asyncio.run(main()) == WAITING


@pytest.mark.parametrize("first", [1, 2, 3, 4, 5])
def test_a_poll_batch_then_iteration_commits_every_message(
    broker: BrokerProcess, first: int
) -> None:
    # the iteration's first step marks the poll_batch's messages processed (the common
    # case skips that test while a message is in hand): closed, the group holds them all
    group = f"batch-then-iter-{first}"
    with equeue.connect(broker.url) as client:
        with client.consumer(group, TOPIC, batch_size=1, timeout=1.0) as consumer:
            bodies = [m.body for m in consumer.poll_batch(first, 5.0)]
            bodies += [m.body for m in consumer]
        assert sorted(bodies) == WAITING
        with client.consumer(group, TOPIC, timeout=0.5) as again:
            assert list(again) == []
