"""A state machine drives the store and a plain in-memory model side by side.

send / send_batch / pull / commit_offset / create_topic (grow) / reopen, with
small chunks so message chunks roll over; every pulled message is checked field
for field against the model, and so are next_offset, queue ranges, committed
offsets and key lookups.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import xxhash
from code_paths import code_path  # noqa: F401 - the fixture
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from equeue import Message, MessageStore, OutgoingMessage, SendResult, StoreConfig
from equeue.errors import InvalidMessageError


@dataclass(frozen=True)
class Sent:
    body: bytes
    tag: str
    key: str | None
    properties: dict[str, str]
    code: int
    message_id: str
    position: int


@dataclass(frozen=True)
class Outgoing:
    body: bytes
    tag: str
    key: str | None
    properties: dict[str, str]
    code: int
    queue_choice: int | None  # taken modulo the queue count when sent


TOPICS = ["alpha", "b"]
TAGS = ["", "x", "y", "\u00e9t\u00e9"]
KEYS = ["k1", "k2", "\u00fc", ""]
GROUPS = ["g1", "g2"]

bodies = st.one_of(st.binary(max_size=40), st.binary(min_size=200, max_size=900))
outgoing = st.builds(
    Outgoing,
    body=bodies,
    tag=st.sampled_from(TAGS),
    key=st.none() | st.sampled_from(KEYS),
    properties=st.dictionaries(
        st.sampled_from(["p", "q", "\u00fc"]), st.text(max_size=6), max_size=2
    ),
    code=st.integers(-(1 << 31), (1 << 31) - 1),
    queue_choice=st.none() | st.integers(0, 1000),
)
tag_filters: st.SearchStrategy[Any] = st.none() | st.sampled_from(
    ["x", "", "*", ["x", "y"], ["\u00e9t\u00e9"], ("y", "")]
)


class StoreMachine(RuleBasedStateMachine):
    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.store: MessageStore | None = None
        self.config = StoreConfig()
        self.model: dict[str, list[list[Sent]]] = {}
        self.offsets: dict[tuple[str, str, int], int] = {}
        self.last_round_robin: dict[str, int | None] = {}

    @property
    def s(self) -> MessageStore:
        assert self.store is not None
        return self.store

    @initialize(chunk_data_size=st.sampled_from([4096, 8192, 16384]))
    def open_store(self, chunk_data_size: int) -> None:
        self.config = StoreConfig(
            chunk_data_size=chunk_data_size, queue_chunk_records=400, default_queue_count=2
        )
        self.store = MessageStore.open(self.path, self.config)
        self.s.create_topic("alpha", 2)
        self.s.create_topic("b", 3)
        self.model = {"alpha": [[], []], "b": [[], [], []]}
        self.last_round_robin = {topic: None for topic in TOPICS}

    def teardown(self) -> None:
        if self.store is not None:
            self.store.close()

    # --- helpers ---------------------------------------------------------------------

    def expected_queue(self, topic: str, message: Outgoing) -> int | None:
        count = len(self.model[topic])
        if message.queue_choice is not None:
            return message.queue_choice % count
        if message.key is not None:
            return xxhash.xxh32_intdigest(message.key.encode()) % count
        return None

    def record(self, topic: str, message: Outgoing, result: SendResult) -> None:
        queues = self.model[topic]
        expected = self.expected_queue(topic, message)
        assert result.topic == topic
        if expected is None:  # round robin
            last = self.last_round_robin[topic]
            if last is not None:
                assert result.queue_id == (last + 1) % len(queues)
            self.last_round_robin[topic] = result.queue_id
        else:
            assert result.queue_id == expected
        queue = queues[result.queue_id]
        assert result.queue_offset == len(queue)
        assert result.message_id == f"{self.s.store_id:08x}{result.position:016x}"
        queue.append(
            Sent(
                message.body,
                message.tag,
                message.key,
                dict(message.properties),
                message.code,
                result.message_id,
                result.position,
            )
        )

    def check(self, message: Message, topic: str, queue_id: int, offset: int) -> None:
        sent = self.model[topic][queue_id][offset]
        assert message.topic == topic
        assert message.queue_id == queue_id
        assert message.queue_offset == offset
        assert message.message_id == sent.message_id
        assert message.position == sent.position
        assert message.body == sent.body
        assert type(message.body) is bytes
        assert message.tag == sent.tag
        assert message.key == sent.key
        assert message.properties == sent.properties
        assert message.code == sent.code
        assert message.created_at == message.stored_at

    def queue_of(self, topic: str, choice: int) -> int:
        return choice % len(self.model[topic])

    # --- rules -----------------------------------------------------------------------

    @rule(topic=st.sampled_from(TOPICS), message=outgoing)
    def send(self, topic: str, message: Outgoing) -> None:
        queue_id = None
        if message.queue_choice is not None:
            queue_id = self.queue_of(topic, message.queue_choice)
        result = self.s.send(
            topic,
            message.body,
            tag=message.tag,
            key=message.key,
            properties=message.properties or None,
            code=message.code,
            queue_id=queue_id,
        )
        last_position = max(
            (sent.position for queues in self.model.values() for q in queues for sent in q),
            default=-1,
        )
        assert result.position > last_position
        self.record(topic, message, result)

    @rule(topic=st.sampled_from(TOPICS), messages=st.lists(outgoing, min_size=1, max_size=6))
    def send_batch(self, topic: str, messages: list[Outgoing]) -> None:
        batch = [
            OutgoingMessage(
                m.body,
                tag=m.tag,
                key=m.key,
                properties=m.properties,
                code=m.code,
                queue_id=None if m.queue_choice is None else self.queue_of(topic, m.queue_choice),
            )
            for m in messages
        ]
        results = self.s.send_batch(topic, batch)
        assert len(results) == len(messages)
        positions = [r.position for r in results]
        assert positions == sorted(set(positions))
        for message, result in zip(messages, results, strict=True):
            self.record(topic, message, result)

    @rule(
        topic=st.sampled_from(TOPICS),
        count=st.integers(5, 40),
        size=st.integers(0, 1500),
        seed=st.integers(0, 255),
        batch=st.booleans(),
    )
    def send_many(self, topic: str, count: int, size: int, seed: int, batch: bool) -> None:
        """Volume, so that chunks roll over: generated messages, by batch or one by one."""
        messages = [
            Outgoing(
                body=bytes((seed + i + j) % 256 for j in range((size * (i + 1)) % 1501)),
                tag=TAGS[(seed + i) % len(TAGS)],
                key=None if (seed + i) % 3 == 0 else KEYS[(seed + i) % len(KEYS)],
                properties={"i": str(i)} if i % 2 else {},
                code=seed * 1000 + i,
                queue_choice=seed + i if i % 4 == 0 else None,
            )
            for i in range(count)
        ]
        if batch:
            self.send_batch(topic, messages)
        else:
            for message in messages:
                self.send(topic, message)

    @rule(
        topic=st.sampled_from(TOPICS),
        queue_choice=st.integers(0, 100),
        offset_choice=st.integers(0, 1000),
        max_count=st.integers(1, 12),
        tags=tag_filters,
    )
    def pull(
        self, topic: str, queue_choice: int, offset_choice: int, max_count: int, tags: Any
    ) -> None:
        queue_id = self.queue_of(topic, queue_choice)
        queue = self.model[topic][queue_id]
        offset = offset_choice % (len(queue) + 2)
        result = self.s.pull(topic, queue_id, offset, max_count=max_count, tags=tags)
        if tags is None or tags == "*":
            wanted = None
        else:
            wanted = {tags} if isinstance(tags, str) else set(tags)
        matching = [
            i for i in range(offset, len(queue)) if wanted is None or queue[i].tag in wanted
        ]
        expected = matching[:max_count]
        assert [m.queue_offset for m in result.messages] == expected
        for message in result.messages:
            self.check(message, topic, queue_id, message.queue_offset)
        if len(expected) == max_count:
            assert result.next_offset == expected[-1] + 1
        else:
            assert result.next_offset == len(queue)  # from past the end too: the end

    @rule(topic=st.sampled_from(TOPICS), queue_choice=st.integers(0, 100), pick=st.integers(0, 999))
    def get(self, topic: str, queue_choice: int, pick: int) -> None:
        queue_id = self.queue_of(topic, queue_choice)
        queue = self.model[topic][queue_id]
        if queue:
            offset = pick % len(queue)
            message = self.s.get(queue[offset].message_id)
            self.check(message, topic, queue_id, offset)
            assert self.s.read(queue[offset].position) == message

    @rule(
        group=st.sampled_from(GROUPS),
        topic=st.sampled_from(TOPICS),
        queue_choice=st.integers(0, 100),
        offset=st.integers(0, 50),
    )
    def commit_offset(self, group: str, topic: str, queue_choice: int, offset: int) -> None:
        queue_id = self.queue_of(topic, queue_choice)
        if offset > len(self.model[topic][queue_id]):  # past the queue's end: refused
            with pytest.raises(InvalidMessageError, match="past the queue's end"):
                self.s.commit_offset(group, topic, queue_id, offset)
            assert self.s.committed_offset(group, topic, queue_id) == self.offsets.get(
                (group, topic, queue_id)
            )
            return
        self.s.commit_offset(group, topic, queue_id, offset)
        self.offsets[(group, topic, queue_id)] = offset
        assert self.s.committed_offset(group, topic, queue_id) == offset

    @precondition(lambda self: len(self.model.get("b", [])) < 5)
    @rule()
    def grow_topic(self) -> None:
        count = len(self.model["b"]) + 1
        self.s.create_topic("b", count)
        self.model["b"].append([])

    @rule()
    def reopen(self) -> None:
        self.s.close()
        self.store = MessageStore.open(self.path, self.config)
        assert self.s.recovery.clean, self.s.recovery
        self.last_round_robin = {topic: None for topic in TOPICS}
        assert self.s.topics() == sorted(self.model)
        for key in KEYS:
            for topic, queues in self.model.items():
                with_key = sorted(
                    (sent for q in queues for sent in q if sent.key == key),
                    key=lambda sent: -sent.position,
                )
                found = self.s.query_by_key(topic, key, limit=1000)
                assert [m.message_id for m in found] == [sent.message_id for sent in with_key]

    # --- invariants --------------------------------------------------------------------

    @invariant()
    def queue_ranges_match(self) -> None:
        if self.store is None:
            return
        for topic, queues in self.model.items():
            assert self.s.queue_ids(topic) == list(range(len(queues)))
            for queue_id, queue in enumerate(queues):
                assert self.s.queue_range(topic, queue_id) == (0, len(queue))

    @invariant()
    def committed_offsets_match(self) -> None:
        if self.store is None:
            return
        for (group, topic, queue_id), offset in self.offsets.items():
            assert self.s.committed_offset(group, topic, queue_id) == offset


@pytest.mark.usefixtures("code_path")  # on the C and the Python paths
def test_store_state_machine(tmp_path: Path) -> None:
    runs = itertools.count()

    class Machine(StoreMachine):
        def __init__(self) -> None:
            super().__init__(tmp_path / f"run-{next(runs)}")

    run_state_machine_as_test(
        Machine,
        settings=settings(
            max_examples=30,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        ),
    )
