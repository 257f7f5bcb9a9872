"""The offsets retention removed before a group consumed them, counted once each
(GroupCoordinator.note_skip: docs/groups.md, "Retention underneath a group")."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from group_helpers import Clock
from hypothesis import given, settings
from hypothesis import strategies as st

from equeue import MessageStore
from equeue.server import groups
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


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 300), st.integers(0, 300)).map(sorted),
        max_size=30,
    )
)
def test_every_offset_noted_is_counted_once(notes: list[list[int]]) -> None:
    # the model: the union of every [start, first) noted
    skipped = groups._Skipped()
    model: set[int] = set()
    for start, first in notes:
        for low, high in skipped.uncounted(start, first):
            skipped.count += high - low
            skipped.add(low, high)
        model |= set(range(start, first))
    assert skipped.count == len(model)
    covered = {offset for low, high in skipped.counted for offset in range(low, high)}
    assert covered == model
    assert all(a[1] < b[0] for a, b in itertools.pairwise(skipped.counted))
