"""A hypothesis state machine against the group coordinator: members join, leave,
heartbeat (reporting, or not yet, the assignment they applied), apply their last
answer, die silently; time passes; topics gain queues. After every step:

* the coordinator's members are those the model expects alive (joined, not left, not
  silent past their session timeout at a tick);
* the target is the average allocation of the live members over the topic's queues,
  the retry queue to the member with fewest of them;
* what live members pull (the assignment each applied) never overlaps, and each queue
  a member pulls is one it holds (check_owner passes): a revoked queue is not handed on
  before its holder released it or expired;
* once every member applied its answer twice, each pulls exactly its target slice.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from equeue import MessageStore
from equeue.errors import GroupError
from equeue.server import groups
from equeue.server.groups import GroupCoordinator, allocate

CONSUMERS = ["c0", "c1", "c2"]
TIMEOUT_MS = 1000
Q = tuple[str, int]


@dataclass
class Client:
    last_seen: float
    answer: tuple[int, frozenset[Q]]  # the last assignment answered
    applied: int | None = None  # the generation of the assignment it pulls
    pulling: frozenset[Q] = field(default_factory=frozenset)
    alive: bool = True  # False: the process died, it sends nothing more


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Shared:
    """One store for every example (opening one per example cost most of the test's
    time); each example has a topic and a group of its own."""

    store: MessageStore | None = None
    examples = 0


@pytest.fixture(scope="module", autouse=True)
def shared_store() -> Iterator[None]:
    directory = tempfile.mkdtemp(prefix="eqg", dir="/tmp")
    Shared.store = MessageStore.open(Path(directory) / "s")
    try:
        yield
    finally:
        Shared.store.close()
        Shared.store = None
        shutil.rmtree(directory, ignore_errors=True)


class Groups(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        assert Shared.store is not None
        self.store = Shared.store
        Shared.examples += 1
        self.topic = f"t{Shared.examples}"
        self.group = f"g{Shared.examples}"
        self.store.create_topic(self.topic, 5)
        self.clock = Clock()
        self.coord = GroupCoordinator(self.store, clock=self.clock, wall_clock=self.clock)
        self.clients: dict[str, Client] = {}  # members the model expects the group to have
        self.generation = 0
        self.queue_count = 5  # the topic's, at the group's last rebalance

    def _took(self, consumer: str, answer: dict[str, object]) -> None:
        generation = answer["generation"]
        assert isinstance(generation, int) and generation >= self.generation
        self.generation = generation
        assignment = answer["assignment"]
        assert isinstance(assignment, list)
        self.clients[consumer].answer = (generation, frozenset((t, q) for t, q in assignment))

    @rule(consumer=st.sampled_from(CONSUMERS))
    def join(self, consumer: str) -> None:
        before = self.generation
        self.clients[consumer] = Client(self.clock.now, (0, frozenset()))  # (re)started
        self._took(consumer, self.coord.join(self.group, consumer, [self.topic], TIMEOUT_MS))
        assert self.generation == before + 1
        self.queue_count = len(self.store.queue_ids(self.topic))

    def _pick(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(sorted(c for c, m in self.clients.items() if m.alive)))

    def _any_alive(self) -> bool:
        return any(m.alive for m in self.clients.values())

    @precondition(_any_alive)
    @rule(data=st.data())
    def leave(self, data: st.DataObject) -> None:
        consumer = self._pick(data)
        before = self.generation
        self.coord.leave(self.group, consumer)
        del self.clients[consumer]
        self.generation = before + 1
        self.queue_count = len(self.store.queue_ids(self.topic))

    @precondition(_any_alive)
    @rule(data=st.data(), apply=st.booleans(), report=st.booleans())
    def beat(self, data: st.DataObject, apply: bool, report: bool) -> None:
        """A member's heartbeat thread beats; ``apply``: its loop applied the last answer
        first; ``report``: the beat says which generation it applied (else none)."""
        self.heartbeat(self._pick(data), apply, report)

    def heartbeat(self, consumer: str, apply: bool, report: bool) -> None:
        client = self.clients[consumer]
        if apply:
            self.apply(consumer)
        generation = client.applied if report else None
        client.last_seen = self.clock.now
        self._took(consumer, self.coord.heartbeat(self.group, consumer, generation=generation))

    def apply(self, consumer: str) -> None:
        client = self.clients.get(consumer)
        if client is None or not client.alive:
            return
        client.applied, client.pulling = client.answer

    @precondition(_any_alive)
    @rule(data=st.data())
    def die(self, data: st.DataObject) -> None:
        self.clients[self._pick(data)].alive = False

    @rule(seconds=st.sampled_from([0.1, 0.4, 0.9, 1.5]))
    def time_passes(self, seconds: float) -> None:
        # a tick every TICK_S, as the broker's loop runs them (a tick later than
        # LATE_TICK_S is a stall of the broker, not charged to the members:
        # tests/test_groups_fencing.py)
        for _ in range(round(seconds / groups.TICK_S)):
            self.clock.now += groups.TICK_S
            self.tick()

    @rule()
    def tick(self) -> None:
        expired = [
            c for c, m in self.clients.items() if self.clock.now - m.last_seen > TIMEOUT_MS / 1000
        ]
        grown = len(self.store.queue_ids(self.topic)) != self.queue_count
        before = self.generation
        self.coord.tick()
        for consumer in expired:
            del self.clients[consumer]
        if expired or (grown and self.clients):
            self.generation = before + 1
            self.queue_count = len(self.store.queue_ids(self.topic))
            stats = self.coord.stats().get(self.group)
            assert stats is None or stats["generation"] == self.generation

    @rule(count=st.integers(min_value=5, max_value=9))
    def topic_grows(self, count: int) -> None:
        self.store.create_topic(self.topic, max(count, len(self.store.queue_ids(self.topic))))

    @rule()
    def settle(self) -> None:
        for _ in range(2):
            for consumer, client in list(self.clients.items()):
                if client.alive:
                    self.heartbeat(consumer, False, True)
                    self.apply(consumer)
        alive = [c for c, m in self.clients.items() if m.alive]
        if len(alive) != len(self.clients):
            return  # a dead member's queues wait for its expiry
        self.tick()  # queues the topic gained
        for _ in range(3):  # apply, report; hand over; the new holder hears of it
            for consumer in alive:
                self.heartbeat(consumer, False, True)
                self.apply(consumer)
        target = self._target()
        for consumer in alive:
            want = frozenset(q for q, c in target.items() if c == consumer)
            assert self.clients[consumer].pulling == want, consumer

    def _queues(self) -> list[Q]:
        topic = self.topic
        return [
            (f"equeue.retry.{self.group}", 0),
            *((topic, q) for q in self.store.queue_ids(topic)),
        ]

    def _target(self) -> dict[Q, str]:
        return _allocate(list(self.clients), self._queues())

    @invariant()
    def members_are_the_expected_ones(self) -> None:
        stats = self.coord.stats().get(self.group)
        members = set() if stats is None else set(stats["members"])
        assert members == set(self.clients)
        for consumer in set(CONSUMERS) - members:
            try:
                self.coord.heartbeat(self.group, consumer)
            except GroupError:
                continue
            raise AssertionError(f"{consumer} is not a member, yet its heartbeat was answered")

    @invariant()
    def target_is_the_average_allocation(self) -> None:
        stats = self.coord.stats().get(self.group)
        if stats is None:
            return
        target = {(t, q): want for t, q, _, want in stats["assignment"]}
        queues = sorted(target)
        assert target == _allocate(list(self.clients), queues)

    @invariant()
    def one_consumer_per_queue(self) -> None:
        seen: dict[Q, str] = {}
        for consumer, client in self.clients.items():
            for queue in client.pulling:
                assert queue not in seen, f"{queue} pulled by {seen[queue]} and {consumer}"
                seen[queue] = consumer
                self.coord.check_owner(self.group, consumer, *queue)


Groups.TestCase.settings = settings(max_examples=150, stateful_step_count=15, deadline=None)
TestGroups = Groups.TestCase


def _allocate(consumers: list[str], queues: list[Q]) -> dict[Q, str]:
    retry = [q for q in queues if q[0].startswith("equeue.retry.")]
    return allocate(consumers, [q for q in queues if q not in retry], retry)
