"""The durability order of a topic's creation and deletion under power loss.

A workload creates topics (create_topic with a policy, a send's auto-creation, a topic
created again after its deletion), sends to them (acknowledged: flush="sync"), commits
consumer offsets naming them (offsets.json, consumers/GROUP.json), checkpoints, and
deletes one. The power fails at each flush of it in turn (tests/power_loss_model.py).
On the disk each cut leaves:

* nothing names a topic whose creation record is not durable (tests/topic_order_checks.py,
  read from the files alone, before any open);
* the open raises nothing, reports no topic rebuilt from its directories and no record of
  a topic it does not have;
* every acknowledged send of a topic whose deletion did not return pulls back byte for
  byte at its offset, and a topic holds the queue count and policy it was created with;
* a deleted topic is gone whole or there whole; a topic created again holds none of the
  deleted one's messages;
* on the control (the disk as the page cache held it), recovery is clean and
  ``equeue verify`` reports nothing on the closed store.
"""

from __future__ import annotations

import contextlib
import copy
import datetime as dt
import functools
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from power_loss_model import Damage, DiskImage, PowerCut, materialize, recording
from topic_order_checks import order_problems

import equeue.store.store
from equeue import MessageStore, StoreConfig
from equeue.cli import main
from equeue.format.chunk import MIN_CHUNK_DATA_SIZE
from equeue.store import topicsfile
from equeue.store.config import FlushPolicy

CONFIG = StoreConfig(
    flush="sync",
    chunk_data_size=MIN_CHUNK_DATA_SIZE,  # rollovers every few sends
    queue_chunk_records=512,
    default_queue_count=2,
    flush_interval_ms=3_600_000,  # no background flush: what is durable is the steps'
)
# Each incarnation's queue count and cleanup policy ("again": n created once more); n's
# are not what a topic rebuilt from its directories gets (the defaults, and as many
# queues as hold files).
SHAPES = {
    "a": (1, "delete"),
    "n": (3, "compact"),
    "auto": (2, "delete"),
    "again": (1, "delete"),
    "late": (2, "delete"),
}


@pytest.fixture(autouse=True)
def every_open_follows_a_reboot(monkeypatch: pytest.MonkeyPatch) -> None:
    """A power cut is a reboot: tail.live is not trusted (as in tests/test_power_loss.py)."""
    monkeypatch.setattr(equeue.store.store, "current_boot_id", uuid.uuid4)


@dataclass
class Sent:
    topic: str
    incarnation: str  # the SHAPES key of the topic as it was when the send returned
    queue_id: int
    queue_offset: int
    position: int
    body: bytes


@dataclass
class Progress:
    """What the workload's calls that returned before the cut did."""

    acked: list[Sent] = field(default_factory=list)
    created: dict[str, str] = field(default_factory=dict)  # topic: incarnation
    deleted: set[str] = field(default_factory=set)  # incarnations whose deletion returned
    # (group, topic, incarnation, queue id, offset) of the commits that returned
    committed: list[tuple[str, str, str, int, int]] = field(default_factory=list)
    in_flight: str = ""  # the topic change running at the cut: either outcome is allowed
    committing: tuple[str, str, str, int, int] | None = None  # a commit running at the cut
    durable: int = 0  # acked[:durable] must survive: flush="sync", else a flush() covered them


def _send(
    store: MessageStore, progress: Progress, topic: str, count: int, queue_id: int | None = None
) -> None:
    for _ in range(count):
        n = len(progress.acked)
        body = b"%s-%d-" % (topic.encode(), n) + b"x" * (n * 37 % 300)
        result = store.send(topic, body, key=f"k{n % 4}", queue_id=queue_id)
        incarnation = progress.created[topic]
        progress.acked.append(
            Sent(topic, incarnation, result.queue_id, result.queue_offset, result.position, body)
        )
        if store.config.flush == "sync":
            progress.durable = len(progress.acked)


def _change(progress: Progress, name: str, call: Callable[[], None]) -> None:
    progress.in_flight = name
    call()
    progress.in_flight = ""


def workload(store: MessageStore, progress: Progress) -> None:
    store.create_topic("a", 1)
    progress.created["a"] = "a"
    _send(store, progress, "a", 3)
    _change(
        progress, "n", lambda: store.create_topic("n", 3, cleanup="compact",
                                                  delete_retention=dt.timedelta(hours=2)),
    )  # fmt: skip
    progress.created["n"] = "n"
    for queue_id in (0, 1, 2, 0, 2):
        _send(store, progress, "n", 1, queue_id=queue_id)
    progress.in_flight = "auto"  # created by its first send
    progress.created["auto"] = "auto"
    _send(store, progress, "auto", 3)
    progress.in_flight = ""
    progress.committing = ("g", "n", "n", 1, 1)
    store.commit_offset("g", "n", 1, 1)  # offsets.json names n
    progress.committed.append(progress.committing)
    progress.committing = None
    with store.consumer("c", ["n", "auto"], timeout=0.0) as consumer:
        consumer.poll(4)  # its group file (consumers/c.json) names both
    for topic in ("n", "auto"):
        for queue_id in store.queue_ids(topic):
            offset = store.committed_offset("c", topic, queue_id)
            if offset is not None:
                progress.committed.append(("c", topic, topic, queue_id, offset))
    store.flush()  # a checkpoint naming them
    progress.durable = len(progress.acked)
    _send(store, progress, "n", 2)
    _change(progress, "n", lambda: store.delete_topic("n"))
    progress.deleted.add("n")
    progress.durable = len(progress.acked)  # (delete_topic flushes the log first)
    _change(progress, "again", lambda: store.create_topic("n", 1))  # the name once more
    progress.created["n"] = "again"
    _send(store, progress, "n", 3)
    progress.in_flight = "late"  # no checkpoint after it: only the log's fdatasync covers it
    progress.created["late"] = "late"
    _send(store, progress, "late", 2)
    progress.in_flight = ""


@dataclass
class Run:
    progress: Progress
    image: DiskImage
    trail: list[str]
    snapshots: list[Run] = field(default_factory=list)  # one a snapshot_at flush, in order


def run_until_power_cut(
    root: Path,
    config: StoreConfig,
    cut_at: int | None,
    cut_after: bool,
    snapshot_at: Callable[[int], bool | None] | None = None,
) -> Run:
    """The workload until the power fails at flush ``cut_at``; with ``snapshot_at``, the
    disk and the progress as a cut at each flush it names would leave them, in
    ``snapshots`` (power_loss_model.py), the workload run once for all of them."""
    progress = Progress()
    store: MessageStore | None = None
    snapshots: list[Run] = []

    def on_snapshot(image: DiskImage, trail: list[str]) -> None:
        snapshots.append(Run(copy.deepcopy(progress), image, trail))

    with recording(
        root, cut_at=cut_at, cut_after=cut_after, snapshot_at=snapshot_at, on_snapshot=on_snapshot
    ) as recorder:
        try:
            store = MessageStore.open(root, config)
            workload(store, progress)
            image = recorder.cut()
        except PowerCut:
            assert recorder.image is not None
            image = recorder.image
        finally:
            if store is not None:
                _close_quietly(store)
    return Run(progress, image, recorder.trail, snapshots)


def _close_quietly(store: MessageStore) -> None:
    """The machine is off: release the half-way store's threads and files if it lets us."""

    def close() -> None:
        with contextlib.suppress(BaseException):
            store.close()

    closer = threading.Thread(target=close, daemon=True)
    closer.start()
    closer.join(10)


def check_recovered(after: Path, config: StoreConfig, run: Run, *, control: bool) -> list[str]:
    """Open the store a cut left and check it (see the module docstring)."""
    progress = run.progress
    problems = [f"before the open: {p}" for p in order_problems(after, MIN_CHUNK_DATA_SIZE)]
    try:
        store = MessageStore.open(after, config)
    except Exception as exc:
        return [*problems, f"the open raised {exc!r}"]
    with store:
        report = store.recovery
        # Nothing durable is missing, so nothing is reported lost, rebuilt or left out,
        # but a commit of a message not durable yet (flush="os"), lowered to its queue's
        # end (equeue/store/offsetcuts.py): checked with the commits below.
        lowered = [p for p in report.problems if "past the queue's end" in p]
        problems += [f"recovery: {p}" for p in report.problems if p not in lowered]
        if control and report.cuts:
            problems.append(f"control: recovery cut {[str(c) for c in report.cuts]}")
        found = {t: len(store.queue_ids(t)) for t in store.topics()}
        incarnation = {}
        for topic, count in found.items():
            shape = (count, store.topic_policy(topic).cleanup)
            names = ["n", "again"] if topic == "n" else [topic]
            matching = [name for name in names if SHAPES.get(name) == shape]
            if not matching:
                problems.append(f"topic {topic!r} has {count} queues and cleanup={shape[1]!r}")
            incarnation[topic] = matching[0] if matching else "?"
        for topic, name in progress.created.items():
            if topic not in found and name != progress.in_flight and name not in progress.deleted:
                problems.append(f"topic {topic!r} ({name}), whose creation returned, is gone")
        if incarnation.get("n") == "n" and "n" in progress.deleted:
            problems.append("topic n is back after its delete_topic returned")
        for sent in progress.acked if control else progress.acked[: progress.durable]:
            if (
                sent.incarnation in progress.deleted
                or incarnation.get(sent.topic) != sent.incarnation
            ):
                continue  # deleted (at the cut, maybe: then gone whole, as checked above)
            pulled = store.pull(sent.topic, sent.queue_id, sent.queue_offset, max_count=1).messages
            got = (pulled[0].position, pulled[0].body) if pulled else None
            if got != (sent.position, sent.body):
                problems.append(
                    f"the acknowledged send {sent.topic}/{sent.queue_id} offset "
                    f"{sent.queue_offset} (position {sent.position}) reads back as {got}"
                )
        durable = progress.acked if control else progress.acked[: progress.durable]
        commits = [*progress.committed, *filter(None, [progress.committing])]
        for group, topic, name, queue_id, offset in commits:
            if incarnation.get(topic) != name:
                continue
            committed = store.committed_offset(group, topic, queue_id)
            said = f"consumer group {group!r} had committed offset {offset} on {topic}/{queue_id}"
            end = store.queue_range(topic, queue_id)[1]
            if committed == end < offset and any(said in p for p in lowered):
                lowered = [p for p in lowered if said not in p]
                if not any(
                    (s.incarnation, s.topic, s.queue_id) == (name, topic, queue_id)
                    and s.queue_offset >= end
                    for s in durable
                ):
                    continue  # what the cut took was not durable: lowered, as it must be
            if committed is not None and committed > end:  # the next sends would be skipped
                problems.append(f"{group}'s offset of {topic}/{queue_id} is past its end {end}")
            elif (
                committed != offset and (group, topic, name, queue_id, offset) in progress.committed
            ):
                problems.append(f"{group}'s offset of {topic}/{queue_id} is {committed}")
        problems += [f"recovery: {p}" for p in lowered]  # lowered, and no commit of ours
        if incarnation.get("n") == "again":
            bodies = [m.body for m in store.pull("n", 0, 0, max_count=100).messages]
            first = {s.body for s in progress.acked if s.incarnation == "n"}
            old = [body for body in bodies if body in first]
            if old:
                problems.append(f"topic n, created again, holds the deleted one's {old[:2]}")
    if control and not problems:
        code = main(["verify", str(after)])
        if code != 0:
            problems.append(f"control: equeue verify exited {code}")
    return problems


def _cut(
    config: StoreConfig, cut_at: int | None, cut_after: bool, damage: Damage
) -> tuple[list[str], Run]:
    with tempfile.TemporaryDirectory(prefix="equeue-order-") as tmp:
        run = run_until_power_cut(Path(tmp) / "store", config, cut_at, cut_after)
        materialize(run.image, Path(tmp) / "after", damage)
        return check_recovered(Path(tmp) / "after", config, run, control=damage.control), run


def _side(after: bool, _flush: int) -> bool:
    return after


def _cut_at_every_flush(
    config: StoreConfig, sides: tuple[bool, ...], damage: Damage
) -> tuple[int, list[str]]:
    """The power cut at each flush in turn, on each of ``sides`` (False: before it took
    effect, True: after): how many flushes, and the failed cuts explained. The workload
    runs once per side, the disk captured at every flush (snapshot_at; the steps are the
    test thread's, no background flush), where it ran once a cut before round 21."""
    failures = []
    total = 0
    for after in sides:
        with tempfile.TemporaryDirectory(prefix="equeue-order-") as tmp:
            full = run_until_power_cut(
                Path(tmp) / "store",
                config,
                None,
                False,
                snapshot_at=functools.partial(_side, after),
            )
            total = len(full.trail)
            assert len(full.snapshots) == total
            for cut_at, run in enumerate(full.snapshots, 1):
                out = Path(tmp) / f"after-{cut_at}"
                materialize(run.image, out, damage)
                problems = check_recovered(out, config, run, control=damage.control)
                shutil.rmtree(out)
                if problems:
                    failures.append(_explain(problems, run, cut_after=after))
    return total, failures


def _explain(problems: list[str], run: Run, **case: object) -> str:
    return (
        f"power cut at {run.image.where} ({', '.join(f'{k}={v}' for k, v in case.items())}); "
        f"last flushes: {'; '.join(run.trail[-5:])}\n  - " + "\n  - ".join(problems[:8])
    )


@pytest.mark.parametrize("policy", ["sync", "os"])
def test_control_the_whole_workload_reads_back_and_verifies(policy: FlushPolicy) -> None:
    config = replace(CONFIG, flush=policy)
    problems, run = _cut(config, None, False, Damage(pages="none", entries="keep"))
    assert not problems, _explain(problems, run)
    assert len(run.progress.acked) == 18 and run.progress.deleted == {"n"}


@pytest.mark.parametrize(
    ("policy", "damage"),
    [
        ("sync", Damage(pages="old", entries="revert")),
        ("sync", Damage(pages="mixed", entries="mixed", seed=7)),
        # Sends durable only at flush() and delete_topic: topic records still come first.
        ("os", Damage(pages="mixed", entries="mixed", seed=8)),
    ],
    ids=str,
)
def test_power_cut_at_every_flush_of_topic_changes(policy: FlushPolicy, damage: Damage) -> None:
    """The power fails at each flush in turn (before it took effect, then after)."""
    config = replace(CONFIG, flush=policy)
    total, failures = _cut_at_every_flush(config, (False, True), damage)
    assert total > 40  # topic records, chunks, checkpoints, a deletion: many flushes
    assert not failures, f"{len(failures)} of {2 * total} cuts failed:\n" + "\n".join(failures[:4])


def test_control_at_every_flush() -> None:
    """The control: the disk as the page cache held it at each cut."""
    total, failures = _cut_at_every_flush(CONFIG, (False,), Damage(pages="none", entries="keep"))
    assert total > 40
    assert not failures, f"{len(failures)} cuts failed:\n" + "\n".join(failures[:4])


def test_a_consumer_commit_racing_a_creation_is_harmless(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one exception to the rule: a consumer that sees a topic before its record is
    durable (another thread, between create_topic's table update and its fdatasync; or a
    read-only handle reading the journal from the page cache) commits offset 0 of each of
    its queues to consumers/GROUP.json, fsynced, though it processed nothing. The power
    fails before the record's fdatasync: the group file names a topic no durable record
    has. The open reports nothing, verify is clean, and the topic made again later is
    read from its first message."""
    root = tmp_path / "store"
    with recording(root) as recorder:
        store = MessageStore.open(root, CONFIG)
        record = topicsfile.TopicsFile.record

        def consume_then_cut(self: topicsfile.TopicsFile, topic: str, *args: Any) -> None:
            if topic == "n":
                with store.consumer("c", "n", timeout=0.0) as consumer:
                    assert consumer.poll(4) == []
                recorder.cut("before topics.journal's fdatasync")
                raise PowerCut(topic)
            record(self, topic, *args)

        monkeypatch.setattr(topicsfile.TopicsFile, "record", consume_then_cut)
        with pytest.raises(PowerCut):
            store.create_topic("n", 2)
        monkeypatch.setattr(topicsfile.TopicsFile, "record", record)
        assert recorder.image is not None
        _close_quietly(store)
    after = tmp_path / "after"
    materialize(recorder.image, after, Damage(pages="old", entries="revert"))
    assert order_problems(after, MIN_CHUNK_DATA_SIZE) == [
        "consumers/c.json names topic 'n', which no durable topic record has"
    ]
    with MessageStore.open(after, CONFIG) as reopened:
        assert reopened.recovery.clean and "n" not in reopened.topics()
        reopened.create_topic("n", 2)
        reopened.send("n", b"first", queue_id=1)
        with reopened.consumer("c", "n", timeout=0.0) as consumer:
            assert [m.body for m in consumer.poll(4)] == [b"first"]
    assert main(["verify", str(after)]) == 0
