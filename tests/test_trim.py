"""A pull's byte budget counted in C (equeue/cext/trim.c, trim_run) gives what the Python
loop (equeue/store/reads.py, trim_python) gives: the same bytes left, messages kept and
offset, the list cut the same way, on random body sizes, budgets, counted prefixes and
offsets; for the C Message, the NamedTuple and a store's own pulls."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from equeue import MessageStore, StoreConfig, speedups
from equeue.store import reads
from equeue.store.types import Message, TupleMessage

fast = speedups.SPEEDUPS
pytestmark = pytest.mark.skipif(fast is None, reason="the C accelerator is not built")

LIMIT = reads.TRIM_BUDGET_LIMIT


def _messages(kind: type, sizes: list[int], first: int) -> list[Any]:
    return [
        kind(f"id{i}", "t", 0, first + i, 100 * i, "", None, {}, 0, b"x" * size, 0, 0)
        for i, size in enumerate(sizes)
    ]


@settings(max_examples=400, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5000), max_size=40),
    budget=st.integers(-LIMIT, LIMIT) | st.integers(-10, 20_000),
    counted=st.integers(0, 45),
    offset=st.integers(-(2**70), 2**70),
    first=st.integers(0, 2**63 - 100),
    tuples=st.booleans(),
)
def test_trim_run_is_the_python_loop(
    sizes: list[int], budget: int, counted: int, offset: int, first: int, tuples: bool
) -> None:
    assert fast is not None
    counted = min(counted, len(sizes))
    kind = TupleMessage if tuples else Message
    in_c, in_python = _messages(kind, sizes, first), _messages(kind, sizes, first)
    assert fast.trim_run(in_c, counted, budget, offset) == reads.trim_python(
        in_python, counted, budget, offset
    )
    assert in_c == in_python


@settings(max_examples=300, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 50), min_size=1, max_size=12),
    counted=st.integers(0, 12),
    fits=st.integers(0, 12),
    delta=st.integers(-1, 1),
)
def test_trim_run_at_the_edges_of_the_budget(
    sizes: list[int], counted: int, fits: int, delta: int
) -> None:
    """Budgets of exactly the bodies that fit, one byte more and one less."""
    assert fast is not None
    counted = min(counted, len(sizes))
    budget = sum(sizes[counted : counted + fits]) + delta
    in_c, in_python = _messages(Message, sizes, 3), _messages(Message, sizes, 3)
    assert fast.trim_run(in_c, counted, budget, -1) == reads.trim_python(
        in_python, counted, budget, -1
    )
    assert in_c == in_python


@given(budget=st.sampled_from([LIMIT + 1, -LIMIT - 1, 2**80, -(2**80)]))
def test_budgets_past_the_c_range_take_the_python_loop(budget: int) -> None:
    messages = _messages(Message, [10, 20, 30], 5)
    assert reads._trim(messages, 0, budget, 7) == reads.trim_python(
        _messages(Message, [10, 20, 30], 5), 0, budget, 7
    )


def test_a_body_without_a_length_is_the_same_type_error() -> None:
    assert fast is not None
    bad = [TupleMessage("i", "t", 0, 0, 0, "", None, {}, 0, 5, 0, 0)]  # type: ignore[arg-type]
    with pytest.raises(TypeError) as in_python:
        reads.trim_python(list(bad), 0, 100, 0)
    with pytest.raises(TypeError) as in_c:
        fast.trim_run(list(bad), 0, 100, 0)
    assert type(in_c.value) is type(in_python.value)
    with pytest.raises(AttributeError):  # (reads.py passes Messages only)
        fast.trim_run([object()], 0, 100, 0)


@pytest.fixture(scope="module")
def store() -> Iterator[MessageStore]:
    directory = Path(tempfile.mkdtemp(prefix="eq", dir="/tmp"))
    try:
        with MessageStore.open(directory / "s", StoreConfig(flush="async")) as opened:
            opened.create_topic("t", 1)
            opened.send_batch("t", [b"y" * ((i * 7919) % 3000) for i in range(300)])
            yield opened
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@settings(max_examples=150, deadline=None)
@given(offset=st.integers(0, 320), max_count=st.integers(1, 200), max_bytes=st.integers(1, 400_000))
def test_a_store_pull_with_max_bytes_is_the_same_either_way(
    store: MessageStore, offset: int, max_count: int, max_bytes: int
) -> None:
    in_c = store.pull("t", 0, offset, max_count, max_bytes=max_bytes)
    saved = reads._trim
    reads._trim = reads.trim_python
    try:
        in_python = store.pull("t", 0, offset, max_count, max_bytes=max_bytes)
    finally:
        reads._trim = saved
    assert [m.queue_offset for m in in_c] == [m.queue_offset for m in in_python]
    assert [m.body for m in in_c] == [m.body for m in in_python]
    assert in_c.next_offset == in_python.next_offset
    if len(in_c) > 1:  # the budget held (only a first message may pass it alone)
        assert sum(len(m.body) for m in in_c) <= max_bytes
