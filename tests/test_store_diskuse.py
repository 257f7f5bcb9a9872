"""Disk use follows the data: chunks are allocated in steps ahead of the writer
(StoreConfig.alloc_step), not whole at creation.

The target (issue 21): the blocks the store holds on disk (st_blocks * 512, summed over
every file) stay within the data + 16 MiB + 64 KiB per queue written to. Each case
is checked against that bound, and a control with whole-chunk preallocation
(``alloc_step=0``, the old behaviour) shows the bound is what catches it. The data is
counted from what was sent, not from the store: each record's frame, 12 bytes per queue
entry, each chunk file's header (and footer once completed), and the other files' sizes.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from code_paths import code_path  # noqa: F401 - the fixture
from crash_checks import (
    Expectation,
    KillPlan,
    describe_problems,
    run_writer,
    verify_recovered_store,
)
from crash_writer import CONFIG_ENV, store_config
from store_helpers import Sent, assert_all_readable, send, send_batch, settle_chunk_maker

from equeue import MessageStore, OutgoingMessage, StoreConfig
from equeue.chunks.chunk import Chunk
from equeue.cli import main
from equeue.format.chunk import FOOTER_SIZE, HEADER_SIZE, parse_chunk_file_name
from equeue.format.message import QUEUE_RECORD_SIZE
from equeue.inspect.render import human_size
from equeue.inspect.summary import summarize_store

MiB = 1 << 20
SLACK = 16 * MiB
PER_QUEUE = 64 << 10


def on_disk(path: Path) -> int:
    """Bytes of disk blocks held by the files under ``path``, once the chunk maker settled
    (its next log file counts, as it holds blocks; it must not vanish under the walk)."""
    settle_chunk_maker()
    return sum(
        os.lstat(os.path.join(root, name)).st_blocks * 512
        for root, _, names in os.walk(path)
        for name in names
    )


def data_held(path: Path, sent: list[Sent]) -> int:
    """What the store holds, counted from what was sent (see the module docstring)."""
    total = sum(s.frame_size + QUEUE_RECORD_SIZE for s in sent)
    for root, _, names in os.walk(path):
        for name in names:
            file = Path(root, name)
            if parse_chunk_file_name(name) is None:
                total += file.stat().st_size
                continue
            total += HEADER_SIZE
            with open(file, "rb") as f:
                f.seek(-FOOTER_SIZE, os.SEEK_END)
                if any(f.read()):  # a completed chunk's footer
                    total += FOOTER_SIZE
    return total


def queues_in_use(sent: list[Sent]) -> int:
    return len({(s.topic, s.queue_id) for s in sent})


def one_message(store: MessageStore) -> list[Sent]:
    return [send(store, "t", b"hello")]


def hundred_over_a_hundred_queues(store: MessageStore) -> list[Sent]:
    """100 messages over 25 topics x 4 queues, one per queue."""
    for t in range(25):
        store.create_topic(f"topic-{t}", 4)
    return [
        send(store, f"topic-{i % 25}", b"m%03d " % i + b"x" * 95, queue_id=i // 25)
        for i in range(100)
    ]


def thirty_mib_in_batches(store: MessageStore) -> list[Sent]:
    """Past many steps and three chunk rollovers (chunks of 8 MiB)."""
    sent: list[Sent] = []
    for n in range(30):
        batch = [OutgoingMessage(b"%04d-%04d " % (n, i) + b"b" * 1014) for i in range(1000)]
        sent += send_batch(store, "t", batch)
    return sent


EXAMPLES = {
    "1 message": (one_message, StoreConfig()),
    "100 messages, 25 topics x 4 queues": (hundred_over_a_hundred_queues, StoreConfig()),
    "30 MiB": (thirty_mib_in_batches, StoreConfig(chunk_data_size=8 * MiB)),
}


@pytest.mark.usefixtures("code_path")
@pytest.mark.parametrize("example", EXAMPLES)
def test_disk_use_follows_the_data(tmp_path: Path, example: str) -> None:
    workload, config = EXAMPLES[example]
    path = tmp_path / "store"
    with MessageStore.open(path, config) as store:
        sent = workload(store)
        live = on_disk(path)  # open, with the steps ahead of the writer allocated
    data = data_held(path, sent)
    bound = data + SLACK + PER_QUEUE * queues_in_use(sent)
    assert live <= bound, f"{live:,} bytes on disk for {data:,} of data (bound {bound:,})"
    assert on_disk(path) <= bound
    # inspect reports both: the data held (as counted here) and the blocks allocated
    summary = summarize_store(path)
    assert (summary.data_bytes, summary.allocated_bytes) == (data, on_disk(path))
    with MessageStore.open(path, config) as store:
        assert store.recovery.clean, store.recovery
        assert_all_readable(store, sent)


@pytest.mark.parametrize("example", ["1 message", "100 messages, 25 topics x 4 queues"])
def test_whole_chunk_preallocation_exceeds_the_bound(tmp_path: Path, example: str) -> None:
    """The control: chunks preallocated whole (alloc_step=0, what every store did
    before) take 268 MB for one message and 1.4 GB for the hundred, far past the bound
    the test above holds the store to."""
    workload = EXAMPLES[example][0]
    path = tmp_path / "store"
    with MessageStore.open(path, StoreConfig(alloc_step=0)) as store:
        sent = workload(store)
    bound = data_held(path, sent) + SLACK + PER_QUEUE * queues_in_use(sent)
    assert on_disk(path) > 10 * bound, (on_disk(path), bound)


@pytest.mark.parametrize("alloc_step", [512 << 10, 0])
def test_completed_chunks_keep_only_their_data(tmp_path: Path, alloc_step: int) -> None:
    """A chunk completed because a 300 KB record did not fit had blocks allocated ahead
    of its data: on completion they are given back (a hole, read as zeros), so every
    completed chunk holds its header, data and footer pages and no more, and reads the
    same. The control (whole chunks) keeps them all, which the check would catch."""
    path = tmp_path / "store"
    config = StoreConfig(chunk_data_size=MiB, alloc_step=alloc_step)
    with MessageStore.open(path, config) as store:
        sent = [send(store, "t", bytes([65 + i % 26]) * 300_000) for i in range(13)]
        completed = [c for c in store._messages if c.is_completed]
        assert len(completed) == 4
        for chunk in completed:
            # the pages of header and data, the footer's, and one block of extent tree the
            # file system may count in st_blocks
            used = -(-(HEADER_SIZE + chunk.data_end) // 4096) * 4096 + 2 * 4096
            held = os.stat(chunk.path).st_blocks * 512
            assert (held <= used) == (alloc_step != 0), (chunk, held, used)
    with MessageStore.open(path, config) as store:
        assert store.recovery.clean, store.recovery
        assert_all_readable(store, sent)


@pytest.mark.usefixtures("code_path")
def test_every_write_stays_within_the_allocated_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sends and batches of mixed sizes (some of 720 KB, more than the window allocated
    ahead of the writer) across many steps: no write path (Python, the C Sender, the C
    batch run) publishes data past the chunk's allocated end (``data_end`` is watched as
    each path sets it, right after writing the bytes), and the blocks under the data are
    allocated."""
    past: list[tuple[str, int, int]] = []

    def get(chunk: Chunk) -> int:
        return int(chunk.__dict__["_watched_end"])

    def set_(chunk: Chunk, value: int) -> None:
        limit = chunk.__dict__.get("writable_end")
        if chunk.__dict__.get("_writable") and limit is not None and value > limit:
            past.append((chunk.path.name, value, limit))
        chunk.__dict__["_watched_end"] = value

    monkeypatch.setattr(Chunk, "data_end", property(get, set_), raising=False)
    path = tmp_path / "store"
    config = StoreConfig(chunk_data_size=4 * MiB, queue_chunk_records=5_000, alloc_step=4096)
    sent: list[Sent] = []
    with MessageStore.open(path, config) as store:
        store.create_topic("t", 3)
        for i in range(400):
            if i % 5 == 4:
                # every fifth batch 800 KB, past the room allocated ahead too
                repeat = 12_000 if i % 25 == 24 else 40
                batch = [OutgoingMessage(b"b%d-%d " % (i, j) * (1 + j * repeat)) for j in range(12)]
                sent += send_batch(store, "t", batch)
            else:
                # one in 13 longer than the room the prefault keeps allocated ahead (its
                # window, 512 KiB)
                body = b"s%d " % i * (1 + i % 90) if i % 13 else b"L%03d " % i * 120_000
                sent.append(send(store, "t", body, key=f"k{i % 7}"))
            writing = [store._messages.last_chunk]
            writing += [q.manager.last_chunk for q in store._queues["t"]]
            for chunk in writing:
                if chunk is None or chunk.is_completed:
                    continue
                blocks = os.stat(chunk.path).st_blocks * 512
                assert blocks >= HEADER_SIZE + chunk.data_end, (chunk, blocks)
        assert past == [], f"data published past the allocated end: {past[:5]}"
        assert_all_readable(store, sent)
    with MessageStore.open(path, config) as store:
        assert store.recovery.clean, store.recovery
        assert_all_readable(store, sent)


# Layouts for the kill test (tests/crash_writer.py's workload): every 4 KiB chunk crosses
# one step and allocates its footer's block on completion; 1 MiB chunks allocated a page
# at a time; steps as large as the prefault window, taken ahead of the writer. With the
# policy and the acknowledgements to wait for before each of the two kills.
KILL_LAYOUTS: dict[str, tuple[dict[str, int], str, tuple[int, int]]] = {
    "step-per-chunk": ({"alloc_step": 1}, "async", (2_000, 1_000)),
    "page-steps": (
        {"chunk_data_size": MiB, "queue_chunk_records": 20_000, "alloc_step": 4096},
        "os",
        (4_000, 2_000),
    ),
    "window-steps": (
        {"chunk_data_size": 4 * MiB, "alloc_step": 512 << 10},
        "async",
        (12_000, 5_000),
    ),
}


@pytest.mark.parametrize("layout", KILL_LAYOUTS)
def test_sigkill_across_allocation_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    """The crash test's writer, SIGKILLed twice, on layouts where sends cross allocation
    steps all the time: every acknowledged send survives, byte-identical, and recovery
    takes the allocated, never-written zeros for what they are (crash_checks verifies
    the files too: nothing but zeros after the last record)."""
    settings, policy, rounds = KILL_LAYOUTS[layout]
    monkeypatch.setenv(CONFIG_ENV, json.dumps(settings))
    store = tmp_path / "store"
    exp = Expectation()
    for seed, acks in enumerate(rounds):
        run = run_writer(store, policy, seed, KillPlan("acks", acks=acks))
        assert run.returncode == -signal.SIGKILL and run.ready, run.stderr[-2000:]
        for ack in run.acks:
            exp.acknowledge(ack, durable=True)
        for producer, following in run.intents.items():
            exp.attempted[producer] = max(exp.attempted.get(producer, 0), following)
    step = max(settings["alloc_step"], 4096)
    end = max(ack.position for ack in exp.acks.values())
    assert end // step >= 5, f"the sends crossed only {end // step} steps"
    verdict = verify_recovered_store(store, store_config(policy), exp)
    assert not verdict.problems, describe_problems(verdict.problems)


def test_verify_counts_what_it_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``equeue verify`` reports the bytes it checked (each chunk's header, records and
    footer), not the chunk files' sizes: 36 messages over 3 topics are a few KiB, where
    it used to say 336.1 MiB."""
    path = tmp_path / "store"
    with MessageStore.open(path) as store:
        sent = [send(store, f"t{i % 3}", b"message %d" % i) for i in range(36)]
    chunk_files = [p for p in path.rglob("chunk-*") if parse_chunk_file_name(p.name)]
    read = HEADER_SIZE * len(chunk_files) + sum(s.frame_size + QUEUE_RECORD_SIZE for s in sent)
    assert main(["verify", "--json", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["records"], report["bytes"]) == (36, read)
    assert main(["verify", str(path)]) == 0
    assert f"({human_size(read)})" in capsys.readouterr().out
