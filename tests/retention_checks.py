"""The kill test with retention: writer runs (tests/crash_writer.py --retention) SIGKILLed
one after another on one store, checked after each kill. Not a test module.

The store keeps a few small log chunks (``max_store_bytes``) and retention runs every
few milliseconds beside the senders, so kills land inside retention as well as
inside sends. After each kill the store is opened (recovery), checked and closed;
the next run resumes on it. The checks, against what the writer printed only:

* no queue's next offset went back: it is past every offset acknowledged on that
  queue, and not below what an earlier check saw;
* every acknowledged message the log still holds (position >= the log's first
  position) pulls at its acknowledged offset, with its acknowledged position and id,
  byte-identical to what was sent; ``read(position)`` agrees;
* every offset from the queue's first to its next pulls a workload message naming that
  queue and offset, with positions increasing, no (producer, seq) twice;
* after the check, a send by every producer gets its queue's next offset.
Used by tests/test_crash.py (a reduced run) and tools/crash_test.py --retention.
"""

from __future__ import annotations

import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from crash_checks import KillPlan, WriterRun, ensure_topics, run_writer
from crash_writer import (
    PRODUCERS,
    Ack,
    code_of,
    key_of,
    make_body,
    parse_body,
    properties_of,
    retention_config,
    send,
    tag_of,
)

from equeue import Message, MessageStore
from equeue.errors import EQueueError

QueueKey = tuple[str, int]


@dataclass
class RetentionHistory:
    """What the runs on one store acknowledged and what the checks saw."""

    acks: dict[tuple[int, int], Ack] = field(default_factory=dict)
    attempted: dict[int, int] = field(default_factory=dict)  # producer -> seqs below it sent
    max_acked: dict[QueueKey, int] = field(default_factory=dict)  # the highest offset acked
    seen_next: dict[QueueKey, int] = field(default_factory=dict)  # next offsets at checks
    stats: Counter[str] = field(default_factory=Counter)

    def add_ack(self, ack: Ack) -> None:
        self.acks[(ack.producer, ack.seq)] = ack
        key = (ack.topic, ack.queue_id)
        self.max_acked[key] = max(self.max_acked.get(key, -1), ack.queue_offset)
        self.attempted[ack.producer] = max(self.attempted.get(ack.producer, 0), ack.seq + 1)

    def add(self, run: WriterRun) -> None:
        for ack in run.acks:
            self.add_ack(ack)
        for producer, end in run.intents.items():
            self.attempted[producer] = max(self.attempted.get(producer, 0), end)

    def writer_options(self) -> list[str]:
        return ["--retention", "--start", *(f"{p}:{s}" for p, s in self.attempted.items())]


def _pull_range(store: MessageStore, key: QueueKey, problems: list[str]) -> dict[int, Message]:
    """Every message from the queue's first offset to its next, by offset."""
    topic, queue_id = key
    first, end = store.queue_range(topic, queue_id)
    found: dict[int, Message] = {}
    offset = first
    while offset < end:
        try:
            pulled = store.pull(topic, queue_id, offset, max_count=256)
        except EQueueError as exc:
            problems.append(f"{topic}/{queue_id} offset {offset}: pull raised {exc!r}")
            offset += 1
            continue
        if not pulled.messages or pulled.next_offset <= offset:
            problems.append(f"{topic}/{queue_id}: pull at offset {offset} < next {end} is empty")
            break
        for m in pulled.messages:
            found[m.queue_offset] = m
        offset = pulled.next_offset
    missing = [o for o in range(first, end) if o not in found]
    if missing:
        problems.append(
            f"{topic}/{queue_id}: offsets {missing[0]}..{missing[-1]} of [{first}, {end}) "
            f"({len(missing)}) did not pull"
        )
    return found


def check_after_kill(path: Path, policy: str, history: RetentionHistory) -> list[str]:
    """Open the killed store, check it (see the module docstring) and close it."""
    problems: list[str] = []
    try:
        store = MessageStore.open(path, retention_config(policy))
    except Exception as exc:
        return [f"opening the killed store failed: {exc!r}"]
    try:
        history.stats["cuts"] += len(store.recovery.cuts)
        history.stats["recovery problems"] += len(store.recovery.problems)
        problems += [f"recovery problem: {p}" for p in store.recovery.problems]
        ensure_topics(store)
        held: dict[tuple[int, int], Message] = {}
        for key in dict.fromkeys(PRODUCERS):  # a queue two producers share, once
            end = store.queue_range(*key)[1]
            floor = max(history.max_acked.get(key, -1) + 1, history.seen_next.get(key, 0))
            if end < floor:
                history.stats["offsets back"] += 1
                problems.append(
                    f"{key[0]}/{key[1]}: next offset {end} after the kill, but offset "
                    f"{history.max_acked.get(key)} was acknowledged and {floor} seen before"
                )
            history.seen_next[key] = max(history.seen_next.get(key, 0), end)
            previous = -1
            for offset, m in sorted(_pull_range(store, key, problems).items()):
                where = f"{key[0]}/{key[1]} offset {offset} (position {m.position})"
                parsed = parse_body(m.body)
                if parsed is None or (m.topic, m.queue_id, m.queue_offset) != (*key, offset):
                    problems.append(f"{where}: not a message sent there: {m}")
                    continue
                if m.position <= previous:
                    problems.append(f"{where}: position not above the previous offset's")
                previous = m.position
                if parsed in held:
                    problems.append(f"{where}: {parsed} also at {held[parsed].queue_offset}")
                held[parsed] = m
                if (m.tag, m.key, m.properties, m.code) != (
                    tag_of(*parsed),
                    key_of(*parsed),
                    properties_of(*parsed),
                    code_of(*parsed),
                ):
                    problems.append(f"{where}: tag/key/properties/code differ from what was sent")
        # Read after the pulls (the service may apply retention meanwhile); no public
        # accessor has it.
        log_first = store._messages.first_position
        retained = 0
        for (p, seq), ack in sorted(history.acks.items()):
            if ack.position < log_first:
                continue
            retained += 1
            found = held.get((p, seq))
            if found is None:
                history.stats["losses"] += 1
                problems.append(f"acknowledged and retained, but missing: {ack}")
            elif (found.position, found.message_id, found.queue_offset, found.body) != (
                ack.position,
                ack.message_id,
                ack.queue_offset,
                make_body(p, seq),
            ):
                history.stats["losses"] += 1
                problems.append(f"acknowledged {ack}, found {found}")
            elif store.read(ack.position) != found:
                problems.append(f"read({ack.position}) differs from the pull of {ack}")
        history.stats["retained acknowledged checked"] += retained
        if not problems:  # a send per producer gets its queue's next offset
            for p, key in enumerate(PRODUCERS):
                end = store.queue_range(*key)[1]
                seq = history.attempted.get(p, 0)
                history.attempted[p] = seq + 1
                (result,) = send(store, p, seq, 1)
                if result.queue_offset != end:
                    problems.append(f"{key}: a send got offset {result.queue_offset}, not {end}")
                history.add_ack(Ack.of(p, seq, result))
    except Exception as exc:
        problems.append(f"checking the killed store raised {exc!r}")
    finally:
        try:
            store.close()
        except Exception as exc:
            problems.append(f"closing the checked store raised {exc!r}")
    return problems


def plan_retention_kill(rng: random.Random) -> KillPlan:
    """Short runs (many kills a minute): mostly after some acks or a short delay."""
    r = rng.random()
    if r < 0.1:
        return KillPlan("startup", rng.uniform(0.0, 0.4))
    if r < 0.6:
        return KillPlan("acks", acks=rng.randint(1, 1500))
    return KillPlan("delay", rng.uniform(0.0, 0.4))


@dataclass
class RetentionResult:
    policy: str
    seed: int
    kills: int = 0
    history: RetentionHistory = field(default_factory=RetentionHistory)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def describe(self) -> str:
        return (
            f"retention kill test, policy={self.policy} seed={self.seed}: {self.kills} kills, "
            f"{len(self.history.acks)} acks, {len(self.problems)} problems\n  reproduce: "
            f"python tools/crash_test.py --retention --policy {self.policy} --seed {self.seed} "
            "--iterations 1 --keep\n" + "\n".join(f"  - {p}" for p in self.problems[:25])
        )


def run_retention_iteration(workdir: Path, policy: str, seed: int, kills: int) -> RetentionResult:
    """``kills`` writer runs on one store, each SIGKILLed and checked."""
    started = time.monotonic()
    rng = random.Random(f"retention/{policy}/{seed}")
    result = RetentionResult(policy, seed)
    history = result.history
    store_dir = workdir / "store"
    workdir.mkdir(parents=True, exist_ok=True)
    for i in range(kills):
        plan = plan_retention_kill(rng)
        run = run_writer(store_dir, policy, rng.randrange(1 << 30), plan, history.writer_options())
        history.add(run)
        result.kills += 1
        if run.returncode != -signal.SIGKILL:
            result.problems.append(f"run {i + 1}: the writer exited with {run.returncode}")
            result.problems.append(run.stderr[-3000:])
        elif not run.ready and plan.mode != "startup":
            result.problems.append(f"run {i + 1}: the writer never got READY")
        if not result.problems and store_dir.exists():
            result.problems += [
                f"after kill {i + 1} ({plan}): {p}"
                for p in check_after_kill(store_dir, policy, history)
            ]
        if result.problems:
            break
    history.stats["kills"] += result.kills
    history.stats["acknowledged"] += len(history.acks)
    result.seconds = time.monotonic() - started
    return result
