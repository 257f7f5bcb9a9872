"""A store directory someone else has been at: symbolic links planted inside it, files
and directories swapped for their opposite, metadata with a valid checksum but crafted
names or a newer format. Each must be refused with an equeue error naming the path,
by read-write and read-only opens and by ``equeue verify`` / ``inspect``, and nothing
outside the store may change (issue 20, items 10-12)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
from store_helpers import snapshot, tree

from equeue import MessageStore, StoreConfig
from equeue.atomicfile import write_json
from equeue.cli import main
from equeue.errors import (
    ConfigError,
    CorruptionError,
    EQueueError,
    NewerFormatError,
    StorePathError,
)
from equeue.format.chunk import FOOTER_SIZE, HEADER_SIZE, ChunkHeader
from equeue.format.livetail import LIVE_TAIL_FILE

CONFIG = StoreConfig(chunk_data_size=4096, queue_chunk_records=400, default_queue_count=2)
MESSAGES = 600
PAST = 1_000_000_000_000_000_000  # an mtime (ns) no write can leave behind

# Every file and directory of the built store, as the store names them. "first chunk",
# "last chunk" and "queue chunk" stand for files whose names depend on the build.
FILES = [
    "store.json",
    "topics.json",
    "offsets.json",
    "checkpoint.json",
    "LOCK",
    LIVE_TAIL_FILE,
    "keys.sqlite",
    "messages/<first chunk>",
    "messages/<last chunk>",
    "queues/t/0/<queue chunk>",
]
DIRS = [
    "messages",
    "queues",
    "queues/t",
    "queues/t/0",
    "recovered",
    "compaction",
    "messages/recovered",
    "queues/t/0/recovered",
]


def _build(path: Path) -> None:
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t", 2)
        for i in range(MESSAGES):
            store.send("t", f"message {i}".encode() * 8, key=f"k{i % 7}", queue_id=i % 2)
        store.commit_offset("g", "t", 0, 5)
        store.apply_retention()  # creates compaction/ (its commit lock)
    for name in DIRS:  # the side directories recovery makes when it cuts something
        (path / name).mkdir(exist_ok=True)
    assert (path / LIVE_TAIL_FILE).exists() and (path / "keys.sqlite").exists()
    assert len(_chunks(path / "messages")) >= 3 and len(_chunks(path / "queues/t/0")) >= 1


def _chunks(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("chunk-"))


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hostile") / "store"
    _build(path)
    return path


@pytest.fixture
def store(built: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "store"
    shutil.copytree(built, copy, symlinks=True)
    return copy


def _resolve(store: Path, name: str) -> Path:
    parent, _, leaf = name.rpartition("/")
    directory = store / parent if parent else store
    if leaf == "<first chunk>" or leaf == "<queue chunk>":
        leaf = _chunks(directory)[0]
    elif leaf == "<last chunk>":
        leaf = _chunks(directory)[-1]
    return directory / leaf


def _plant_link(store: Path, name: str, outside: Path) -> tuple[Path, Path]:
    """Move the store's ``name`` to ``outside`` and leave a link to it in its place;
    every mtime out there is set to PAST, so that any write there shows."""
    path = _resolve(store, name)
    outside.mkdir()
    target = outside / path.name
    os.rename(path, target)
    os.symlink(target, path)
    for entry in [target, *(target.rglob("*") if target.is_dir() else [])]:
        os.utime(entry, ns=(PAST, PAST))
    return path, target


def _try_open(store: Path, read_only: bool) -> EQueueError | None:
    """Open, and if that works, send (writable) and pull: what a user does next."""
    try:
        with MessageStore.open(store, read_only=read_only) as opened:
            if not read_only:
                opened.send("t", b"one more", key="k", queue_id=0)
            opened.pull("t", 0, 0)
    except EQueueError as exc:
        return exc
    return None


def _open_refused(store: Path, read_only: bool, path: Path) -> StorePathError:
    with pytest.raises(StorePathError) as info:
        MessageStore.open(store, read_only=read_only).close()
    assert str(path) in str(info.value), info.value
    assert info.value.file == str(path)
    return info.value


def _cli_refuses(capsys: pytest.CaptureFixture[str], store: Path, path: Path) -> None:
    for command in ("verify", "inspect"):
        code = main([command, str(store)])
        out, err = capsys.readouterr()
        assert code != 0, (command, out)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert str(path) in err, (command, err)


# --- the control ------------------------------------------------------------------------


def test_control_the_built_store_opens_and_verifies(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for read_only in (False, True):
        with MessageStore.open(store, read_only=read_only) as opened:
            assert opened.queue_range("t", 0) == (0, MESSAGES // 2)
            assert [m.key for m in opened.query_by_key("t", "k3", limit=1)] == ["k3"]
            assert not opened.recovery.problems and not opened.recovery.cuts
    assert main(["verify", str(store)]) == 0
    assert main(["inspect", str(store)]) == 0
    capsys.readouterr()


def test_control_the_store_root_may_be_a_link(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The root is the caller's choice (/var/lib/x -> /data/x): only links inside are refused."""
    link = tmp_path / "link"
    os.symlink(store, link)
    for read_only in (False, True):
        with MessageStore.open(link, read_only=read_only) as opened:
            assert opened.queue_range("t", 1) == (0, MESSAGES // 2)
    assert main(["verify", str(link)]) == 0
    capsys.readouterr()


# --- item 10: symbolic links ------------------------------------------------------------


@pytest.mark.parametrize("name", FILES + DIRS)
def test_a_planted_link_is_refused_and_nothing_outside_changes(
    store: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    path, target = _plant_link(store, name, tmp_path / "outside")
    before = tree(tmp_path / "outside")
    inside = snapshot(store)
    errors = [_try_open(store, read_only) for read_only in (False, True)]
    assert tree(tmp_path / "outside") == before  # the harm a followed link does
    for error in errors:
        assert isinstance(error, StorePathError), error
        assert error.file == str(path) and str(path) in str(error)
    _cli_refuses(capsys, store, path)
    assert tree(tmp_path / "outside") == before
    assert snapshot(store) == inside
    assert path.is_symlink() and os.readlink(path) == str(target)


@pytest.mark.parametrize("name", ["keys.sqlite-wal", "keys.sqlite-shm", "keys.sqlite-journal"])
def test_a_link_where_sqlite_keeps_its_side_files_is_refused(
    store: Path, tmp_path: Path, name: str
) -> None:
    """SQLite opens (and writes) these beside keys.sqlite by name, following links."""
    outside = tmp_path / "outside"
    outside.mkdir()
    sentinel = outside / "sentinel"
    sentinel.write_bytes(b"not yours" * 100)
    os.utime(sentinel, ns=(PAST, PAST))
    os.symlink(sentinel, store / name)
    before = tree(outside)
    errors = [_try_open(store, read_only) for read_only in (False, True)]
    assert tree(outside) == before
    for error in errors:
        assert isinstance(error, StorePathError) and error.file == str(store / name), error


def test_a_linked_compaction_staging_dir_is_refused(store: Path, tmp_path: Path) -> None:
    """A writable open rolls committed staging directories forward (renaming their files
    into messages/) and deletes the others: never one reached through a link."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "sentinel").write_bytes(b"keep me")
    link = store / "compaction" / "20260101T000000-0badf00d"
    os.symlink(outside, link)
    before = tree(outside)
    error = _try_open(store, False)
    assert tree(outside) == before
    assert isinstance(error, StorePathError) and error.file == str(link), error


def test_a_linked_recovered_dir_receives_no_cut(store: Path, tmp_path: Path) -> None:
    """Recovery copies what it cuts to messages/recovered/: through a link, that copy
    landed outside the store."""
    last = _resolve(store, "messages/<last chunk>")
    with open(last, "r+b") as f:  # garbage just past the ongoing chunk's records
        data = f.read()
        end = len(data.rstrip(b"\0"))
        assert HEADER_SIZE < end < len(data) - FOOTER_SIZE - 8
        f.seek(end + 8)  # past the last record's length suffix, whatever zeros end it
        f.write(b"\xaa" * 8)
    shutil.rmtree(store / "messages/recovered")
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, store / "messages/recovered")
    _open_refused(store, False, store / "messages/recovered")
    assert list(outside.iterdir()) == []
    # Control: the real directory gets the cut, and the open reports it.
    (store / "messages/recovered").unlink()
    with MessageStore.open(store) as opened:
        assert [c.file for c in opened.recovery.cuts] == [str(last)]
    assert len(list((store / "messages/recovered").iterdir())) == 1


# --- item 10: crafted topics.json ---------------------------------------------------------


ABSOLUTE = "<an absolute path>"  # under the test's tmp_path, outside the store
CRAFTED: list[tuple[str, object]] = [
    *[(n, {"queue_count": 1}) for n in ("../../x", "../x", ABSOLUTE, "a/b", ".", "..", "")],
    *[(n, {"queue_count": 1}) for n in ("n" * 300, "sp ace", "é")],
    *[("t2", {"queue_count": count}) for count in (100_000, 2000, 0, -1, "3", True, None)],
    ("t2", {"queue_count": 1, "cleanup": "bogus"}),
    ("t2", {"queue_count": 1, "retention_seconds": -5}),
    ("t2", {"queue_count": 1, "retention_seconds": "ten"}),  # 1e300: clamped (item 13)
    ("t2", "not an object"),
]


def _outside(tmp_path: Path, store: Path) -> set[Path]:
    return {p for p in tmp_path.rglob("*") if store not in p.parents and p != store}


@pytest.mark.parametrize(
    ("topic", "info"), CRAFTED, ids=[f"{t[:12]!r}-{str(i)[:24]}" for t, i in CRAFTED]
)
def test_a_crafted_topics_entry_is_refused_and_creates_nothing(
    store: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    topic: str,
    info: object,
) -> None:
    if topic == ABSOLUTE:
        topic = str(tmp_path / "abs")
    topics = json.loads((store / "topics.json").read_bytes())["body"]
    write_json(store / "topics.json", topics | {topic: info})  # a valid checksum
    outside = _outside(tmp_path, store)
    inside = snapshot(store)
    errors = [_try_open(store, read_only) for read_only in (False, True)]
    assert _outside(tmp_path, store) == outside
    for error in errors:
        assert isinstance(error, CorruptionError), error
        assert str(store / "topics.json") in str(error) and "bad topic entry" in str(error)
    assert snapshot(store) == inside
    assert main(["verify", str(store)]) == 1  # reported, and its name never followed
    assert "bad topic entry" in capsys.readouterr().out
    assert _outside(tmp_path, store) == outside


def test_control_a_valid_topics_entry_still_opens(store: Path) -> None:
    topics = json.loads((store / "topics.json").read_bytes())["body"]
    write_json(store / "topics.json", topics | {"t2": {"queue_count": 1024}})
    with MessageStore.open(store) as opened:
        assert opened.queue_ids("t2") == list(range(1024))


BAD_OFFSETS: list[object] = [
    [],
    {"": {"t": {"0": 1}}},
    {"g" * 256: {"t": {"0": 1}}},
    {"g": {"../x": {"0": 1}}},
    {"g": {"t": {"x": 1}}},
    {"g": {"t": {"-1": 1}}},
    {"g": {"t": {"5000": 1}}},
    {"g": {"t": {"0": -1}}},
    {"g": {"t": {"0": "1"}}},
    {"g": {"t": {"0": True}}},
    {"g": {"t": 5}},
    {"g": {"t": {"0": 1 << 63}}},  # past an int64: no wire nor queue position holds it
    {"g": {"t": {"0": 1 << 70}}},
]


@pytest.mark.parametrize("body", BAD_OFFSETS, ids=[str(b)[:40] for b in BAD_OFFSETS])
def test_a_crafted_offsets_entry_is_refused(store: Path, body: object) -> None:
    """Before, these opened, and consumer_groups() raised a raw ValueError or handed out
    what commit_offset() would have refused."""
    write_json(store / "offsets.json", body)
    inside = snapshot(store)
    for read_only in (False, True):
        error = _try_open(store, read_only)
        assert isinstance(error, CorruptionError), error
        assert str(store / "offsets.json") in str(error) and "bad consumer offsets" in str(error)
    assert snapshot(store) == inside


@pytest.mark.parametrize("body", BAD_OFFSETS, ids=[str(b)[:40] for b in BAD_OFFSETS])
def test_verify_reports_an_offsets_entry_the_open_refuses(
    store: Path, body: object, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, verify exited 0 ("No problems found") on an offsets.json whose entry
    refused every open, though the refusal told the operator to run verify (review 37a A8)."""
    write_json(store / "offsets.json", body)
    assert main(["verify", str(store)]) == 1
    out = capsys.readouterr().out
    assert str(store / "offsets.json") in out and "bad consumer offsets" in out, out


def test_control_valid_offsets_still_open(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_json(store / "offsets.json", {"g": {"t": {"0": 5, "1": 0}}, "h": {"x": {"1023": 7}}})
    with MessageStore.open(store, read_only=True) as opened:
        assert opened.consumer_groups() == {"g": {"t": {0: 5, 1: 0}}, "h": {"x": {1023: 7}}}
    write_json(store / "offsets.json", {"g": {"t": {"0": (1 << 63) - 1}}})  # the bound
    with MessageStore.open(store, read_only=True) as opened:
        assert opened.consumer_groups() == {"g": {"t": {0: (1 << 63) - 1}}}
    # Read as any offset; past t/0's end (300), verify names it (the offset a power cut
    # leaves, equeue/inspect/offsetends.py) and the writable open sets it to the end.
    assert main(["verify", str(store)]) == 1
    out = capsys.readouterr().out
    assert f"committed offset {(1 << 63) - 1} on t/0, past the queue's end 300" in out, out
    with MessageStore.open(store) as opened:
        assert opened.consumer_groups() == {"g": {"t": {0: 300}}}
    assert main(["verify", str(store)]) == 0, capsys.readouterr().out


# --- item 11: versions -------------------------------------------------------------------


def test_a_newer_store_format_is_refused_and_nothing_written(
    store: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    identity = json.loads((store / "store.json").read_bytes())["body"]
    write_json(store / "store.json", identity | {"format": 2})
    inside = snapshot(store)
    for read_only in (False, True):
        with pytest.raises(NewerFormatError) as raised:  # (a ConfigError, as before)
            MessageStore.open(store, read_only=read_only).close()
        assert isinstance(raised.value, ConfigError)
        message = str(raised.value)
        assert str(store / "store.json") in message
        assert "store format 2" in message and "reads format 1" in message
    assert snapshot(store) == inside
    assert main(["verify", str(store)]) == 1
    err = capsys.readouterr().err
    assert "store format 2" in err and "Traceback" not in err
    # Control: the format this library writes opens.
    write_json(store / "store.json", identity)
    MessageStore.open(store).close()


@pytest.mark.parametrize("lock", ["kept", "missing"])
def test_a_newer_store_format_leaves_lock_as_it_was(store: Path, lock: str) -> None:
    """The refusal says "nothing was changed": LOCK too (its pid and mtime, or its absence)."""
    identity = json.loads((store / "store.json").read_bytes())["body"]
    write_json(store / "store.json", identity | {"format": 2})
    path = store / "LOCK"
    if lock == "missing":
        path.unlink()
    else:
        path.write_text("12345")
        os.utime(path, ns=(PAST, PAST))
    with pytest.raises(ConfigError, match="store format 2"):
        MessageStore.open(store)
    if lock == "missing":
        assert not os.path.lexists(path)
    else:
        assert path.read_text() == "12345" and path.stat().st_mtime_ns == PAST
    # Control: the format this library writes opens, and the writer's pid is in LOCK.
    write_json(store / "store.json", identity)
    with MessageStore.open(store):
        assert path.read_text() == str(os.getpid())


def test_store_json_without_its_fields_is_an_equeue_error(store: Path) -> None:
    identity = json.loads((store / "store.json").read_bytes())["body"]
    missing = {k: v for k, v in identity.items() if k != "store_id"}
    bodies: list[object] = [missing, [], identity | {"chunk_data_size": "4096"}]
    for body in bodies:
        write_json(store / "store.json", body)
        with pytest.raises(CorruptionError, match=r"store\.json"):
            MessageStore.open(store).close()


def test_a_newer_chunk_format_is_refused_naming_both_versions(store: Path) -> None:
    first = _resolve(store, "messages/<first chunk>")
    raw = first.read_bytes()
    header = ChunkHeader.unpack(raw[:HEADER_SIZE], file=str(first))
    newer = dataclasses.replace(header, version=2)  # packed with a valid header checksum
    first.write_bytes(newer.pack() + raw[HEADER_SIZE:])
    inside = snapshot(store)
    for read_only in (False, True):
        with pytest.raises(NewerFormatError) as raised:  # (not damage: nothing set aside)
            MessageStore.open(store, read_only=read_only).close()
        message = str(raised.value)
        assert str(first) in message and "written by a newer equeue" in message
        assert "chunk format version 2" in message and "reads version 1" in message
    assert snapshot(store) == inside


# --- item 12: a file or directory replaced by its opposite ----------------------------------


@pytest.mark.parametrize("name", FILES + DIRS)
def test_a_path_of_the_wrong_kind_is_named(
    store: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    path = _resolve(store, name)
    if path.is_dir():
        shutil.rmtree(path)
        path.write_bytes(b"not a directory")
    else:
        path.unlink()
        path.mkdir()
        (path / "inside").write_bytes(b"x")
    inside = snapshot(store)
    for read_only in (False, True):
        error = _open_refused(store, read_only, path)
        assert isinstance(error, EQueueError)
    _cli_refuses(capsys, store, path)
    assert snapshot(store) == inside
