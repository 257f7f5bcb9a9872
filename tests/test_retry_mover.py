"""The retry mover when a move fails (review 36, F2): a copy the store refuses is
dead-lettered and the others move once; a write failure at any send keeps what was
moved and moves nothing twice; the broker's other periodic jobs go on while the mover
fails; a broker SIGKILLed in the middle of a move (tests/mover_kill_child.py)."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from server_helpers import raw, short_dir

from equeue import Message, MessageStore, StoreConfig
from equeue.errors import DiskFullError
from equeue.protocol.records import unpack_message
from equeue.server import BrokerThread, retry
from equeue.server.groups import GroupCoordinator
from equeue.server.periodic import PeriodicJobs

HERE = Path(__file__).parent
BOUND_S = 20.0  # every wait below ends by then
BIG = 3 << 20  # fits the default max_message_size, not the reopened store's
LIMIT = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def everything(store: MessageStore, topic: str) -> list[Message]:
    if topic not in store.topics():
        return []
    found: list[Message] = []
    for queue_id in store.queue_ids(topic):
        found += store.pull(topic, queue_id, 0, 1000).messages
    return found


def bodies(store: MessageStore, topic: str) -> list[bytes]:
    return [m.body for m in everything(store, topic)]


def coordinator(store: MessageStore, clock: Clock) -> GroupCoordinator:
    coord = GroupCoordinator(store, clock=clock, wall_clock=clock, retry_delays=(1.0, 5.0, 30.0))
    coord.join("ga", "a", ["t"], 600_000)
    coord.join("gb", "b", ["u"], 600_000)
    return coord


def nack(store: MessageStore, coord: GroupCoordinator, group: str, body: bytes, ms: int) -> str:
    topic, consumer = ("t", "a") if group == "ga" else ("u", "b")
    sent = store.send(topic, body)
    coord.nack(group, consumer, sent.message_id, ms)
    return sent.message_id


@pytest.fixture
def path(tmp_path: Path) -> Path:
    with MessageStore.open(tmp_path / "s") as store:
        store.create_topic("t", 1)
        store.create_topic("u", 1)
    return tmp_path / "s"


def test_a_copy_past_a_lowered_limit_is_dead_lettered_and_the_other_group_gets_one_copy(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The review's reproduction: group ga's 3 MiB copy at level 1 and group gb's small
    one at level 0, both due once the store is reopened with max_message_size 1 MiB.
    Before: each tick appended gb's copy again (38 in 4 s) and raised on ga's, for ever."""
    clock = Clock()
    with MessageStore.open(path) as store:
        coord = coordinator(store, clock)
        big = nack(store, coord, "ga", b"B" * BIG, 5000)
        nack(store, coord, "gb", b"small", 1000)
    clock.now += 6.0
    with (
        MessageStore.open(path, StoreConfig(max_message_size=LIMIT)) as store,
        caplog.at_level(logging.WARNING, "equeue.retry"),
    ):
        coord = coordinator(store, clock)
        for _ in range(5):
            coord.tick()
            clock.now += 0.1
        assert bodies(store, retry.retry_topic("gb")) == [b"small"]
        assert bodies(store, retry.retry_topic("ga")) == []
        (dead,) = everything(store, retry.dead_letter_topic("ga"))
        assert dead.body == b"B" * LIMIT
        assert dead.properties[retry.DLQ_BODY_SIZE] == str(BIG)
        assert dead.properties[retry.ORIGIN_ID] == big
        assert dead.properties[retry.ORIGIN_TOPIC] == "t"
        assert "max_message_size" in dead.properties[retry.DLQ_REASON]
        assert coord.retries.pending() == 0
        assert (coord.retries.moved, coord.retries.dead) == (1, 1)
    said = [r for r in caplog.records if r.name == "equeue.retry"]
    assert [r.levelname for r in said] == ["WARNING"]  # once; no error, no traceback
    text = said[0].getMessage()
    assert "'ga'" in text and f"message {big}, first at t/0 offset 0" in text
    assert "StoreConfig.max_message_size" in text and retry.dead_letter_topic("ga") in text
    with MessageStore.open(path, StoreConfig(max_message_size=LIMIT)) as store:
        coordinator(store, clock).tick()  # the cursors were written: nothing moves again
        assert bodies(store, retry.retry_topic("gb")) == [b"small"]
        assert len(everything(store, retry.dead_letter_topic("ga"))) == 1


def test_a_refused_copy_inside_a_run_of_its_group_passes_alone(path: Path) -> None:
    """One level, the groups' copies interleaved, ga's too large one between two of its
    small ones: the small ones move, in order, the large one is dead-lettered."""
    clock = Clock()
    with MessageStore.open(path) as store:
        coord = coordinator(store, clock)
        nack(store, coord, "gb", b"b0", 1000)
        nack(store, coord, "ga", b"a0", 1000)
        nack(store, coord, "ga", b"B" * BIG, 1000)
        nack(store, coord, "ga", b"a1", 1000)
        nack(store, coord, "gb", b"b1", 1000)
    clock.now += 1.0
    with MessageStore.open(path, StoreConfig(max_message_size=LIMIT)) as store:
        coord = coordinator(store, clock)
        coord.tick()
        coord.tick()
        assert bodies(store, retry.retry_topic("ga")) == [b"a0", b"a1"]
        assert bodies(store, retry.retry_topic("gb")) == [b"b0", b"b1"]
        assert [len(b) for b in bodies(store, retry.dead_letter_topic("ga"))] == [LIMIT]
        assert store.committed_offset(retry.MOVER_GROUP, retry.DELAY_TOPIC, 0) == 5


# Due copies: level 0 holds ga's a0 a1 a2, gb's b0 b1, ga's a3; level 1 gb's b2 b3;
# level 2 ga's a4. The mover's sends, one per run: [a0 a1 a2] [b0 b1] [a3] [b2 b3] [a4].
LAYOUT = [("ga", 0), ("ga", 0), ("ga", 0), ("gb", 0), ("gb", 0), ("ga", 0), ("gb", 1),
          ("gb", 1), ("ga", 2)]  # fmt: skip
SENDS = 5


@pytest.mark.parametrize("partial", [False, True], ids=["nothing-stored", "cut-short"])
@pytest.mark.parametrize("failing_send", range(SENDS))
def test_a_write_failure_at_any_send_moves_every_copy_exactly_once(
    path: Path,
    failing_send: int,
    partial: bool,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The disk fills at the mover's n-th send (nothing stored, or a batch cut short with
    its first copy stored, as the store does on ENOSPC) and stays full for 3 ticks.
    Before: the runs appended before the failure were appended again at every tick."""
    clock = Clock()
    delays = (1000, 5000, 30_000)
    with MessageStore.open(path) as store:
        coord = coordinator(store, clock)
        counters = Counter[str]()
        expected: dict[str, list[bytes]] = {"ga": [], "gb": []}
        for group, level in LAYOUT:
            body = b"%s%d" % (group[1:].encode(), counters[group])
            counters[group] += 1
            expected[group].append(body)
            nack(store, coord, group, body, delays[level])
        clock.now += 31.0
        real = store.send_batch
        calls = []
        full = {"on": False}

        def send_batch(topic: str, messages: Any) -> Any:
            calls.append(topic)
            if len(calls) - 1 == failing_send:
                full["on"] = True
                if partial and len(messages) > 1:
                    error = DiskFullError(28, "No space left on device (injected)")
                    error.sent = real(topic, messages[:1])
                    raise error
            if full["on"]:
                raise DiskFullError(28, "No space left on device (injected)")
            return real(topic, messages)

        monkeypatch.setattr(store, "send_batch", send_batch)
        with caplog.at_level(logging.INFO, "equeue.retry"):
            for _ in range(3):
                coord.tick()  # no exception out of the tick
            full["on"] = False
            for _ in range(3):
                coord.tick()
        assert bodies(store, retry.retry_topic("ga")) == expected["ga"]
        assert bodies(store, retry.retry_topic("gb")) == expected["gb"]
        assert coord.retries.pending() == 0
        assert coord.retries.moved == len(LAYOUT)
        for level, end in enumerate((6, 2, 1)):
            assert store.committed_offset(retry.MOVER_GROUP, retry.DELAY_TOPIC, level) == end
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "equeue.retry"]
    assert [level for level, _ in said] == ["ERROR", "WARNING"], said
    assert "could not append a due copy" in said[0][1] and "No space left" in said[0][1]
    assert "works again after 3 failed ticks" in said[1][1]


def test_the_other_periodic_jobs_go_on_while_the_mover_fails(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The mover raising at every tick: a held pull still sees a message appended beside
    the broker (only the tick's poll does), the stats rates are still sampled, and the
    failure is logged once. Before: all three shared one try, skipped at every tick."""
    directory = short_dir()
    try:
        with MessageStore.open(directory / "s") as store:
            store.create_topic("t", 1)
            thread = BrokerThread(store).start()
            try:
                broker = thread.broker
                assert broker.coordinator is not None

                def fail() -> int:
                    raise RuntimeError("injected: the mover fails")

                with caplog.at_level(logging.ERROR, "equeue.server"):
                    monkeypatch.setattr(broker.coordinator.retries, "move_due", fail)
                    samples = len(broker.counters._samples)
                    with raw(thread.urls[0]) as a:
                        held = a.request("pull", topic="t", queue_id=0, offset=0, wait_ms=60_000)
                        deadline = time.monotonic() + BOUND_S
                        while broker.holds.count != 1:
                            assert time.monotonic() < deadline, "the pull was never held"
                            time.sleep(0.01)
                        store.send("t", b"beside")  # not through the broker
                        status, payload = a.answers(1)[held]
                        assert status == 0
                        assert [unpack_message(m, "t").body for m in payload[0]] == [b"beside"]
                    while len(broker.counters._samples) < samples + 2:
                        assert time.monotonic() < deadline, "the rates were never sampled"
                        time.sleep(0.05)
            finally:
                thread.stop()
        failures = [r for r in caplog.records if "injected: the mover fails" in r.getMessage()
                    or (r.exc_info and "injected" in str(r.exc_info[1]))]  # fmt: skip
        assert len(failures) == 1, [r.getMessage() for r in failures]
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_a_periodic_job_failing_every_tick_is_logged_once_a_minute_then_when_it_works(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    jobs = PeriodicJobs(logging.getLogger("equeue.server"), clock)
    failing = True
    others: list[int] = []

    def job() -> None:
        if failing:
            raise RuntimeError("injected")

    with caplog.at_level(logging.WARNING, "equeue.server"):
        for _ in range(481):  # 125 ms ticks (exact in a float): the last 60 s after the first
            jobs.run("mover", job)
            jobs.run("sample", lambda: others.append(1))
            clock.now += 0.125
        assert len(others) == 481
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 2 and "periodic mover failed (it runs" in said[0]
        assert "failed again (481 runs failed so far)" in said[1]
        assert all(r.exc_info for r in caplog.records)  # the tracebacks
        failing = False
        jobs.run("mover", job)
        jobs.run("mover", job)
    said = [r.getMessage() for r in caplog.records]
    assert said[2:] == ["the broker's periodic mover works again after 481 failed runs"]


def _due_in_two_levels(path: Path) -> dict[str, str]:
    """Due copies (their due times an hour ago): level 0 ga's a0 a1 then gb's b0, level
    1 gb's b1 then ga's a2. Their origin message ids by body."""
    clock = Clock()
    clock.now = time.time() - 3600.0
    with MessageStore.open(path) as store:
        coord = GroupCoordinator(store, clock=clock, wall_clock=clock)
        coord.join("ga", "a", ["t"], 600_000)
        coord.join("gb", "b", ["u"], 600_000)
        ids = {}
        for group, body, ms in [("ga", b"a0", 1000), ("ga", b"a1", 1000), ("gb", b"b0", 1000),
                                ("gb", b"b1", 5000), ("ga", b"a2", 5000)]:  # fmt: skip
            ids[body.decode()] = nack(store, coord, group, body, ms)
    return ids


# How often each copy is in the retry topics after the restart: the first run appended
# before the kill is moved again; so is everything when the kill comes before the
# cursor file was written; nothing once it was.
AFTER_KILL = {
    "appended": {"a0": 2, "a1": 2, "b0": 1, "b1": 1, "a2": 1},
    "flush": dict.fromkeys(("a0", "a1", "b0", "b1", "a2"), 2),
    "cursor": dict.fromkeys(("a0", "a1", "b0", "b1", "a2"), 2),
    "written": dict.fromkeys(("a0", "a1", "b0", "b1", "a2"), 1),
}


@pytest.mark.parametrize("point", list(AFTER_KILL))
def test_a_broker_sigkilled_in_a_move_moves_again_only_that_move(point: str) -> None:
    """docs/groups.md's crash window: from the move's first append to the end of the
    cursor file's write, a SIGKILL moves that tick's copies again at the restart (at
    least once); none is lost, none is moved a third time."""
    directory = short_dir()
    try:
        path = directory / "s"
        with MessageStore.open(path) as store:
            store.create_topic("t", 1)
            store.create_topic("u", 1)
        ids = _due_in_two_levels(path)
        child = subprocess.run(
            [sys.executable, str(HERE / "mover_kill_child.py"), str(path), point],
            capture_output=True, timeout=60,
        )  # fmt: skip
        assert child.returncode == -9, child.stderr.decode()[-3000:]
        assert child.stdout.decode().split() == ["KILLING", point]
        with MessageStore.open(path) as store:
            coord = GroupCoordinator(store)
            for _ in range(3):
                coord.tick()
            moved = Counter(
                m.body.decode()
                for group in ("ga", "gb")
                for m in everything(store, retry.retry_topic(group))
            )
            assert moved == AFTER_KILL[point]
            assert {m.properties[retry.ORIGIN_ID] for m in everything(
                store, retry.retry_topic("ga"))} == {ids["a0"], ids["a1"], ids["a2"]}  # fmt: skip
            assert coord.retries.pending() == 0
    finally:
        shutil.rmtree(directory, ignore_errors=True)
