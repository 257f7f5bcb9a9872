"""A consumer group of 3 processes on a topic of 8 queues, 2 producer processes, a broker
process (`equeue serve`); one consumer is SIGKILLed mid-run. Every message a producer saw
acknowledged is consumed; each member sees each queue in offset order; the killed
member's queues move to the others after its session timeout, and what it had consumed
past its group's committed offset is consumed again by the others (none lost).
Producers: tests/broker_producer.py; consumers: tests/group_consumer_child.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from server_helpers import short_home
from test_server_kill import acknowledged, start_broker

import equeue
from equeue import MessageStore

HERE = Path(__file__).parent
TOPIC = "p"  # broker_producer.py's topic
GROUP = "workers"
# The others': long, so that a loaded machine does not expire them (a member that joins
# again reads again from its commits, which this test would take for a disorder).
SESSION = 6.0
# The victim's: its queues move this long after its last heartbeat.
VICTIM_SESSION = 3.0
PER_PRODUCER = 3000


home = pytest.fixture(short_home, name="home")


class Lines:
    """A process and the lines it printed, read by a thread as they come (a pipe left
    unread would stop it once full)."""

    def __init__(self, command: list[str], log: Path) -> None:
        self.log = log  # its stderr, for the message of a failed wait
        with open(log, "wb") as stderr:
            self.process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr
            )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            self.lines.append(raw.decode().rstrip("\n"))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)
        self.reader.join(10)


class Member(Lines):
    """A consumer process (tests/group_consumer_child.py)."""

    def __init__(self, url: str, name: str, work_ms: float, session: float, log: Path) -> None:
        self.name = name
        super().__init__(
            [sys.executable, str(HERE / "group_consumer_child.py"), url, GROUP, TOPIC, name,
             "--session", str(session), "--work-ms", str(work_ms)],
            log,
        )  # fmt: skip

    def messages(self) -> list[tuple[int, int, str]]:
        found = []
        for line in list(self.lines):
            if line.startswith("M "):
                _, queue_id, offset, message_id = line.split()
                found.append((int(queue_id), int(offset), message_id))
        return found


def wait_for(condition: object, what: str, processes: Sequence[Lines], limit: float = 60.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            logs = "\n".join(
                f"{p.log.name}: {len(p.lines)} lines, last {p.lines[-1:]}, rc {p.process.poll()}: "
                f"{p.log.read_text()[-2000:]}"
                for p in processes
            )
            raise AssertionError(f"timed out waiting for {what}\n{logs}")
        time.sleep(0.05)


def test_sigkilled_member_queues_move_and_nothing_is_lost(home: Path) -> None:
    store = home / "s"
    with MessageStore.open(store) as created:
        created.create_topic(TOPIC, 8)
    broker, url = start_broker(store)
    members: list[Member] = []
    producers: list[Lines] = []
    try:
        # c1, the one killed, is slow: it never runs out of messages, so it commits only
        # every auto_commit_interval and dies with messages processed past its commits
        members = [
            Member(url, "c0", 0.0, SESSION, home / "c0.log"),
            Member(url, "c1", 4.0, VICTIM_SESSION, home / "c1.log"),
            Member(url, "c2", 0.0, SESSION, home / "c2.log"),
        ]
        wait_for(lambda: all("READY" in m.lines for m in members), "the members to join", members)
        with equeue.connect(url) as client:  # the producers start once each holds its share

            def settled() -> bool:
                group = client.stats(GROUP)["coordinator"].get(GROUP, {})
                held = [len(m["queues"]) for m in group.get("members", {}).values()]
                return held == [3, 3, 3]

            wait_for(settled, "the queues to be divided", members)
        producers = [
            Lines([sys.executable, str(HERE / "broker_producer.py"), url, f"p{i}",
                   "--limit", str(PER_PRODUCER)], home / f"p{i}.log")
            for i in range(2)
        ]  # fmt: skip
        victim = members[1]
        wait_for(
            lambda: len(victim.messages()) >= 100, "the victim to consume", members + producers
        )
        time.sleep(1.2)  # past its auto_commit_interval: it has committed some
        victim.process.send_signal(signal.SIGKILL)
        victim.stop()
        consumed_by_victim = victim.messages()
        acks: dict[str, str] = {}
        for number, producer in enumerate(producers):
            assert producer.process.wait(120) == 0
            producer.reader.join(30)
            assert producer.lines[-1] == f"END {PER_PRODUCER}"
            for seq, message_id in acknowledged("\n".join(producer.lines)).items():
                acks[message_id] = f"p{number}:{seq}"
        assert len(acks) == 2 * PER_PRODUCER
        survivors = [members[0], members[2]]

        def survivors_ids() -> set[str]:
            return {mid for m in survivors for _, _, mid in m.messages()}

        victim_ids = {mid for _, _, mid in consumed_by_victim}
        wait_for(
            lambda: set(acks) <= survivors_ids() | victim_ids,
            "every message to be consumed",
            members,
        )
        # Where the victim's last commit left each of its queues: where the survivor that
        # took it over started (nobody held it in between). Read so, not from the broker
        # right after the kill: that read had to beat the handover (a timed assertion).
        committed: dict[int, int] = {}
        for q in {q for q, _, _ in consumed_by_victim}:
            taken_at = [off for m in survivors for q2, off, _ in m.messages() if q2 == q]
            # none: no message came after its last commit of q (all of q was committed)
            mine = [off for q2, off, _ in consumed_by_victim if q2 == q]
            committed[q] = min(taken_at) if taken_at else max(mine) + 1
        # what the victim consumed at or past the committed offset comes again to the others
        uncommitted = {mid for q, off, mid in consumed_by_victim if off >= committed[q]}
        assert uncommitted, "the victim had committed everything it consumed"
        assert any(committed[q] for q, _, _ in consumed_by_victim), "it committed nothing"
        wait_for(
            lambda: uncommitted <= survivors_ids(), "the victim's uncommitted messages", members
        )
        time.sleep(0.5)  # anything more the survivors print is checked below too
    finally:
        for process in [*producers, *members]:
            process.stop()
        broker.send_signal(signal.SIGTERM)
        try:
            broker.wait(60)
        finally:
            if broker.poll() is None:
                broker.kill()
                broker.wait()
    victim_queues = {q for q, _, _ in consumed_by_victim}
    assert victim_queues, "the victim consumed nothing"
    for member in survivors:
        per_queue: dict[int, list[int]] = {}
        for queue_id, offset, _ in member.messages():
            per_queue.setdefault(queue_id, []).append(offset)
        for queue_id, offsets in per_queue.items():
            assert offsets == sorted(set(offsets)), f"{member.name} queue {queue_id} out of order"
    # the victim's queues were taken over
    taken = {q for m in survivors for q, _, _ in m.messages()}
    assert victim_queues <= taken
    print(
        f"{len(acks)} acknowledged; the victim consumed {len(consumed_by_victim)}, "
        f"{len(uncommitted)} past its commits were consumed again by the others"
    )
