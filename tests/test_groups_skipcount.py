"""The offsets retention removed before a group consumed them, counted once each
(GroupCoordinator.note_skip: docs/groups.md, "Retention underneath a group")."""

from __future__ import annotations

import datetime as dt
import itertools
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from group_helpers import Clock
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import raw, short_dir

from equeue import MessageStore, StoreConfig
from equeue.format.chunk import MIN_CHUNK_DATA_SIZE
from equeue.server import BrokerThread, groups
from equeue.server.groups import GroupCoordinator


@pytest.fixture
def coord(tmp_path: Path) -> Iterator[GroupCoordinator]:
    with MessageStore.open(tmp_path / "s") as store:
        store.create_topic("t", 1)
        clock = Clock()
        yield GroupCoordinator(store, clock=clock, wall_clock=clock)


def test_a_note_below_an_earlier_one_counts_what_lies_below_it(
    coord: GroupCoordinator, caplog: pytest.LogCaptureFixture
) -> None:
    # reviewh F2: a member's pull from 96 counted 96..2039; the member died, the queue's
    # next holder started at the group's commit, 40: offsets 40..95 were counted nowhere
    caplog.set_level(logging.WARNING, logger="equeue")
    coord.note_skip("g", "t", 0, 96, 2040)
    coord.note_skip("g", "t", 0, 40, 2040)
    found = coord.skipped["g"][("t", 0)]
    assert found.count == 2040 - 40
    assert found.ranges == [(96, 2040), (40, 96)]
    assert "offsets 40 to 95 of t/0 were removed by retention" in caplog.text
    coord.note_skip("g", "t", 0, 40, 2040)  # counted already: nothing more, no warning
    assert found.count == 2000
    assert caplog.text.count("were removed by retention") == 2


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GroupCoordinator]:
    with MessageStore.open(tmp_path_factory.mktemp("skips") / "s") as store:
        store.create_topic("t", 1)
        yield GroupCoordinator(store)


def _runs(offsets: set[int]) -> int:
    """How many disjoint ranges ``offsets`` makes."""
    return sum(1 for o in offsets if o - 1 not in offsets)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3000), st.integers(0, 40)).map(lambda p: (p[0], p[0] + p[1])),
        max_size=100,
    )
)
def test_every_offset_noted_is_counted_once(
    shared: GroupCoordinator, notes: list[tuple[int, int]]
) -> None:
    """Through note_skip itself (review5 F5: the model re-implemented its loop). The model:
    the union of every [start, first) noted. Past MAX_COUNTED_RANGES disjoint ranges the
    lowest gap is taken as counted: never more than the model, and exact below it."""
    shared.skipped.clear()
    logging.disable(logging.WARNING)  # one warning a range: thousands here
    try:
        model: set[int] = set()
        bounded = False
        for start, first in notes:
            shared.note_skip("g", "t", 0, start, first)
            model |= set(range(start, first))
            bounded = bounded or _runs(model) > groups.MAX_COUNTED_RANGES
    finally:
        logging.disable(logging.NOTSET)
    skipped = shared.skipped.get("g", {}).get(("t", 0), groups._Skipped())
    covered = {offset for low, high in skipped.counted for offset in range(low, high)}
    assert skipped.count <= len(model)
    assert covered >= model
    assert len(skipped.counted) <= groups.MAX_COUNTED_RANGES
    assert all(a[1] < b[0] for a, b in itertools.pairwise(skipped.counted))
    if not bounded:
        assert skipped.count == len(model)
        assert covered == model


def test_past_the_range_bound_a_note_over_everything_never_counts_twice(
    coord: GroupCoordinator,
) -> None:
    """review5 F5: 70 disjoint notes (6 past the 64-range bound: the 6 lowest gaps of 5
    are taken as counted), then one note over all of them: 670 of the 700 offsets counted,
    none twice (forgetting a range instead of a gap counted it again: 730)."""
    logging.disable(logging.WARNING)
    try:
        for i in range(70):
            coord.note_skip("g", "t", 0, i * 10, i * 10 + 5)
        found = coord.skipped["g"][("t", 0)]
        assert found.count == 350
        assert len(found.counted) == groups.MAX_COUNTED_RANGES
        assert found.counted[0] == (0, 65)  # 7 ranges and the 6 gaps between them
        coord.note_skip("g", "t", 0, 0, 700)
    finally:
        logging.disable(logging.NOTSET)
    assert found.count == 700 - 6 * 5
    assert found.counted == [(0, 700)]


def test_a_pull_below_the_groups_commit_counts_nothing_the_group_consumed(
    tmp_path: Path,
) -> None:
    """review5 F8: group g committed at 5, retention then removed below F; the join's
    grant counts [5, F). A member pulling from 0 (a seek back) skips [0, F) too, but the
    group consumed [0, 5) before its commit: those are not counted, nor logged."""
    base = short_dir()
    try:
        config = StoreConfig(chunk_data_size=MIN_CHUNK_DATA_SIZE, retention=dt.timedelta(seconds=1))
        with MessageStore.open(base / "s", config) as store:
            store.create_topic("t", 1)
            for _ in range(40):
                store.send("t", b"f" * 900)
            store.commit_offset("g", "t", 0, 5)
            assert store.apply_retention(now=time.time() + 60) > 0
            first = store.queue_range("t", 0)[0]
            assert first > 5
        with BrokerThread(base / "s") as running, raw(running.urls[0]) as member:
            joined = member.call("join", group="g", consumer="c", topics=["t"])
            assert ["t", 0] in joined["assignment"]
            pulled = member.call(
                "pull", topic="t", queue_id=0, offset=0, group="g", consumer="c",
                join_id=joined["join_id"],
            )  # fmt: skip
            assert pulled[1] > first  # [messages, next_offset]: from the first retained on
            skipped = member.call("stats", group="g")["groups"]["g"]["skipped"]["t/0"]
            assert skipped["count"] == first - 5, skipped
            assert skipped["ranges"] == [[5, first]]
    finally:
        shutil.rmtree(base, ignore_errors=True)
