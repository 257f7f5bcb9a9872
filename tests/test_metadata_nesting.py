"""Metadata files a hostile or broken tool wrote (review 37a A1, A3): JSON nested past the
interpreter's recursion limit, and a group file's offset past an int64. Each must take the
path a damaged file takes (reported, set aside by a writer, rebuilt where the store can),
never a builtin RecursionError, and never reach a consumer as an offset no wire holds.
The control for each: the same file filled with random bytes, a damage the store already
handled."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from equeue import MessageStore, StoreConfig
from equeue.atomicfile import read_json, write_json
from equeue.cli import main
from equeue.errors import CorruptionError, EQueueError

CONFIG = StoreConfig(chunk_data_size=4096, queue_chunk_records=400, default_queue_count=2)
GROUP_FILE = "consumers/g.json"
FILES = ["topics.json", "checkpoint.json", "offsets.json", GROUP_FILE]
DEEP = b"[" * 200_000  # json.loads raises RecursionError long before the end


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("base") / "store"
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t", 2)
        for i in range(40):
            store.send("t", f"message {i}".encode(), key=f"k{i % 3}", queue_id=i % 2)
        store.commit_offset("h", "t", 0, 4)
    (path / "consumers").mkdir(exist_ok=True)
    write_json(path / GROUP_FILE, {"group": "g", "offsets": {"t": {"0": 3}}})
    return path


def _copy(built: Path, tmp_path: Path, name: str, content: bytes) -> Path:
    store = tmp_path / "store"
    shutil.copytree(built, store)
    (store / name).write_bytes(content)
    return store


def _outcome(store: Path, read_only: bool) -> str:
    try:
        with MessageStore.open(store, read_only=read_only) as opened:
            opened.pull("t", 0, 0)
            return "opened"
    except EQueueError as exc:
        return type(exc).__name__


@pytest.mark.parametrize("name", FILES)
def test_deeply_nested_json_takes_the_damaged_file_path(
    built: Path, tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: read-only opens and every CLI command ended in a bare RecursionError, and the
    broker would not start, where random bytes in the same file were reported and handled."""
    deep = _copy(built, tmp_path / "deep", name, DEEP)
    control = _copy(built, tmp_path / "control", name, os.urandom(len(DEEP)))
    for read_only in (True, False):
        assert _outcome(deep, read_only) == _outcome(control, read_only), (name, read_only)
    for command in ("verify", "inspect"):
        codes = [main([command, str(store)]) for store in (deep, control)]
        out, err = capsys.readouterr()
        assert codes[0] == codes[1], (command, out, err)
        assert "RecursionError" not in out + err and "Traceback" not in err
    assert main(["verify", str(_copy(built, tmp_path / "deep2", name, DEEP))]) == 1
    out = capsys.readouterr().out
    assert "nested too deeply" in out, out


def test_control_the_built_store_verifies(built: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(built)]) == 0, capsys.readouterr().out
    with MessageStore.open(built, read_only=True) as opened:
        assert opened.committed_offset("g", "t", 0) == 3


@pytest.mark.parametrize("offset", [1 << 63, 1 << 70])
def test_a_group_file_offset_past_an_int64_is_a_damaged_file(
    built: Path, tmp_path: Path, offset: int, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: it passed every check; verify exited 0 and each member of the group failed
    with "cannot encode a frame body" at every poll."""
    store = tmp_path / "store"
    shutil.copytree(built, store)
    write_json(store / GROUP_FILE, {"group": "g", "offsets": {"t": {"0": offset}}})
    assert main(["verify", str(store)]) == 1
    assert str(store / GROUP_FILE) in capsys.readouterr().out
    with MessageStore.open(store, read_only=True) as opened:
        assert opened.committed_offset("g", "t", 0) is None
        assert any(GROUP_FILE in problem for problem in opened.recovery.problems)
    with MessageStore.open(store) as opened:  # a writer sets it aside, as any damaged one
        assert opened.committed_offset("g", "t", 0) is None
    assert not (store / GROUP_FILE).exists()
    assert [p.name.split(".")[0] for p in (store / "consumers/recovered").iterdir()] == ["g"]


@pytest.mark.parametrize("queue_id", ["1" * 5000, "0" * 4301, "\u00b2"])
def test_a_group_file_queue_id_past_ints_digit_limit_is_a_damaged_file(
    built: Path, tmp_path: Path, queue_id: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """review11 R11-7: int() refuses more than 4,300 digits with a builtin ValueError,
    raised outside check_offsets' EQueueError catch: verify, the read-only and the
    writable open all failed with it."""
    store = tmp_path / "store"
    shutil.copytree(built, store)
    write_json(store / GROUP_FILE, {"group": "g", "offsets": {"t": {queue_id: 1}}})
    assert main(["verify", str(store)]) == 1
    assert str(store / GROUP_FILE) in capsys.readouterr().out
    with MessageStore.open(store, read_only=True) as opened:
        assert opened.committed_offset("g", "t", 0) is None
        assert any("bad queue id" in problem for problem in opened.recovery.problems)
    with MessageStore.open(store) as opened:  # a writer sets it aside, as any damaged one
        assert opened.committed_offset("g", "t", 0) is None
    assert not (store / GROUP_FILE).exists()


HUGE = 100 << 30  # sparse: no disk, but a read of it whole asks for 100 GiB of memory


@pytest.mark.parametrize("name", ["store.json", *FILES])
def test_a_metadata_file_grown_past_any_equeue_writes_takes_the_damaged_file_path(
    built: Path, tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """review17 R17-1: a metadata file was read whole before anything looked at it: a
    100 GiB sparse one ended read-only opens, `equeue verify` and `inspect` in a builtin
    MemoryError (2 GiB took 11-23 s a command). Now its size refuses it, as any damage."""
    huge = _copy(built, tmp_path / "huge", name, (built / name).read_bytes())
    os.truncate(huge / name, HUGE)
    control = _copy(built, tmp_path / "control", name, os.urandom(4096))
    for command in ("verify", "inspect"):
        codes = [main([command, str(store)]) for store in (huge, control)]
        out, err = capsys.readouterr()
        assert codes[0] == codes[1], (command, out, err)
        assert "MemoryError" not in out + err and "Traceback" not in err
    assert main(["verify", str(huge)]) == 1
    out = capsys.readouterr().out
    assert f"is {HUGE} bytes, more than a " in out, out  # (a group file: its own bound)
    for read_only in (True, False):
        assert _outcome(huge, read_only) == _outcome(control, read_only), (name, read_only)


def test_a_store_whose_store_json_was_lost_is_damaged_not_a_usage_error(
    built: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """review17 R17-6: verify, inspect, records and the read-only open called it "not an
    equeue store" (verify: exit 2, a usage error); only the writable open named the
    damage and the remedy. Control: a directory that never held a store is still that."""
    store = tmp_path / "store"
    shutil.copytree(built, store)
    (store / "store.json").unlink()
    for command in ("verify", "inspect", "records"):
        assert main([command, str(store)]) == 1, command
        out, err = capsys.readouterr()
        assert "store.json is missing, but the directory holds a store" in out + err
        assert "restore store.json" in out + err
    for read_only in (True, False):
        with pytest.raises(CorruptionError, match=r"restore store\.json"):
            MessageStore.open(store, read_only=read_only)
    assert sorted(p.name for p in store.iterdir()) == sorted(
        p.name for p in built.iterdir() if p.name != "store.json"
    )  # nothing made, nothing moved
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["verify", str(empty)]) == 2
    assert "is not an equeue store" in capsys.readouterr().err


def test_a_topics_json_entry_no_equeue_wrote_says_the_way_out_and_it_works(
    built: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """review17 R17-8: a checksummed topics.json with an entry the API would refuse locks
    every open out (by design), but neither the error nor verify said what to do."""
    store = tmp_path / "store"
    shutil.copytree(built, store)
    with MessageStore.open(store, read_only=True) as opened:
        sent = opened.pull("t", 0, 0, max_count=100)
    body = read_json(store / "topics.json")
    write_json(store / "topics.json", {**body, "ok": {"queue_count": 99_999}})
    for read_only in (True, False):
        with pytest.raises(CorruptionError, match="bad topic entry 'ok'") as caught:
            MessageStore.open(store, read_only=read_only)
        assert "move topics.json out of the store" in str(caught.value)
    assert main(["verify", str(store)]) == 1
    assert "move topics.json out of the store" in capsys.readouterr().out
    (store / "recovered").mkdir(exist_ok=True)
    (store / "topics.json").rename(store / "recovered" / "topics.json.bad")  # the way out
    with MessageStore.open(store) as opened:
        assert opened.topics() == ["t"]
        assert opened.pull("t", 0, 0, max_count=100) == sent


def _bytes_read() -> int:
    with open("/proc/self/io") as io:  # rchar: bytes this process's read calls returned
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))


def test_an_oversized_metadata_file_is_refused_before_a_byte_of_it_is_read(
    tmp_path: Path,
) -> None:
    """review18 R18-3: the first bound read 256 MiB of the file before it refused it."""
    path = tmp_path / "topics.json"
    path.write_bytes(b"{}")
    os.truncate(path, HUGE)
    before = _bytes_read()
    with pytest.raises(CorruptionError, match=f"is {HUGE} bytes"):
        read_json(path)
    assert _bytes_read() - before < 1 << 20
