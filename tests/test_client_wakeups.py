"""The blocking client's waiting threads against the real broker: an answer wakes the
thread it is for (and the end of a reader's turn one thread to take it), not every
waiting thread; no thread is left asleep with its answer read (many threads mixing
round trips, long polls answered by sends and long polls that time out; a broker
killed under held polls). Interrupted threads: test_client_interrupts.py."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from client_helpers import BrokerProcess, temporary_broker

import equeue
from equeue.errors import ConnectionLostError


@pytest.fixture
def broker() -> Iterator[BrokerProcess]:
    with temporary_broker() as running:
        yield running


def _run(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)


def test_an_answer_wakes_its_own_thread_not_every_waiting_one(broker: BrokerProcess) -> None:
    pollers, pingers, calls = 6, 2, 150
    client = equeue.connect(broker.url, timeout=20)
    sleeps: Counter[int] = Counter()
    sleep = client._sleep

    def counted(*args: Any) -> None:
        sleeps[threading.get_ident()] += 1  # (the GIL: += on a Counter is safe here)
        sleep(*args)

    client._sleep = counted  # type: ignore[method-assign,assignment]
    errors: list[BaseException] = []

    def poll(queue_id: int) -> None:
        try:  # held by the broker until the message sent to its queue at the end
            assert len(client.pull("t", queue_id, 0, 1, wait=15.0)) == 1
        except BaseException as exc:
            errors.append(exc)

    def ping() -> None:
        try:
            for _ in range(calls):
                client.ping()
        except BaseException as exc:
            errors.append(exc)

    try:
        client.create_topic("t", pollers)
        held = [threading.Thread(target=poll, args=(q,)) for q in range(pollers)]
        for t in held:
            t.start()
        for _ in range(500):  # (bounded: 10 s) until the broker holds every long poll
            if client.stats()["held_pulls"] == pollers:
                break
            time.sleep(0.02)
        _run([threading.Thread(target=ping) for _ in range(pingers)])
        for q in range(pollers):
            client.send("t", b"wake", queue_id=q)
        for t in held:
            t.join(30)
        assert not any(t.is_alive() for t in held) and not errors, errors
        # While the pings go on, the long polls' threads (but the one reading) sleep: woken
        # at every answer (notify_all), each would go to sleep again once per ping; woken
        # only for their own answer or for the reader's turn, about once in all.
        total = pingers * calls
        assert sum(sleeps.values()) <= 2 * total + 4 * pollers, (sum(sleeps.values()), total)
    finally:
        client.close()


def test_many_threads_mixing_long_polls_and_round_trips_all_get_their_answers(
    broker: BrokerProcess,
) -> None:
    # A lost wake-up leaves a thread asleep until its deadline: ConnectionLostError
    # (timeout=10 s) instead of its answer.
    client = equeue.connect(broker.url, timeout=10)
    client.create_topic("m", 4)
    client.create_topic("e", 4)  # never sent to
    errors: list[BaseException] = []
    got: Counter[str] = Counter()

    def pinger() -> None:
        try:
            for _ in range(100):
                client.ping()
            got["ping"] += 1
        except BaseException as exc:
            errors.append(exc)

    def sender() -> None:
        try:
            for i in range(50):
                client.send("m", b"x", queue_id=i % 4)
            got["send"] += 1
        except BaseException as exc:
            errors.append(exc)

    def empty_poller(queue_id: int) -> None:
        try:
            for _ in range(10):  # waits of 20 ms that end without a message
                assert len(client.pull("e", queue_id, 0, 1, wait=0.02)) == 0
            got["empty"] += 1
        except BaseException as exc:
            errors.append(exc)

    def long_poller(queue_id: int) -> None:
        try:  # held until the sender's first message on its queue
            result = client.pull("m", queue_id, 0, 1, wait=8.0)
            assert len(result) == 1
            got["long"] += 1
        except BaseException as exc:
            errors.append(exc)

    try:
        lanes = [threading.Thread(target=long_poller, args=(q,)) for q in range(4)]
        lanes += [threading.Thread(target=pinger) for _ in range(6)]
        lanes += [threading.Thread(target=empty_poller, args=(q,)) for q in range(4)]
        lanes += [threading.Thread(target=sender) for _ in range(2)]
        _run(lanes)
        assert not errors, errors
        assert got == {"long": 4, "ping": 6, "empty": 4, "send": 2}
        assert sum(client.queue_range("m", q)[1] for q in range(4)) == 100
    finally:
        client.close()


def test_a_broker_killed_under_held_polls_wakes_every_waiting_thread(
    broker: BrokerProcess,
) -> None:
    """Each thread asleep for its answer gets ConnectionLostError from the break, not
    after its own deadline (600 s + its wait: past the 60 s the test waits)."""
    client = equeue.connect(broker.url, timeout=600)
    client.create_topic("k", 6)
    errors: list[BaseException] = []

    def poll(queue_id: int) -> None:
        try:
            client.pull("k", queue_id, 0, 1, wait=20.0)
        except BaseException as exc:
            errors.append(exc)

    try:
        held = [threading.Thread(target=poll, args=(q,), daemon=True) for q in range(6)]
        for t in held:
            t.start()
        for _ in range(500):  # (bounded: 10 s) until the broker holds every long poll
            if client.stats()["held_pulls"] == 6:
                break
            time.sleep(0.02)
        broker.kill()
        end = time.monotonic() + 60
        for t in held:
            t.join(max(0.0, end - time.monotonic()))
        assert not any(t.is_alive() for t in held)
        assert len(errors) == 6 and all(isinstance(e, ConnectionLostError) for e in errors)
        broker.start()
        client.ping()  # the next call reconnects
    finally:
        client.close()
