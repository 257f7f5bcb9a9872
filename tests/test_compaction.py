"""Compaction: topic policies, the streaming reader, the rewrite, the plan, the Spark job
against a plain-Python reference of the policy, the data source and the command."""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from code_paths import code_path  # noqa: F401 - the fixture
from compaction_model import all_messages, expected_removed, made_up_snapshot
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from store_helpers import snapshot

from equeue import MessageStore, StoreConfig
from equeue.chunks import ChunkManager, ChunkManagerConfig
from equeue.chunks.stream import ChunkFile
from equeue.cli import main
from equeue.compaction.job import compact
from equeue.compaction.plan import Removals, plan_groups, take_snapshot
from equeue.compaction.rewrite import Part, finish_merged, rewrite_group, write_part
from equeue.errors import (
    CompactedAwayError,
    CompactionError,
    ConfigError,
    CorruptionError,
    MessageNotFoundError,
)
from equeue.format.chunk import (
    FOOTER_SIZE,
    FRAME_OVERHEAD,
    HEADER_SIZE,
    MAP_ENTRY_SIZE,
    TIMESTAMP,
    ChunkFooter,
)
from equeue.format.message import STORED_TIME_OFFSET
from equeue.inspect.verify import verify_store
from equeue.store.topics import TopicPolicy

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

SMALL = StoreConfig(chunk_data_size=8 * 1024, flush="os")
DAY = dt.timedelta(days=1)


def fill(path: Path, messages: int = 600, keys: int = 20, seed: int = 1) -> None:
    """A compacted topic "k" (keys, some tombstones) and a plain topic "d"."""
    rng = random.Random(seed)
    with MessageStore.open(path, SMALL) as store:
        store.create_topic("k", 2, cleanup="compact")
        store.create_topic("d", 1)
        for i in range(messages):
            if rng.random() < 0.8:
                body = b"" if rng.random() < 0.1 else os.urandom(rng.randrange(1, 80))
                store.send("k", body, key=f"key-{rng.randrange(keys)}", tag="t")
            else:
                store.send("d", f"plain {i}".encode())


# --- topic policies ---------------------------------------------------------------


def test_topic_policy_is_persisted_and_changeable(tmp_path: Path) -> None:
    with MessageStore.open(tmp_path, SMALL) as store:
        store.create_topic("a", 2, cleanup="compact", delete_retention=dt.timedelta(hours=1))
        store.send("auto", b"x")
        assert store.topic_policy("auto") == TopicPolicy()
        store.create_topic("a", retention=DAY)  # only what is given changes
        assert store.topic_policy("a") == TopicPolicy("compact", DAY, dt.timedelta(hours=1))
        assert store.queue_ids("a") == [0, 1]
    with MessageStore.open(tmp_path) as store:
        assert store.topic_policy("a") == TopicPolicy("compact", DAY, dt.timedelta(hours=1))
        store.create_topic("a", retention=None, cleanup="delete")
        assert store.topic_policy("a") == TopicPolicy("delete", None, dt.timedelta(hours=1))
    with MessageStore.open(tmp_path, read_only=True) as store:
        assert store.topic_policy("a").cleanup == "delete"


@pytest.mark.parametrize(
    "settings_",
    [
        {"cleanup": "shrink"},
        {"retention": dt.timedelta(0)},
        {"retention": 3600},
        {"delete_retention": dt.timedelta(seconds=-1)},
    ],
)
def test_bad_topic_policy_is_refused_and_changes_nothing(
    tmp_path: Path, settings_: dict[str, Any]
) -> None:
    with MessageStore.open(tmp_path, SMALL) as store:
        store.create_topic("a", 1)
        before = (tmp_path / "topics.journal").read_bytes()  # (topics.json: at a fold)
        with pytest.raises(ConfigError):
            store.create_topic("a", 3, **settings_)
        with pytest.raises(ConfigError):
            store.create_topic("b", 1, **settings_)
        assert store.topics() == ["a"]
        assert store.queue_ids("a") == [0]
        assert store.topic_policy("a") == TopicPolicy()
        assert (tmp_path / "topics.journal").read_bytes() == before
        assert not (tmp_path / "topics.json").exists()


# --- streaming reads and the rewrite ------------------------------------------------


def message_chunk_files(path: Path) -> list[Path]:
    return sorted((path / "messages").glob("chunk-*"))


@pytest.mark.usefixtures("code_path")
def test_chunk_file_streams_what_the_manager_reads(tmp_path: Path) -> None:
    fill(tmp_path)
    config = ChunkManagerConfig(chunk_data_size=SMALL.layout.chunk_data_size, timestamp_offset=8)
    with ChunkManager(tmp_path / "messages", config, read_only=True) as manager:
        for chunk in manager:
            streamed = list(ChunkFile.open(chunk.path, chunk.data_end).records(block_size=300))
            assert streamed == list(
                (p - chunk.base, bytes(b)) for p, b in chunk.iter_records(0, chunk.base)
            )
            assert len(streamed) == chunk.record_count > 0


@pytest.mark.usefixtures("code_path")
def test_chunk_file_reports_damage_with_file_and_offset(tmp_path: Path) -> None:
    fill(tmp_path)
    path = message_chunk_files(tmp_path)[0]
    clean = ChunkFile.open(path)
    assert len(list(clean.records())) == clean.footer.record_count  # type: ignore[union-attr]
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + 100)
        byte = f.read(1)
        f.seek(HEADER_SIZE + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CorruptionError) as caught:
        list(ChunkFile.open(path).records())
    assert caught.value.file == str(path)
    assert caught.value.offset is not None and caught.value.offset <= HEADER_SIZE + 100


def test_ongoing_chunk_needs_a_committed_end(tmp_path: Path) -> None:
    fill(tmp_path)
    last = message_chunk_files(tmp_path)[-1]
    with pytest.raises(CorruptionError, match="committed end"):
        ChunkFile.open(last)


def test_rewrite_keeps_positions_and_reports_removed_ones(tmp_path: Path) -> None:
    fill(tmp_path)
    files = message_chunk_files(tmp_path)[:3]
    chunks = [ChunkFile.open(p) for p in files]
    records = [
        (c.header.start_position + local, payload) for c in chunks for local, payload in c.records()
    ]
    removed = sorted(p for i, (p, _) in enumerate(records) if i % 3 == 0)
    staging = tmp_path / "staging"
    staging.mkdir()
    result = rewrite_group(chunks, removed, staging, version=1)
    assert (result.start_number, result.end_number, result.version) == (0, 2, 1)
    assert result.records_removed == len(removed)
    assert result.records_kept == len(records) - len(removed)
    assert result.bytes_after == (staging / result.file_name).stat().st_size < result.bytes_before
    for f in files:
        f.unlink()
    shutil.move(staging / result.file_name, tmp_path / "messages" / result.file_name)
    config = ChunkManagerConfig(chunk_data_size=SMALL.layout.chunk_data_size, timestamp_offset=8)
    with ChunkManager(tmp_path / "messages", config, read_only=True) as manager:
        merged = manager.get_chunk(1)
        assert merged.header.compacted and manager.get_chunk(0) is merged
        for position, payload in records:
            chunk = manager.get_chunk_for(position)
            if position in removed:
                with pytest.raises(CompactedAwayError):
                    chunk.read_at(position - chunk.base)
            else:
                assert chunk.read_at(position - chunk.base) == payload
        kept = [(p, b) for p, b in records if p not in set(removed)]
        assert [(merged.base + local, b) for local, b in ChunkFile.open(merged.path).records()] == [
            (p, b) for p, b in kept
        ]
        footer = merged.footer
        assert footer is not None
        (first_ts,) = TIMESTAMP.unpack_from(kept[0][1], STORED_TIME_OFFSET)
        assert footer.first_timestamp == first_ts
    assert verify_store(tmp_path) == []


def _parts(chunks: list[ChunkFile], removed: set[int], file: Path) -> list[Part]:
    """The regions of a merged replacement of ``chunks``, as the job's plan gives them."""
    kept = [
        [
            len(b) + FRAME_OVERHEAD
            for p, b in c.records()
            if c.header.start_position + p not in removed
        ]
        for c in chunks
    ]
    parts = []
    data_at, map_at = 0, HEADER_SIZE + sum(map(sum, kept))
    for chunk, sizes in zip(chunks, kept, strict=True):
        parts.append(
            Part(
                str(chunk.path),
                chunk.data_end,
                str(file),
                chunk.header.start_position - chunks[0].header.start_position,
                data_at,
                map_at,
                sum(sizes),
                len(sizes),
            )
        )
        data_at += sum(sizes)
        map_at += len(sizes) * MAP_ENTRY_SIZE
    return parts


@pytest.mark.usefixtures("code_path")
def test_merged_replacement_written_per_chunk_is_the_one_written_whole(tmp_path: Path) -> None:
    """Pass 2 writes a merged file one chunk per task, in planned regions, then finishes
    it: the same data, map and footer as one stream through the chunks; a task run twice
    (a retry) writes the same bytes."""
    fill(tmp_path)
    chunks = [ChunkFile.open(p) for p in message_chunk_files(tmp_path)[:3]]
    positions = [c.header.start_position + p for c in chunks for p, _ in c.records()]
    removed = {p for i, p in enumerate(positions) if i % 3 != 1}
    whole_dir, parts_dir = tmp_path / "whole", tmp_path / "parts"
    whole_dir.mkdir()
    parts_dir.mkdir()
    whole = rewrite_group(chunks, sorted(removed), whole_dir, version=1)
    file = parts_dir / whole.file_name
    with open(file, "xb") as f:
        f.truncate(whole.bytes_after)
    parts = _parts(chunks, removed, file)
    results = [write_part(part, sorted(removed)) for part in parts]
    assert write_part(parts[1], sorted(removed)) == results[1]
    written = ChunkFile.open(whole_dir / whole.file_name)
    size = finish_merged(file, written.header, results, written.logical_end)
    assert size == whole.bytes_after
    assert file.read_bytes() == (whole_dir / whole.file_name).read_bytes()
    assert sum(r.removed_count for r in results) == whole.records_removed


def test_part_refuses_survivors_that_are_not_the_plans(tmp_path: Path) -> None:
    fill(tmp_path)
    chunk = ChunkFile.open(message_chunk_files(tmp_path)[0])
    positions = [chunk.header.start_position + p for p, _ in chunk.records()]
    file = tmp_path / "replacement"
    (part,) = _parts([chunk], set(positions[::2]), file)
    file.write_bytes(bytes(part.map_at + MAP_ENTRY_SIZE * part.kept_count + FOOTER_SIZE))
    before = file.read_bytes()
    with pytest.raises(CompactionError, match="changed under the job"):
        write_part(part, positions[::3])  # fewer removed than planned: outgrows its region
    with pytest.raises(CompactionError, match="changed under the job"):
        write_part(part, positions)  # more removed: fewer survivors than planned
    after = file.read_bytes()
    assert after[part.map_at :] == before[part.map_at :]  # no map entry written
    assert ChunkFooter.is_blank(after[-FOOTER_SIZE:])


def test_rewrite_refuses_descending_positions(tmp_path: Path) -> None:
    fill(tmp_path)
    chunk = ChunkFile.open(message_chunk_files(tmp_path)[0])
    positions = [p for p, _ in chunk.records()]
    staging = tmp_path / "staging"
    staging.mkdir()
    with pytest.raises(CompactionError, match="ascend"):
        rewrite_group([chunk], [positions[3], positions[1]], staging, version=1)
    assert list(staging.iterdir()) == []  # nothing half-written is left


# --- the plan ----------------------------------------------------------------------


def test_plan_merges_consecutive_chunks_and_skips_what_would_not_shrink(tmp_path: Path) -> None:
    fill(tmp_path, messages=900)
    with MessageStore.open(tmp_path) as store:
        store.flush()
    snapshot = take_snapshot(tmp_path)
    eligible = snapshot.eligible
    assert len(eligible) >= 5
    # chunk 0: nearly everything goes; chunk 1: too; chunk 2: one tiny record only (the
    # map of its survivors outweighs it); chunk 3 and 4: half each.
    removals = {
        eligible[0].start_number: Removals(eligible[0].record_count - 1, eligible[0].data_end - 80),
        eligible[1].start_number: Removals(eligible[1].record_count - 1, eligible[1].data_end - 80),
        eligible[2].start_number: Removals(1, 70),
        eligible[3].start_number: Removals(
            eligible[3].record_count // 2, eligible[3].data_end // 2
        ),
        eligible[4].start_number: Removals(
            eligible[4].record_count // 2, eligible[4].data_end // 2
        ),
    }
    groups = plan_groups(snapshot, removals)
    spans = [(g.start_number, g.end_number) for g in groups]
    n = [c.start_number for c in eligible]
    assert spans == [(n[0], n[1]), (n[3], n[4])]
    assert groups[0].kept_count == 2 and groups[0].version == 1
    assert groups[1].kept_bytes == eligible[3].data_end - eligible[3].data_end // 2 + (
        eligible[4].data_end - eligible[4].data_end // 2
    )
    assert groups[1].bytes_after == (
        HEADER_SIZE + groups[1].kept_bytes + MAP_ENTRY_SIZE * groups[1].kept_count + FOOTER_SIZE
    )
    unmerged = plan_groups(snapshot, removals, merge=False)
    assert [(g.start_number, g.end_number) for g in unmerged] == [
        (n[0], n[0]),
        (n[1], n[1]),
        (n[3], n[3]),
        (n[4], n[4]),
    ]


def test_an_expired_tombstone_stays_while_a_chunk_with_an_older_record_is_left_alone() -> None:
    """settle_tombstones (issue 20 item 3), on a made-up snapshot: 4 chunks of 40 records
    of 100 bytes; a chunk shrinks once 5 go. Chunk 0 loses 1 (left alone), so A's
    tombstone in chunk 1 stays; chunk 1 then loses 4, not 5, and is left alone too, so
    B's tombstone in chunk 2 stays though chunk 2 is rewritten; C's tombstone in chunk 3,
    its older record in the rewritten chunk 2, goes (the control)."""
    from equeue.compaction.plan import (
        ConditionalTombstone,
        settle_tombstones,
    )

    size = 4096
    snapshot = made_up_snapshot(size)
    settled = {0: Removals(1, 100), 1: Removals(4, 400), 2: Removals(5, 500), 3: Removals(5, 500)}
    tombstone = {n: n * size + 3900 for n in (1, 2, 3)}
    conditional = [
        ConditionalTombstone(tombstone[1], 100, frozenset({0})),
        ConditionalTombstone(tombstone[2], 100, frozenset({1})),
        ConditionalTombstone(tombstone[3], 100, frozenset({2})),
    ]
    removals, kept = settle_tombstones(snapshot, settled, conditional)
    assert kept == {1: [tombstone[1]], 2: [tombstone[2]]}
    assert removals == {**settled, 3: Removals(6, 600)}
    assert [(g.start_number, g.end_number) for g in plan_groups(snapshot, removals)] == [
        (2, 2),
        (3, 3),
    ]
    # Control: with chunk 0 shrinking too, every tombstone goes.
    removals, kept = settle_tombstones(snapshot, {**settled, 0: Removals(5, 500)}, conditional)
    assert kept == {} and removals[1] == Removals(5, 500)


def test_only_checkpointed_completed_chunks_are_eligible(tmp_path: Path) -> None:
    fill(tmp_path)
    MessageStore.open(tmp_path).close()  # close() checkpoints everything
    snapshot = take_snapshot(tmp_path)
    assert [c.eligible for c in snapshot.chunks] == [True] * (len(snapshot.chunks) - 1) + [False]
    (tmp_path / "checkpoint.json").unlink()
    assert not take_snapshot(tmp_path).eligible


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        # Few distinct first halves, so that distinct keys often share one (the case
        # sorted by both halves) and one key's rows often meet in a run.
        st.tuples(st.integers(-2, 2), st.integers(-3, 3)),
        max_size=60,
    ),
    st.randoms(use_true_random=False),
)
def test_superseded_rows_marks_all_but_each_keys_newest(
    keys: list[tuple[int, int]], rng: random.Random
) -> None:
    import numpy as np

    from equeue.compaction.decide import superseded_rows

    positions = rng.sample(range(10 * len(keys) + 1), len(keys))  # unique, in any order
    newest: dict[tuple[int, int], int] = {}
    for key, position in zip(keys, positions, strict=True):
        newest[key] = max(newest.get(key, position), position)
    expected = [position < newest[key] for key, position in zip(keys, positions, strict=True)]
    found = superseded_rows(
        np.array([k[0] for k in keys], np.int64),
        np.array([k[1] for k in keys], np.int64),
        np.array(positions, np.int64),
    )
    assert found.tolist() == expected


# --- the Spark job -----------------------------------------------------------------


def snapshot_messages(path: Path) -> dict[int, tuple[Any, ...]]:
    with MessageStore.open(path, read_only=True) as store:
        return {
            p: (m.message_id, m.topic, m.queue_id, m.queue_offset, m.key, m.body, m.stored_at)
            for p, m in all_messages(store).items()
        }


def test_job_removes_what_the_reference_removes_and_keeps_the_rest(
    tmp_path: Path, spark: SparkSession
) -> None:
    fill(tmp_path, messages=1500)
    with MessageStore.open(tmp_path, SMALL) as store:
        store.create_topic("d", retention=dt.timedelta(seconds=30))
    before = snapshot_messages(tmp_path)
    now = time.time() + 60  # every "d" message is past its 30 s retention
    removed = expected_removed(tmp_path, now)
    assert removed and any(before[p][1] == "d" for p in removed)
    report = compact(tmp_path, spark=spark, now=now)
    assert report.records_removed == len(removed)
    assert report.bytes_after < report.bytes_before
    after = snapshot_messages(tmp_path)
    assert after == {p: m for p, m in before.items() if p not in removed}
    with MessageStore.open(tmp_path) as store:
        assert store.recovery.clean
        with pytest.raises(CompactedAwayError):
            store.read(min(removed))
        survivor = min(p for p in after if p < max(removed))
        with pytest.raises(MessageNotFoundError):
            store.read(survivor + 1)  # inside a surviving record: never a message
        with pytest.raises(MessageNotFoundError):
            store.read(10**9)
        for key in {m[4] for m in before.values() if m[1] == "k"}:
            assert all(m.position not in removed for m in store.query_by_key("k", key))
        # pull skips removed offsets and still advances next_offset
        result = store.pull("k", 0, 0, 100_000)
        assert result.next_offset == store.queue_range("k", 0)[1]
    assert verify_store(tmp_path) == []
    again = compact(tmp_path, spark=spark, now=now)  # a second run finds nothing to do
    assert again.groups == []
    assert snapshot_messages(tmp_path) == after


def test_job_without_merging_writes_each_chunk_whole(tmp_path: Path, spark: SparkSession) -> None:
    """merge=False: every replacement covers one chunk and is written start to end by its
    task (the other pass-2 path)."""
    fill(tmp_path, messages=900)
    before = snapshot_messages(tmp_path)
    now = time.time() + 1
    removed = expected_removed(tmp_path, now)
    report = compact(tmp_path, spark=spark, now=now, merge=False)
    assert len(report.groups) > 1
    assert all(g.start_number == g.end_number for g in report.groups)
    assert report.records_removed == len(removed)
    assert snapshot_messages(tmp_path) == {p: m for p, m in before.items() if p not in removed}
    assert verify_store(tmp_path) == []
    assert not any((tmp_path / "compaction").glob("*/attempt-*"))


def test_second_job_rewrites_merged_files_where_newer_keys_arrived(
    tmp_path: Path, spark: SparkSession
) -> None:
    """Pass 1 attributes a position to the file covering its chunk number: in a merged
    file that is not the file's start number."""
    fill(tmp_path, messages=1500)
    now = time.time() + 1
    compact(tmp_path, spark=spark, now=now)
    merged = [c for c in take_snapshot(tmp_path).eligible if c.end_number > c.start_number]
    assert merged
    with MessageStore.open(tmp_path, SMALL) as store:
        for i in range(20):
            store.send("k", b"newer", key=f"key-{i}")
    before = snapshot_messages(tmp_path)
    removed = expected_removed(tmp_path, now)
    in_merged = [
        p
        for p in removed
        for c in merged
        if p >= (c.start_number + 1) * SMALL.layout.chunk_data_size
        if p < (c.end_number + 1) * SMALL.layout.chunk_data_size
    ]
    assert in_merged  # past the first chunk number of a merged file
    report = compact(tmp_path, spark=spark, now=now)
    assert report.records_removed == len(removed)
    assert snapshot_messages(tmp_path) == {p: m for p, m in before.items() if p not in removed}
    assert verify_store(tmp_path) == []


@settings(
    max_examples=5,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    seed=st.integers(0, 2**16),
    keys=st.integers(1, 30),
    tombstones=st.floats(0, 0.5),
    keyless=st.floats(0, 0.5),
    tombstone_age=st.sampled_from([0.0, 3600.0]),
    fresh=st.sampled_from([0.0, 0.5]),
)
# Issue 20 item 3, found by this test: chunks of distinct keys are left alone while the
# tombstones of some of their keys, in rewritten chunks, expire.
@example(seed=0, keys=10, tombstones=0.05, keyless=0.0, tombstone_age=0.0, fresh=0.5)
def test_property_survivors_match_the_reference(
    tmp_path_factory: pytest.TempPathFactory,
    spark: SparkSession,
    seed: int,
    keys: int,
    tombstones: float,
    keyless: float,
    tombstone_age: float,
    fresh: float,
) -> None:
    """Random stores: the job keeps exactly what the reference keeps; survivors keep
    offsets and ids; a consumer from the start sees every key's final value, in order.
    ``fresh``: the share of messages, first, that take a key of their own (chunks that
    would not shrink and are left alone); later tombstones then pick any key so far."""
    path = tmp_path_factory.mktemp("prop")
    rng = random.Random(seed)
    newest: dict[str, bytes] = {}
    with MessageStore.open(path, StoreConfig(chunk_data_size=4096, flush="os")) as store:
        store.create_topic(
            "c", 3, cleanup="compact", delete_retention=dt.timedelta(seconds=tombstone_age)
        )
        count = rng.randrange(50, 400)
        for i in range(count):
            if rng.random() < keyless:
                store.send("c", os.urandom(rng.randrange(1, 100)))
                continue
            tombstone = rng.random() < tombstones
            if i < fresh * count:
                key = f"new{i}"
            elif fresh and tombstone:
                key = rng.choice(sorted(newest))
            else:
                key = f"k{rng.randrange(keys)}"
            body = b"" if tombstone else os.urandom(rng.randrange(1, 100))
            store.send("c", body, key=key)
            newest[key] = body
    before = snapshot_messages(path)
    now = time.time() + 1
    removed = expected_removed(path, now)
    compact(path, spark=spark, now=now)
    after = snapshot_messages(path)
    assert after == {p: m for p, m in before.items() if p not in removed}
    by_key: dict[str, list[tuple[Any, ...]]] = {}
    for _, message in sorted(after.items()):
        if message[4] is not None:
            by_key.setdefault(message[4], []).append(message)
    for key, body in newest.items():
        final = by_key.get(key, [])
        if body or tombstone_age:  # a tombstone may be gone once expired
            assert final
        if final:  # never an older value in place of the final one
            assert final[-1][5] == body
    with MessageStore.open(path, read_only=True) as store:
        for queue_id in store.queue_ids("c"):
            offsets = [m.queue_offset for m in store.pull("c", queue_id, 0, 100_000).messages]
            assert offsets == sorted(offsets)


def test_expired_tombstone_stays_while_an_older_value_of_its_key_survives(
    tmp_path: Path, spark: SparkSession
) -> None:
    """Issue 20 item 3: chunk 0 (unique keys, one old value of "K") would not shrink and
    is left alone; K's expired tombstone in a later, rewritten chunk must then stay, or
    K's old value becomes its final value again. Control: J's tombstone, whose older
    value is in a rewritten chunk, goes with it."""
    size = SMALL.layout.chunk_data_size
    with MessageStore.open(tmp_path, SMALL) as store:
        store.create_topic("kv", 1, cleanup="compact")
        store.send("kv", b"old K", key="K")
        unique = 0
        while store.send("kv", b"u" * 40, key=f"u{unique}").position < size:
            unique += 1
        store.send("kv", b"old J", key="J")
        store.send("kv", b"", key="K")
        store.send("kv", b"", key="J")
        while store.send("kv", b"d" * 40, key="dup").position < 3 * size:
            pass
    report = compact(tmp_path, spark=spark, now=time.time() + 2 * DAY.total_seconds())
    assert report.groups and all(g.start_number > 0 for g in report.groups)  # chunk 0 kept
    with MessageStore.open(tmp_path, read_only=True) as store:
        pulled = store.pull("kv", 0, 0, 100_000).messages
        assert [m.body for m in pulled if m.key == "K"] == [b"old K", b""]
        assert [m.body for m in store.query_by_key("kv", "K")] == [b"", b"old K"]
        assert [m for m in pulled if m.key == "J"] == []  # control: nothing older survives
        assert store.query_by_key("kv", "J") == []
    assert verify_store(tmp_path) == []


def test_offset_for_time_skips_offsets_compacted_away(tmp_path: Path, spark: SparkSession) -> None:
    """Issue 20 item 19: offset_for_time returned offsets compaction removed. Now it
    returns the first surviving offset stored at or after the time (as before compaction
    when nothing was removed: the control)."""
    size = SMALL.layout.chunk_data_size
    with MessageStore.open(tmp_path, SMALL) as store:
        store.create_topic("kv", 1, cleanup="compact")
        sent = [store.send("kv", b"v" * 40, key="dup") for _ in range(30)]
        sent.append(store.send("kv", b"v" * 40, key="mid-0"))
        sent += [store.send("kv", b"v" * 40, key="dup") for _ in range(30)]
        while sent[-1].position < 2 * size:
            sent.append(store.send("kv", b"u" * 40, key=f"u{len(sent)}"))
        for r in sent:  # the control, before compaction
            assert store.offset_for_time("kv", 0, r.stored_at) == r.queue_offset
    compact(tmp_path, spark=spark, now=time.time() + 1)
    with MessageStore.open(tmp_path, read_only=True) as store:
        left = [m.queue_offset for m in store.pull("kv", 0, 0, 100_000).messages]
        assert 0 not in left and 31 not in left and 30 in left  # dup's old values went
        for r in sent:
            expected = min(o for o in left if o >= r.queue_offset)
            assert store.offset_for_time("kv", 0, r.stored_at) == expected, r.queue_offset
        assert store.offset_for_time("kv", 0, 0) == left[0]
        end = store.queue_range("kv", 0)[1]
        assert store.offset_for_time("kv", 0, sent[-1].stored_at + 1) == end


def test_dry_run_changes_nothing(tmp_path: Path, spark: SparkSession) -> None:
    """Not a file changed, nor one created (issue 20 item 20: the job's lock files were);
    a real run then plans the same."""
    fill(tmp_path)
    before = tree(tmp_path)
    report = compact(tmp_path, spark=spark, dry_run=True)
    assert report.dry_run and report.groups and report.records_removed > 0
    assert tree(tmp_path) == before
    real = compact(tmp_path, spark=spark)
    assert real.records_removed == report.records_removed and tree(tmp_path) != before


def tree(path: Path) -> dict[str, tuple[bytes | None, int]]:
    """Every file and directory under ``path`` (the lock files too): bytes and mtime."""
    found = {
        name: (data, (path / name).stat().st_mtime_ns)
        for name, data in snapshot(path, skip=()).items()
    }
    assert found
    return found


def test_data_source_gives_every_message_one_partition_per_chunk(
    tmp_path: Path, spark: SparkSession
) -> None:
    fill(tmp_path)
    frame = spark.read.format("equeue").load(str(tmp_path))
    assert frame.rdd.getNumPartitions() == len(message_chunk_files(tmp_path))
    rows = {r["position"]: r for r in frame.collect()}
    with MessageStore.open(tmp_path, read_only=True) as store:
        messages = all_messages(store)
    assert rows.keys() == messages.keys()
    for position, m in messages.items():
        row = rows[position]
        assert (row["topic"], row["queue_id"], row["queue_offset"], row["message_id"]) == (
            m.topic,
            m.queue_id,
            m.queue_offset,
            m.message_id,
        )
        assert (row["tag"], row["key"], bytes(row["body"])) == (m.tag, m.key, m.body)
        assert row["stored_at"].timestamp() == pytest.approx(m.stored_at, abs=1e-5)


def test_local_workers_import_the_installed_pyspark(spark: SparkSession) -> None:
    """The session's daemon drops Spark's pyspark.zip from its workers' path (its modules
    would be compiled from source in every worker), keeping the other entries in order."""
    import pyspark

    from equeue.spark.daemon import installed_path

    def worker_pyspark(_: Iterable[int]) -> Iterator[str]:
        import pyspark

        yield pyspark.__file__ or ""

    assert spark.sparkContext.parallelize([0], 1).mapPartitions(worker_pyspark).collect() == [
        pyspark.__file__
    ]
    zips = ["/spark/python/lib/pyspark.zip", "/spark/python/lib/py4j-0.10.9.9-src.zip"]
    assert installed_path(["/a", *zips, *sys.path]) == ["/a", *sys.path]
    # Where the zips hold the only pyspark, they stay.
    assert installed_path(["/a", *zips]) == ["/a", *zips]


# --- the command -------------------------------------------------------------------


def test_compact_command(
    tmp_path: Path, spark: SparkSession, capsys: pytest.CaptureFixture[str]
) -> None:
    fill(tmp_path)
    assert main(["compact", str(tmp_path), "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "Dry run: would rewrite" in out and "[compact] pass 1" in err
    assert main(["compact", str(tmp_path), "--json", "--now", "2100-01-01T00:00:00Z"]) == 0
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["records_removed"] > 0 and doc["bytes_after"] < doc["bytes_before"]
    assert doc["now"] == dt.datetime(2100, 1, 1, tzinfo=dt.UTC).timestamp()
    assert main(["verify", str(tmp_path)]) == 0
    assert main(["compact", str(tmp_path)]) == 0
    assert "Nothing to compact" in capsys.readouterr().out
    assert main(["compact", str(tmp_path / "nope")]) == 2
    assert "not an equeue store" in capsys.readouterr().err


def test_second_job_is_refused_while_one_runs(tmp_path: Path) -> None:
    from equeue.compaction import commit

    fill(tmp_path)
    with commit.job_lock(tmp_path), pytest.raises(CompactionError, match="another compaction"):
        compact(tmp_path)


def test_time_retention_passes_a_chunk_compaction_emptied(
    tmp_path: Path, spark: SparkSession
) -> None:
    """A chunk whose every record compaction removed has a footer without timestamps;
    time-based retention stopped at it and never removed the expired chunks after it.
    The control: before compaction, retention removes the same expired chunks."""
    size = SMALL.layout.chunk_data_size
    config = StoreConfig(chunk_data_size=size, flush="os", retention=dt.timedelta(hours=1))
    with MessageStore.open(tmp_path, SMALL) as store:
        store.create_topic("d", 1, retention=dt.timedelta(seconds=30))
        store.create_topic("e", 1)
        sent = store.send("d", b"x" * 100)
        while sent.position < size - 200:  # chunk 0: only "d", all past its retention
            sent = store.send("d", b"x" * 100)
        while sent.position < 3 * size:  # then "e", kept by compaction
            sent = store.send("e", b"y" * 100)
    control = tmp_path.parent / "control"
    shutil.copytree(tmp_path, control)
    later = time.time() + 2 * DAY.total_seconds()
    with MessageStore.open(control, config) as store:
        assert store.apply_retention(now=later) == 3
        expected = store.queue_range("e", 0)
    report = compact(tmp_path, spark=spark, now=time.time() + DAY.total_seconds())
    assert [g.records_kept for g in report.groups] == [0]  # chunk 0 emptied
    with MessageStore.open(tmp_path, config) as store:
        assert store.apply_retention(now=later) == 3
        assert store.queue_range("e", 0) == expected
        first, end = store.queue_range("d", 0)
        assert first == end > 0
