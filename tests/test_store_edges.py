"""Reviewer findings on issue 20 at the API's and the inspector's edges: crafted queue
directories, a read-only handle's reads after the writer's retention, a non-object
topics.json, a pull waiting across close(), and a bool max_count."""

from __future__ import annotations

import contextlib
import io
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from code_paths import code_path  # noqa: F401 - the fixture
from test_store_readonly import SMALL, Writer, writers  # noqa: F401 - the fixture

from equeue import MessageStore, PullResult, StoreConfig
from equeue.atomicfile import read_json, write_json
from equeue.cli import main
from equeue.errors import ChunkRemovedError, ClosedError, InvalidMessageError
from equeue.format.chunk import MIN_CHUNK_DATA_SIZE
from equeue.store import follow
from equeue.store.meta import QUEUES_DIR, TOPICS_FILE


def verify(path: Path) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["verify", str(path)])
    return code, out.getvalue() + err.getvalue()


@pytest.fixture
def small_store(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    with MessageStore.open(path) as store:
        store.create_topic("t", 1)
        for i in range(5):
            store.send("t", b"m%d" % i)
    return path


# --- crafted queue directories: the inspector checks them as the store does -------------


def test_control_verify_is_clean(small_store: Path) -> None:
    code, output = verify(small_store)
    assert code == 0, output


@pytest.mark.parametrize("name", ["²", "99999999", "007"])
def test_verify_reports_and_skips_a_directory_that_is_no_queue(
    small_store: Path, name: str
) -> None:
    # "²".isdigit() but int() refuses it (was a traceback); 99999999 made verify walk
    # 10**8 queues (was a hang); "007" names queue 7 in no way the store writes.
    bad = small_store / QUEUES_DIR / "t" / name
    bad.mkdir()
    code, output = verify(small_store)
    assert code == 1, output
    assert str(bad) in output and "not a queue id" in output, output
    assert "Traceback" not in output
    with MessageStore.open(small_store, read_only=True) as store:  # the store skips it too
        assert store.queue_ids("t") == [0]
        assert len(store.pull("t", 0, 0).messages) == 5


# --- a read-only handle's reads after the writer's retention ------------------------------


def test_reader_reports_messages_the_writers_retention_removed(tmp_path: Path) -> None:
    path = tmp_path / "store"
    config = StoreConfig(
        chunk_data_size=MIN_CHUNK_DATA_SIZE,
        queue_chunk_records=342,
        flush="os",
        max_store_bytes=3 * MIN_CHUNK_DATA_SIZE + 8192,
    )
    with (
        MessageStore.open(path, config) as writer,
        MessageStore.open(path, read_only=True) as reader,
    ):
        writer.create_topic("t", 1)
        sent = [writer.send("t", b"a" * 100, key=f"k{i % 3}") for i in range(300)]
        writer.flush()
        reader.refresh()
        first = sent[0]
        assert reader.read(first.position).body == b"a" * 100  # maps the first chunk
        assert len(reader.query_by_key("t", "k0", 1000)) == 100
        assert writer.apply_retention() > 0
        retained_from = writer.queue_range("t", 0)[0]
        assert retained_from > 0
        time.sleep(2 * follow._LOOK_EVERY)  # reads look for removed chunks that often
        with pytest.raises(ChunkRemovedError):
            reader.read(first.position)
        with pytest.raises(ChunkRemovedError):
            reader.get(first.message_id)
        # control: a retained message still reads, by position and by id
        kept = sent[-1]
        assert reader.read(kept.position).queue_offset == kept.queue_offset
        assert reader.get(kept.message_id).position == kept.position
        keyed = reader.query_by_key("t", "k0", 1000)
        assert keyed and all(m.queue_offset >= retained_from for m in keyed)
        assert [m.position for m in keyed] == [
            m.position for m in writer.query_by_key("t", "k0", 1000)
        ]
        assert reader.offset_for_time("t", 0, 0) == retained_from
        assert writer.offset_for_time("t", 0, 0) == retained_from


def test_reader_reports_removed_messages_of_a_writer_process(
    tmp_path: Path,
    writers: list[Writer],  # noqa: F811 - the fixture
) -> None:
    path = tmp_path / "s"
    writer = Writer(path, **SMALL, max_store_bytes=12 * MIN_CHUNK_DATA_SIZE, flush="async")
    writers.append(writer)
    writer("send t 0 60 -")
    writer("flush")
    with MessageStore.open(path, read_only=True) as reader:
        old = reader.pull("t", 0, 0, max_count=100).messages  # maps their chunks
        assert len(old) == 60
        first = writer("run 20")["t/0"][0]  # sends and applies retention
        assert first > 60
        time.sleep(2 * follow._LOOK_EVERY)
        for message in (old[0], old[-1]):  # no refresh() nor pull() in between
            with pytest.raises(ChunkRemovedError):
                reader.get(message.message_id)
        assert reader.offset_for_time("t", 0, 0) == first
        (kept,) = reader.pull("t", 0, first, max_count=1).messages  # control
        assert reader.get(kept.message_id) == kept
    writer.close()


# --- topics.json whose checksummed body is not an object ----------------------------------


def test_topics_json_that_is_not_an_object_is_moved_aside_and_rebuilt(small_store: Path) -> None:
    path = small_store / TOPICS_FILE
    write_json(path, ["t"])  # a valid checksum: not written by equeue
    code, output = verify(small_store)
    assert code == 1 and str(path) in output, output
    with MessageStore.open(small_store, read_only=True) as store:  # reports, changes nothing
        assert store.topics() == ["t"]
        assert any(str(path) in p and "list" in p for p in store.recovery.problems)
    assert read_json(path) == ["t"]
    with MessageStore.open(small_store) as store:
        assert store.topics() == ["t"]
        assert len(store.pull("t", 0, 0).messages) == 5
        (problem,) = [p for p in store.recovery.problems if "list, not an object of topics" in p]
        assert "moved to" in problem
    (moved,) = (small_store / "recovered").glob("topics.json.*.damaged")
    assert read_json(moved) == ["t"]  # kept, not overwritten
    assert isinstance(read_json(path), dict)
    assert verify(small_store)[0] == 0
    with MessageStore.open(small_store) as store:  # reported once
        assert store.recovery.problems == []


def test_control_intact_topics_json_is_not_moved(small_store: Path) -> None:
    with MessageStore.open(small_store) as store:
        assert store.recovery.problems == []
        assert store.topics() == ["t"]
    assert not (small_store / "recovered").exists()


# --- pull(wait) across close(), and max_count --------------------------------------------


def _pull_in_thread(store: MessageStore, offset: int) -> tuple[threading.Thread, list[object]]:
    result: list[object] = []

    def run() -> None:
        try:
            result.append(store.pull("t", 0, offset, wait=30.0))
        except Exception as exc:
            result.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


@pytest.mark.parametrize("read_only", [False, True])
def test_pull_waiting_when_the_store_closes_raises_closed(
    small_store: Path, read_only: bool
) -> None:
    with MessageStore.open(small_store) as writer:
        store = writer if not read_only else MessageStore.open(small_store, read_only=True)
        thread, result = _pull_in_thread(store, 5)
        time.sleep(0.2)  # (not asserted: the pull is waiting, or it will find it closed)
        store.close()
        thread.join(30)
        assert not thread.is_alive()
        (found,) = result
        assert isinstance(found, ClosedError), found
        assert str(small_store) in str(found)


@pytest.mark.parametrize("read_only", [False, True])
def test_control_pull_waiting_gets_the_next_message(small_store: Path, read_only: bool) -> None:
    with MessageStore.open(small_store) as writer:
        store = writer if not read_only else MessageStore.open(small_store, read_only=True)
        thread, result = _pull_in_thread(store, 5)
        time.sleep(0.2)
        writer.send("t", b"late")
        writer.flush()
        thread.join(30)
        (found,) = result
        assert isinstance(found, PullResult), found
        assert [m.body for m in found.messages] == [b"late"] and found.next_offset == 6
        if read_only:
            store.close()


@pytest.mark.usefixtures("code_path")
@pytest.mark.parametrize("max_count", [True, False])
def test_pull_refuses_a_bool_max_count(small_store: Path, max_count: bool) -> None:
    with MessageStore.open(small_store) as store:
        with pytest.raises(InvalidMessageError, match="max_count"):
            store.pull("t", 0, 0, max_count=max_count)
        assert [m.body for m in store.pull("t", 0, 0, max_count=1).messages] == [b"m0"]


@pytest.mark.parametrize("tags", [None, ["wanted"]])
def test_pull_waits_once_for_its_whole_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tags: list[str] | None
) -> None:
    """pull(wait=W) with nothing arriving waited W in its first pull, then W again from a
    fresh deadline for a matching message: 2W in all. One deadline serves both now."""
    from equeue.store import pulling

    waits: list[float] = []
    real = pulling._wait_for

    def recording(store: MessageStore, queue: Any, offset: int, timeout: float) -> None:
        waits.append(timeout)
        real(store, queue, offset, timeout)

    monkeypatch.setattr(pulling, "_wait_for", recording)
    with MessageStore.open(tmp_path / "s") as store:
        store.create_topic("t", 1)
        assert len(store.pull("t", 0, 0, tags=tags, wait=0.2)) == 0
    assert waits and sum(waits) <= 0.2 + 1e-6, waits


# --- file names from a listing: only the names chunk_file_name() writes -------------------

ARABIC_INDIC = "".join(chr(0x0660 + int(d)) for d in "000000000000")
FULLWIDTH_ONE = "".join(chr(0xFF10 + int(d)) for d in "0001")


@pytest.mark.parametrize(
    "name",
    [
        f"chunk-{ARABIC_INDIC}.0001",  # \d matched it and int() read chunk 0, version 1
        f"chunk-000000000000.{FULLWIDTH_ONE}",
        "chunk-000000000000.0001\n",  # "$" matched before the newline
    ],
)
def test_a_chunk_name_with_other_digits_or_a_newline_is_ignored(
    small_store: Path, name: str
) -> None:
    # Ignored like any other name the store never writes (it holds none of the store's
    # data), not reported: before, it was taken for version 1 of chunk 0, outranked the
    # real file, and every open failed on its header.
    junk = b"not a chunk file" * 16
    directories = [small_store / "messages", small_store / QUEUES_DIR / "t" / "0"]
    for directory in directories:
        (directory / name).write_bytes(junk)
    with MessageStore.open(small_store) as store:
        assert [m.body for m in store.pull("t", 0, 0).messages] == [b"m%d" % i for i in range(5)]
        store.send("t", b"m5")
    with MessageStore.open(small_store, read_only=True) as store:
        assert len(store.pull("t", 0, 0).messages) == 6
    code, output = verify(small_store)
    assert code == 0, output
    for directory in directories:  # not the store's: left as it was
        assert (directory / name).read_bytes() == junk
