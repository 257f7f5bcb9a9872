"""offset_for_time on a queue whose oldest log chunks retention removed (round 19).

The store: topic q (1 queue), 1,800 messages of 100 B in 8 KiB log chunks (30 chunks),
then retention keeping 6 chunks. Read-only handles opened before the retention still
list the removed chunks until their look (every 10 ms) follows the log: a search whose
probes met them stepped one offset at a time, a failed read each (measured on 256
removed chunks: 5,699 reads and 0.8-1.0 s of CPU for one call; now 12 reads, 2-3 ms).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from equeue import MessageStore, StoreConfig

CONFIG = StoreConfig(chunk_data_size=8192, flush="os", default_queue_count=1)
RETENTION = StoreConfig(
    chunk_data_size=8192, flush="os", default_queue_count=1, max_store_bytes=6 * 8400
)
STALE_VIEWS = 4

Retained = tuple[MessageStore, list[MessageStore], list[tuple[int, float]], int]


@pytest.fixture(scope="module")
def retained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Retained]:
    """(the writer after retention, read-only views opened before it, the kept
    messages' (offset, stored_at), the queue's next offset)."""
    path = tmp_path_factory.mktemp("oft") / "store"
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("q", 1)
        for _ in range(1800):
            store.send("q", b"x" * 100)
    views = [MessageStore.open(path, CONFIG, read_only=True) for _ in range(STALE_VIEWS)]
    for view in views:
        assert view.queue_range("q", 0)[0] == 0
    writer = MessageStore.open(path, RETENTION)
    try:
        assert writer.apply_retention() >= 20
        first, end = writer.queue_range("q", 0)
        kept = [(m.queue_offset, m.stored_at) for m in writer.pull("q", 0, first, end - first)]
        assert [offset for offset, _ in kept] == list(range(first, end))
        yield writer, views, kept, end
    finally:
        writer.close()
        for view in views:
            view.close()


def _model(kept: list[tuple[int, float]], end: int, when: float) -> int:
    return next((offset for offset, stored in kept if stored >= when), end)


def _counting_reads(store: MessageStore) -> list[int]:
    counts = [0]
    read = store._reader.read

    def counted(position: int) -> bytes:
        counts[0] += 1
        return read(position)

    store._reader.read = counted  # type: ignore[method-assign]
    return counts


@pytest.mark.parametrize("where", ["before-the-first-kept", "first-kept", "middle", "after"])
def test_a_view_behind_retention_jumps_to_the_first_kept_offset(
    retained: Retained, where: str
) -> None:
    """A view that has not looked since the retention (its look pushed out): the answer
    is the writer's and the model's, in a bounded number of log reads (before: one per
    removed entry the probes crossed, 1,000 and more here)."""
    writer, views, kept, end = retained
    view = views[["before-the-first-kept", "first-kept", "middle", "after"].index(where)]
    when = {
        "before-the-first-kept": 0.0,
        "first-kept": kept[0][1],
        "middle": kept[len(kept) // 2][1],
        "after": kept[-1][1] + 1,
    }[where]
    view._messages.looked_at = time.monotonic() + 3600  # no look: the view stays behind
    assert view._queue("q", 0).first_offset == 0
    reads = _counting_reads(view)
    answer = view.offset_for_time("q", 0, when)
    assert answer == _model(kept, end, when) == writer.offset_for_time("q", 0, when)
    assert reads[0] <= 20, reads[0]


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_the_answer_is_the_models(retained: Retained, data: st.DataObject) -> None:
    """The writer's answer for any time, between, at and around the kept messages'
    stored_at, is the first kept offset stored at or after it (the next offset if
    none)."""
    writer, _, kept, end = retained
    index = data.draw(st.integers(0, len(kept)))
    nudge = data.draw(st.sampled_from([-1e-3, -1e-6, 0.0, 1e-6, 1e-3]))
    when = (kept[index][1] if index < len(kept) else kept[-1][1] + 1) + nudge
    assert writer.offset_for_time("q", 0, when) == _model(kept, end, when)
