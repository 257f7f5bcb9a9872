"""The API as a Python user meets it: errors importable from the package, a pull result
that is a sequence of its messages, tag filters that wait, ``max_bytes``, docstrings and
the store's repr."""

from __future__ import annotations

import datetime as dt
import inspect
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from code_paths import code_path  # noqa: F401 - the fixture
from hypothesis import given, settings
from hypothesis import strategies as st
from store_helpers import snapshot

import equeue
import equeue.errors
from equeue import InvalidMessageError, MessageStore, PullResult, StoreConfig
from equeue.store.times import epoch_ns, parse_time

SMALL: dict[str, Any] = {"chunk_data_size": 64 * 1024, "queue_chunk_records": 400}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[MessageStore]:
    with MessageStore.open(tmp_path / "s", StoreConfig(**SMALL)) as s:
        s.create_topic("t", 1)
        yield s


# --- errors from the package --------------------------------------------------


def test_every_error_class_is_exported_from_the_package() -> None:
    classes = {
        name
        for name, value in vars(equeue.errors).items()
        if inspect.isclass(value)
        and issubclass(value, Exception)
        and value.__module__ == "equeue.errors"
    }
    assert "StoreLockedError" in classes  # control: the scan finds the errors
    missing = sorted(
        name for name in classes if getattr(equeue, name, None) is not getattr(equeue.errors, name)
    )
    assert not missing, f"not importable from equeue: {missing}"
    assert not classes - set(equeue.__all__), "equeue.__all__ lacks error classes"
    assert all(hasattr(equeue, name) for name in equeue.__all__)


def test_store_locked_error_is_caught_from_the_package(tmp_path: Path) -> None:
    from equeue import StoreLockedError

    with MessageStore.open(tmp_path / "s"), pytest.raises(StoreLockedError):
        MessageStore.open(tmp_path / "s")


# --- PullResult ----------------------------------------------------------------


@pytest.mark.usefixtures("code_path")
def test_pull_result_is_a_sequence_of_its_messages(store: MessageStore) -> None:
    sent = [store.send("t", b"m%d" % i) for i in range(3)]
    result = store.pull("t", 0, 0, max_count=10)
    assert len(result) == 3 and bool(result)
    assert [m.body for m in result] == [b"m0", b"m1", b"m2"]
    assert result[0].message_id == sent[0].message_id and result[-1].body == b"m2"
    assert result.messages == list(result) and result.next_offset == 3
    empty = store.pull("t", 0, 3)
    assert not empty and len(empty) == 0 and list(empty) == [] and empty.next_offset == 3
    assert "3 messages" in repr(result) and "next_offset=3" in repr(result)
    assert result == PullResult(list(result), 3) and result != empty


@pytest.mark.usefixtures("code_path")
def test_pull_loop_with_walrus_ends(store: MessageStore) -> None:
    store.send_batch("t", [b"x"] * 10)
    offset, seen, rounds = 0, 0, 0
    while batch := store.pull("t", 0, offset, max_count=3):
        seen += len(batch)
        offset = batch.next_offset
        rounds += 1
        assert rounds < 10, "the loop did not end"
    assert seen == 10 and rounds == 4


# --- tags and wait -------------------------------------------------------------


@pytest.mark.usefixtures("code_path")
def test_empty_tag_list_is_refused(store: MessageStore) -> None:
    store.send("t", b"a", tag="A")
    empties: list[Any] = [[], (), set(), iter([])]
    for empty in empties:
        with pytest.raises(InvalidMessageError, match="tags=None"):
            store.pull("t", 0, 0, tags=empty)
    assert len(store.pull("t", 0, 0, tags=None)) == 1  # control
    assert len(store.pull("t", 0, 0, tags=["A"])) == 1


def _send_later(store: MessageStore, items: list[tuple[float, str]]) -> threading.Thread:
    def run() -> None:
        for delay, tag in items:
            time.sleep(delay)
            store.send("t", tag.encode(), tag=tag)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.usefixtures("code_path")
@pytest.mark.parametrize("read_only", [False, True])
def test_wait_with_tags_waits_for_a_matching_message(
    store: MessageStore, tmp_path: Path, read_only: bool
) -> None:
    reader = MessageStore.open(store.path, read_only=True) if read_only else store
    try:
        # a non-matching message arrives first, then the matching one
        thread = _send_later(store, [(0.05, "B"), (0.15, "A")])
        result = reader.pull("t", 0, 0, tags=["A"], wait=20)
        thread.join()
        assert [m.tag for m in result.messages] == ["A"]
        assert result.next_offset == 2
        # control: nothing matching arrives, the wait ends at its deadline, past the skips
        thread = _send_later(store, [(0.02, "B")])
        result = reader.pull("t", 0, 2, tags=["A"], wait=0.3)
        thread.join()
        assert not result.messages and result.next_offset == 3
    finally:
        if read_only:
            reader.close()


# --- max_bytes -----------------------------------------------------------------


@pytest.mark.usefixtures("code_path")
@pytest.mark.parametrize("tags", [None, ["A"]])
def test_max_bytes_stops_before_the_bodies_exceed_it(
    store: MessageStore, tags: list[str] | None
) -> None:
    sizes = [100, 200, 300, 5000, 10, 10]
    store.send_batch("t", [{"body": b"x" * n, "tag": "A"} for n in sizes])
    result = store.pull("t", 0, 0, max_count=100, tags=tags, max_bytes=650)
    assert [len(m.body) for m in result] == [100, 200, 300]
    assert result.next_offset == 3
    result = store.pull("t", 0, 3, max_count=100, tags=tags, max_bytes=650)
    assert [len(m.body) for m in result] == [5000]  # one at least, whatever its size
    assert result.next_offset == 4
    result = store.pull("t", 0, 4, max_count=100, tags=tags, max_bytes=650)
    assert [len(m.body) for m in result] == [10, 10] and result.next_offset == 6
    # control: without max_bytes, all of them
    assert len(store.pull("t", 0, 0, max_count=100, tags=tags)) == 6
    # exactly full
    assert len(store.pull("t", 0, 0, max_count=100, tags=tags, max_bytes=600)) == 3


@pytest.mark.usefixtures("code_path")
def test_max_bytes_in_a_long_run(store: MessageStore) -> None:
    store.send_batch("t", [b"y" * 10] * 1000)  # more than one run of entries (256)
    offset, got = 0, 0
    while batch := store.pull("t", 0, offset, max_count=10_000, max_bytes=3000):
        assert len(batch) == 300 or batch.next_offset == 1000
        got += len(batch)
        offset = batch.next_offset
    assert got == 1000


@pytest.mark.usefixtures("code_path")
def test_max_bytes_read_only(store: MessageStore) -> None:
    store.send_batch("t", [b"z" * 100] * 5)
    store.flush()
    with MessageStore.open(store.path, read_only=True) as reader:
        result = reader.pull("t", 0, 0, max_count=10, max_bytes=250)
        assert len(result) == 2 and result.next_offset == 2


@pytest.mark.parametrize("bad", [0, -1, 1.5, "10", True])
def test_bad_max_bytes_is_refused(store: MessageStore, bad: Any) -> None:
    store.send("t", b"a")
    with pytest.raises(InvalidMessageError, match="max_bytes"):
        store.pull("t", 0, 0, max_bytes=bad)


# --- docstrings and repr ---------------------------------------------------------


def test_public_methods_and_result_types_have_docstrings() -> None:
    from equeue import Message, RecoveryReport, SendResult

    names = [n for n in vars(MessageStore) if not n.startswith("_")]
    assert {"send", "get", "read", "topics", "queue_ids", "committed_offset"} <= set(names)
    missing = [n for n in names if not (getattr(MessageStore, n).__doc__ or "").strip()]
    assert not missing, f"MessageStore methods without a docstring: {missing}"
    for kind in (Message, PullResult, SendResult, RecoveryReport):
        doc = kind.__doc__ or ""  # (a NamedTuple's own is "Name(field, ...)")
        assert doc.strip() and not doc.startswith(kind.__name__ + "("), kind
    assert "problems" in (RecoveryReport.__doc__ or "")  # store.recovery's fields
    assert "seconds" in (Message.__doc__ or "") and "seconds" in (SendResult.__doc__ or "")
    for method in ("send", "get", "read", "pull"):
        assert "Raises" in (getattr(MessageStore, method).__doc__ or ""), method


def test_store_repr_says_path_mode_and_topics_without_io(tmp_path: Path) -> None:
    path = tmp_path / "s"
    store = MessageStore.open(path, StoreConfig(**SMALL))
    store.create_topic("a")
    store.create_topic("b")
    text = repr(store)
    assert str(path) in text and "read-write" in text and "2 topics" in text
    with MessageStore.open(path, read_only=True) as reader:
        assert "read-only" in repr(reader) and "2 topics" in repr(reader)
    store.close()
    assert "closed" in repr(store)
    (path / "topics.json").unlink()  # no I/O: the repr does not look at the files
    assert "2 topics" in repr(store)


# --- reopening adopts the store's layout --------------------------------------------


def test_reopen_adopts_the_stores_layout_when_unset(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with MessageStore.open(path, StoreConfig(**SMALL)) as store:
        store.send("t", b"kept")
    with MessageStore.open(path, StoreConfig(flush="os")) as store:
        assert store.config.chunk_data_size == SMALL["chunk_data_size"]
        assert store.config.queue_chunk_records == SMALL["queue_chunk_records"]
        assert store.config.flush == "os"
        assert [m.body for m in store.pull("t", 0, 0)] == [b"kept"]
    with MessageStore.open(path, StoreConfig(queue_chunk_records=400)) as store:  # same: ok
        assert store.config.chunk_data_size == SMALL["chunk_data_size"]
    with MessageStore.open(path) as store:
        assert store.config.layout == (SMALL["chunk_data_size"], SMALL["queue_chunk_records"])


def test_reopen_refuses_an_explicit_conflicting_layout(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with MessageStore.open(path, StoreConfig(**SMALL)) as store:
        store.send("t", b"kept")
    before = snapshot(path)
    default = StoreConfig().layout.chunk_data_size  # explicit, though the default value
    bads: list[dict[str, Any]] = [{"chunk_data_size": default}, {"queue_chunk_records": 800}]
    for bad in bads:
        with pytest.raises(equeue.ConfigError, match=f"{next(iter(bad))}=") as caught:
            MessageStore.open(path, StoreConfig(**bad))
        assert str(path) in str(caught.value) and "unset" in str(caught.value)
    assert snapshot(path) == before


def test_new_store_gets_the_default_layout(tmp_path: Path) -> None:
    with MessageStore.open(tmp_path / "s", StoreConfig(flush="os")) as store:
        assert store.config.chunk_data_size == 256 * 1024 * 1024
        assert store.config.queue_chunk_records == 1_000_000


# --- times: one rule, exact offset_for_time ---------------------------------------


@pytest.fixture(scope="module")
def timed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[MessageStore, list[Any]]]:
    with MessageStore.open(tmp_path_factory.mktemp("timed") / "s", StoreConfig(**SMALL)) as s:
        s.create_topic("t", 1)
        sent = [s.send("t", b"%d" % i) for i in range(120)]  # many share a microsecond
        sent += s.send_batch("t", [b"b"] * 40)
        sent += [s.send("t", b"%d" % i) for i in range(40)]
        yield s, sent


@settings(max_examples=150, deadline=None)
@given(index=st.integers(0, 199), as_datetime=st.booleans(), shift_us=st.integers(-2, 2))
def test_offset_for_time_is_exact_for_what_a_message_shows(
    timed: tuple[MessageStore, list[Any]], index: int, as_datetime: bool, shift_us: int
) -> None:
    store, _ = timed
    stored = [m.stored_at for m in store.pull("t", 0, 0, max_count=1000)]
    assert len(stored) == 200
    view: Any
    if as_datetime:  # as a user sees a message's time, and a few microseconds around it
        when: Any = dt.datetime.fromtimestamp(stored[index], dt.UTC)
        when += dt.timedelta(microseconds=shift_us)
        view = [dt.datetime.fromtimestamp(s, dt.UTC) for s in stored]
    else:
        when = stored[index] + shift_us * 1e-6
        view = stored
    expected = next((i for i, v in enumerate(view) if v >= when), len(view))
    assert store.offset_for_time("t", 0, when) == expected
    if shift_us == 0:
        assert expected <= index and view[expected] == view[index]


def test_offset_for_time_finds_each_message_by_its_datetime(
    timed: tuple[MessageStore, list[Any]],
) -> None:
    """The issue's case: 38 of 102 were off by one through microsecond rounding."""
    store, _ = timed
    messages = store.pull("t", 0, 0, max_count=1000).messages
    wrong = []
    for m in messages:
        when = dt.datetime.fromtimestamp(m.stored_at, dt.UTC)
        found = store.offset_for_time("t", 0, when)
        first = next(x for x in messages if dt.datetime.fromtimestamp(x.stored_at, dt.UTC) == when)
        if found != first.queue_offset:
            wrong.append(m.queue_offset)
    assert not wrong, f"{len(wrong)} of {len(messages)} off"


def test_naive_datetimes_are_refused_everywhere(timed: tuple[MessageStore, list[Any]]) -> None:
    store, _ = timed
    naive = dt.datetime(2024, 5, 1, 12, 0)
    with pytest.raises(InvalidMessageError, match="no time zone"):
        store.offset_for_time("t", 0, naive)
    with pytest.raises(InvalidMessageError, match="no time zone") as refused:
        parse_time("2024-05-01T12:00:00")
    # text's advice, not Python's (review 38e E6: it named time.now(UTC), which no module has)
    assert "2024-05-01T12:00:00Z" in str(refused.value) and "(" in str(refused.value)
    assert "now(" not in str(refused.value)
    with pytest.raises(InvalidMessageError, match="no time zone"):
        epoch_ns(naive)
    # control: aware datetimes, epoch seconds and zoned text all work, and agree
    aware = naive.replace(tzinfo=dt.UTC)
    ns = 1714564800 * 10**9
    assert parse_time("2024-05-01T12:00:00Z") == parse_time("2024-05-01T14:00:00+02:00") == ns
    assert parse_time("1714564800") == epoch_ns(aware) == epoch_ns(1714564800) == ns
    assert parse_time("1714564800.000000001") == ns + 1
    # review11 R11-7's audit: "1e999999" raised decimal.Overflow; 5,000 digits made ns
    # whose / 1e9 (equeue compact --now) raised a builtin OverflowError
    for text in ("1e999999", "-1e999999", "9" * 5000, "9223372037"):
        with pytest.raises(InvalidMessageError, match=f"time '{text[:10]}"):
            parse_time(text)
    assert parse_time("9223372036") == 9223372036 * 10**9  # the last second an i64 holds
    assert store.offset_for_time("t", 0, aware) == store.offset_for_time("t", 0, 1714564800) == 0
