"""The next chunk made ahead (equeue/chunks/ahead.py): a roll-over installs it; a file
made ahead and not installed is never data, whatever a crash or a hostile hand leaves
under its name; under flush="sync" the new chunk's name is durable before its first
acknowledged send."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from ahead_kill_child import STEPS, body, config
from power_loss_model import Damage, DiskImage, materialize, recording
from store_helpers import SETTLE_TIMEOUT, settle_chunk_maker

import equeue.chunks.ahead
import equeue.chunks.completion
import equeue.chunks.fileops
import equeue.chunks.manager
import equeue.store.store
from equeue import MessageStore
from equeue.chunks.ahead import AheadFile, is_ahead_name
from equeue.chunks.chunk import Chunk
from equeue.chunks.config import ChunkManagerConfig
from equeue.chunks.manager import ChunkManager
from equeue.chunks.reader import ChunkReader
from equeue.chunks.writer import ChunkWriter
from equeue.errors import (
    CorruptionError,
    DiskFullError,
    EQueueError,
    StoreLockedError,
    StorePathError,
    StoreWriteError,
)
from equeue.format.chunk import HEADER_SIZE, MIN_CHUNK_DATA_SIZE, chunk_file_name
from equeue.format.message import STORED_TIME_OFFSET
from equeue.format.topicsjournal import TOPICS_JOURNAL_FILE
from equeue.store.flush import log_synced

CHILD = Path(__file__).with_name("ahead_kill_child.py")
RECORD = b"r" * 200  # 19 a 4 KiB chunk


def made_ahead(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if is_ahead_name(name))


def wait_made_ahead(manager: ChunkManager) -> Path:
    """The file made ahead for the next roll-over, once the chunk maker has made it."""
    end = time.monotonic() + SETTLE_TIMEOUT
    while time.monotonic() < end:
        with manager._ahead_cond:
            if manager._ahead is not None:
                return manager._ahead.path
        time.sleep(0.002)
    raise AssertionError(
        f"no chunk file was made ahead in {manager.directory} within {SETTLE_TIMEOUT} s"
    )


def roll_over(writer: ChunkWriter) -> int:
    """Write until a new chunk starts; its number."""
    first = writer.manager.last_chunk
    for _ in range(100):
        writer.write(RECORD)
        last = writer.manager.last_chunk
        if last is not first:
            assert last is not None
            return last.start_number
    raise AssertionError("100 records did not fill a chunk")


@pytest.fixture
def log_dir(tmp_path: Path) -> Iterator[tuple[ChunkManager, ChunkWriter]]:
    manager = ChunkManager(
        tmp_path / "log", ChunkManagerConfig(chunk_data_size=MIN_CHUNK_DATA_SIZE, make_ahead=True)
    )
    writer = ChunkWriter(manager)
    yield manager, writer
    manager.close()


def test_a_roll_over_installs_the_file_made_ahead_and_close_deletes_it(
    log_dir: tuple[ChunkManager, ChunkWriter],
) -> None:
    manager, writer = log_dir
    writer.write(RECORD)  # the first chunk, then its successor made ahead
    for _ in range(5):
        ahead = wait_made_ahead(manager)
        assert made_ahead(manager.directory) == [ahead.name]  # one per directory at most
        inode = os.stat(ahead).st_ino
        number = roll_over(writer)
        installed = manager.directory / chunk_file_name(number)
        assert os.stat(installed).st_ino == inode
        assert not ahead.exists()
    wait_made_ahead(manager)
    manager.close()
    assert made_ahead(manager.directory) == []
    reopened = ChunkManager(manager.directory, manager.config, read_only=True)
    assert [c.start_number for c in reopened] == list(range(6))
    assert [record for _, record in ChunkReader(reopened).iter_from(0)] == [RECORD] * 96
    reopened.close()


@pytest.mark.parametrize("hostile", ["symlink", "directory", "short", "garbage header"])
def test_a_hostile_entry_under_the_made_ahead_name_is_not_installed(
    log_dir: tuple[ChunkManager, ChunkWriter],
    tmp_path: Path,
    hostile: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    manager, writer = log_dir
    first = writer.write(RECORD)
    ahead = wait_made_ahead(manager)
    outside = tmp_path / "outside"
    outside.write_bytes(ahead.read_bytes())  # a file that passes every check but the inode
    before = outside.read_bytes()
    ahead.unlink()
    if hostile == "symlink":
        ahead.symlink_to(outside)
    elif hostile == "directory":
        ahead.mkdir()
    elif hostile == "short":
        ahead.write_bytes(before[: len(before) // 2])
    else:
        ahead.write_bytes(b"\xff" * HEADER_SIZE + before[HEADER_SIZE:])
    with caplog.at_level(logging.WARNING, logger="equeue.chunks"):
        number = roll_over(writer)
    assert f"not installing the chunk file made ahead {ahead}" in caplog.text
    installed = manager.directory / chunk_file_name(number)
    assert installed.is_file() and not installed.is_symlink()
    assert outside.read_bytes() == before  # nothing written through the link
    position = writer.write(b"after")
    writer.flush()
    reader = ChunkReader(manager)
    assert (reader.read(first), reader.read(position)) == (RECORD, b"after")
    if hostile == "directory":
        assert ahead.is_dir()  # left: the next writable open refuses it, as any temp dir
        ahead.rmdir()
    else:
        assert not os.path.lexists(ahead)


def _spawn(store: Path, step: str, hold: bool) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(CHILD.parent), *sys.path]))
    return subprocess.Popen(
        [sys.executable, str(CHILD), str(store), step, *(["hold"] if hold else [])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _run_until_step_then_kill(store: Path, step: str, after: int) -> dict[int, int]:
    """The acknowledged sends (seq -> position) of a child SIGKILLed ``after`` sends past
    ``step``; the store's files are checked while the child is paused there first."""
    child = _spawn(store, step, hold=after == 0)  # 0: killed in the step's own state
    acked: dict[int, int] = {}
    reached = None
    try:
        assert child.stdout is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = child.stdout.readline()
            if not line:
                break
            if line.startswith("STEP"):
                reached = len(acked)
                # A reader in another process than the writer, beside it
                with MessageStore.open(store, config(), read_only=True) as reader:
                    for seq, position in acked.items():
                        assert reader.read(position).body == body(seq)
            elif line.startswith("A "):
                _, sent, at = line.split()
                acked[int(sent)] = int(at)
            if reached is not None and len(acked) >= reached + after:
                break
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
    assert reached is not None, (
        f"the child never reached {step}: {child.stderr.read() if child.stderr else ''}"
    )
    return acked


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "equeue", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("after", [0, 15])
def test_sigkill_at_each_step_of_making_ahead_leaves_no_data_and_no_damage(
    tmp_path: Path, step: str, after: int, caplog: pytest.LogCaptureFixture
) -> None:
    store = tmp_path / "store"
    acked = _run_until_step_then_kill(store, step, after)
    messages = store / "messages"
    leftovers = made_ahead(messages)
    if step in ("creating", "ready") and after == 0:
        assert leftovers, "the kill was to leave a file made ahead behind"
    # The inspector neither counts nor complains about it
    verify = _cli("verify", str(store))
    assert verify.returncode == 0, verify.stdout + verify.stderr
    inspect = _cli("inspect", str(store))
    assert inspect.returncode == 0, inspect.stdout + inspect.stderr
    for name in leftovers:
        assert name not in inspect.stdout
    records = _cli("records", str(store))
    assert records.returncode == 0, records.stderr
    assert len(records.stdout.splitlines()) >= len(acked)
    # A read-only open ignores it and changes nothing
    with MessageStore.open(store, config(), read_only=True) as reader:
        for seq, position in acked.items():
            assert reader.read(position).body == body(seq)
    assert made_ahead(messages) == leftovers
    # The writable open removes it, saying what it was; nothing is cut as damage
    with caplog.at_level(logging.WARNING):
        writer = MessageStore.open(store, config())
    try:
        assert made_ahead(messages) == [] or made_ahead(messages) != leftovers
        for name in leftovers:
            assert f"removing {messages / name}: a chunk file made ahead" in caplog.text
        assert not (messages / "recovered").exists()
        for seq, position in acked.items():
            assert writer.read(position).body == body(seq)
    finally:
        writer.close()
    assert made_ahead(messages) == []


# --- a refused open: the leftover stays until an open succeeds -----------------------


@pytest.fixture(scope="module")
def killed_with_leftover(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store whose writer was SIGKILLed with a file made ahead in messages/."""
    store = tmp_path_factory.mktemp("killed") / "store"
    _run_until_step_then_kill(store, "ready", 0)
    assert made_ahead(store / "messages"), "the kill was to leave a file made ahead behind"
    return store


def every_entry(root: Path) -> dict[str, object]:
    """Each entry under ``root`` by its kind: a file's bytes, a link's target, a directory
    (LOCK aside: a writable open writes its pid there before anything can be refused),
    read once this process's chunk maker has settled."""
    settle_chunk_maker()
    found: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        name = str(path.relative_to(root))
        if path.is_symlink():
            found[name] = ("link", os.readlink(path))
        elif path.is_dir():
            found[name] = "directory"
        elif path.name != "LOCK":
            found[name] = path.read_bytes()
    return found


@pytest.mark.parametrize("refusal", ["journal header", "queue link", "queue file", "lock held"])
def test_a_refused_open_leaves_every_file_as_it_was_the_leftover_included(
    killed_with_leftover: Path, tmp_path: Path, refusal: str
) -> None:
    """Refusals found after the message log's directory was read (and a held lock): the
    made-ahead leftover is removed only by an open that succeeds. Seen failing before the
    fix: the writable open had removed the leftover before the refusal (3 of 4 cases); and
    (the queue cases) folded the topics journal into topics.json (TopicsFile.finish_open)."""
    store = tmp_path / "store"
    shutil.copytree(killed_with_leftover, store, symlinks=True)
    queue = store / "queues" / "t" / "0"
    expected: type[EQueueError] = StorePathError
    held = None
    if refusal == "journal header":
        journal = store / TOPICS_JOURNAL_FILE
        raw = bytearray(journal.read_bytes())
        raw[0] ^= 0x10  # the magic
        journal.write_bytes(bytes(raw))
        expected = CorruptionError
    elif refusal == "queue link":
        outside = tmp_path / "outside"
        queue.rename(outside)
        queue.symlink_to(outside)
    elif refusal == "queue file":
        chunk = queue / chunk_file_name(0)
        chunk.unlink()
        chunk.mkdir()
    else:
        held = os.open(store / "LOCK", os.O_RDWR)
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a live writer holds it
        expected = StoreLockedError
    before = every_entry(store)
    leftovers = made_ahead(store / "messages")
    try:
        for read_only in (True, False):
            if read_only and held is not None:  # beside a writer: opens, changes nothing
                MessageStore.open(store, config(), read_only=True).close()
            else:
                with pytest.raises(expected):
                    MessageStore.open(store, config(), read_only=read_only).close()
            assert made_ahead(store / "messages") == leftovers
            assert every_entry(store) == before
    finally:
        if held is not None:
            os.close(held)


def test_a_chunk_directory_keeps_its_leftover_until_its_first_roll_over(
    killed_with_leftover: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A manager opened alone (no store to say its open succeeded) removes the leftover
    at its first roll-over, and makes ahead from then on."""
    directory = tmp_path / "messages"
    shutil.copytree(killed_with_leftover / "messages", directory)
    leftovers = made_ahead(directory)
    config = ChunkManagerConfig(
        chunk_data_size=4096,
        max_record_size=1024,
        timestamp_offset=STORED_TIME_OFFSET,  # as the store's log was made
        make_ahead=True,
    )
    manager = ChunkManager(directory, config)
    try:
        writer = ChunkWriter(manager)
        assert made_ahead(directory) == leftovers
        with caplog.at_level(logging.WARNING, logger="equeue.chunks"):
            roll_over(writer)
        for name in leftovers:
            assert f"removing {directory / name}: a chunk file made ahead" in caplog.text
            assert not (directory / name).exists()
        wait_made_ahead(manager)
    finally:
        manager.close()
    assert made_ahead(directory) == []


# --- power loss: the installed chunk's name ----------------------------------------


def _sends_across_two_installs(root: Path, monkeypatch: pytest.MonkeyPatch) -> Run:
    """flush="sync" sends under the power-loss model until the second roll-over that
    installed a made-ahead file; the power fails right after that send's answer."""
    installs: list[int] = []
    install = Chunk.install_made_ahead.__func__  # type: ignore[attr-defined]

    def counted(cls: type[Chunk], ahead: AheadFile, /, **kwargs: Any) -> Chunk:
        chunk: Chunk = install(cls, ahead, **kwargs)
        installs.append(chunk.start_number)
        return chunk

    monkeypatch.setattr(Chunk, "install_made_ahead", classmethod(counted))
    acked: dict[int, int] = {}
    with recording(root) as recorder:
        store = MessageStore.open(root, config())
        try:
            store.create_topic("t", 1)
            for seq in range(200):
                if len(installs) == 2:
                    break
                if store._messages.last_chunk is not None:  # (none before the first send)
                    wait_made_ahead(store._messages)
                acked[seq] = store.send("t", body(seq)).position
            image = recorder.cut()
        finally:
            closer = threading.Thread(target=lambda: suppress_all(store.close), daemon=True)
            closer.start()
            closer.join(10)
    assert len(installs) == 2, "the roll-overs did not install the files made ahead"
    return Run(acked, image)


@dataclass
class Run:
    acked: dict[int, int]
    image: DiskImage


def suppress_all(call: Callable[[], None]) -> None:
    try:
        call()
    except BaseException:  # after the power cut the store is half-way through a close
        return


def _lost_after_power_cut(tmp: Path, monkeypatch: pytest.MonkeyPatch, seed: int) -> list[int]:
    monkeypatch.setattr(equeue.store.store, "current_boot_id", uuid.uuid4)  # a reboot
    run = _sends_across_two_installs(tmp / "store", monkeypatch)
    materialize(run.image, tmp / "after", Damage(pages="mixed", entries="revert", seed=seed))
    lost = []
    with MessageStore.open(tmp / "after", config()) as store:
        for seq, position in run.acked.items():
            try:
                if store.read(position).body != body(seq):
                    lost.append(seq)
            except EQueueError:
                lost.append(seq)
    return lost


@pytest.mark.parametrize("seed", [1, 2])
def test_sync_sends_in_an_installed_chunk_survive_a_power_loss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    assert _lost_after_power_cut(tmp_path / "fsynced", monkeypatch, seed) == []


def test_the_power_loss_check_fails_without_the_directory_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same run with the installed chunk's directory fsync left out loses the sends
    in the installed chunks: the check above can fail."""
    monkeypatch.setattr(Chunk, "make_name_durable", lambda self: None)
    assert _lost_after_power_cut(tmp_path / "not-fsynced", monkeypatch, 1) != []


# --- the broker's flusher (C thread) path -----------------------------------------


def test_log_synced_makes_the_installed_chunks_name_durable_before_vouching(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C flusher fdatasyncs the chunk's descriptor alone; log_synced, on the loop,
    fsyncs the directory (or waits for the chunk maker's) before any answer leaves."""
    fsynced: list[Path] = []
    real = equeue.chunks.fileops.fsync_directory

    def recorded(directory: Path) -> None:
        fsynced.append(directory)
        real(directory)

    monkeypatch.setattr(equeue.chunks.completion, "fsync_directory", recorded)  # its import
    monkeypatch.setattr(equeue.chunks.manager, "_name_durable", lambda chunk: None)
    with MessageStore.open(tmp_path / "store", config()) as store:
        store.create_topic("t", 1)
        manager = store._messages
        store.send("t", body(0))
        wait_made_ahead(manager)
        chunk = manager.last_chunk
        seq = 1
        while manager.last_chunk is chunk:
            store.send("t", body(seq))
            seq += 1
        installed = manager.last_chunk
        assert installed is not None
        # The sends above flushed it already (Chunk.flush): it is pending again as it was
        # between the install and the first flush.
        assert not installed.name_pending and fsynced == [manager.directory]
        installed._name_renamed(True)
        fsynced.clear()
        log_synced(store, installed, installed.data_end, 0)
        assert not installed.name_pending and fsynced == [manager.directory]


def hold_the_maker(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The chunk maker waits in its allocation step until the event is set."""
    release = threading.Event()
    real = vars(equeue.chunks.ahead)["_allocate"]

    def held(fd: int, offset: int, length: int) -> bool:
        assert release.wait(10), "the test did not release the chunk maker"
        return bool(real(fd, offset, length))

    monkeypatch.setitem(vars(equeue.chunks.ahead), "_allocate", held)
    return release


def test_a_file_made_too_late_is_replaced_by_the_next_chunks(
    log_dir: tuple[ChunkManager, ChunkWriter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A roll-over that comes while the maker is still making the file creates its chunk
    itself; the maker's file, for a chunk that exists by then, gives way to the next."""
    manager, writer = log_dir
    release = hold_the_maker(monkeypatch)
    writer.write(RECORD)
    assert roll_over(writer) == 1  # made on the writer's thread: the maker is held
    release.set()
    ahead = wait_made_ahead(manager)
    assert ahead.name.startswith("ahead-000000000002.")
    assert made_ahead(manager.directory) == [ahead.name]
    inode = os.stat(ahead).st_ino
    assert roll_over(writer) == 2
    assert os.stat(manager.directory / chunk_file_name(2)).st_ino == inode


def test_a_file_finished_while_the_roll_over_creates_its_chunk_gives_way(
    log_dir: tuple[ChunkManager, ChunkWriter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The maker finishes chunk 1's file while the roll-over, which found none ready, is
    creating chunk 1 itself (the maker read the last chunk before the install): the
    install's request removes the file and asks for chunk 2's. Seen failing before the
    fix: the file for chunk 1 stayed as the one made ahead until the next roll-over, which
    then created chunk 2 on the writer's thread."""
    manager, writer = log_dir
    release = hold_the_maker(monkeypatch)
    real_create = Chunk.create.__func__  # type: ignore[attr-defined]

    def create_once_the_maker_is_done(
        cls: type[Chunk], directory: Path, header: Any, /, **kw: Any
    ) -> Chunk:
        if header.chunk_start_number == 1:
            release.set()
            end = time.monotonic() + 10
            while manager._ahead is None and time.monotonic() < end:
                time.sleep(0.002)
            assert manager._ahead is not None, "the chunk maker did not finish chunk 1's file"
        chunk: Chunk = real_create(cls, directory, header, **kw)
        return chunk

    monkeypatch.setattr(Chunk, "create", classmethod(create_once_the_maker_is_done))
    writer.write(RECORD)
    assert roll_over(writer) == 1
    ahead = wait_made_ahead(manager)
    assert ahead.name.startswith("ahead-000000000002."), ahead.name
    assert made_ahead(manager.directory) == [ahead.name]
    inode = os.stat(ahead).st_ino
    assert roll_over(writer) == 2
    assert os.stat(manager.directory / chunk_file_name(2)).st_ino == inode


def test_a_chunk_keeps_to_the_inline_attribute_limit(
    log_dir: tuple[ChunkManager, ChunkWriter],
) -> None:
    """CPython 3.11 keeps at most 30 attributes of an instance inline; past them every
    attribute read on a chunk costs more (chunkstate.py), so the state this change added
    (a pending name) lives beside the class. Checked on a chunk installed from a file made
    ahead, written, flushed and read, as the writer's and the sender's hot paths see it."""
    manager, writer = log_dir
    writer.write(RECORD)
    wait_made_ahead(manager)
    roll_over(writer)
    writer.flush()
    chunk = manager.last_chunk
    assert chunk is not None
    ChunkReader(manager).read(chunk.base)
    assert len(vars(chunk)) <= 30, sorted(vars(chunk))


# --- failures on the made-ahead path (the inline path's: tests/test_store_faults.py) ---


def test_a_full_disk_while_making_ahead_leaves_the_roll_over_to_create_its_chunk(
    log_dir: tuple[ChunkManager, ChunkWriter],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    manager, writer = log_dir

    def full(fd: int, offset: int, length: int) -> bool:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setitem(vars(equeue.chunks.ahead), "_allocate", full)
    with caplog.at_level(logging.WARNING, logger="equeue.chunks"):
        writer.write(RECORD)
        end = time.monotonic() + 10
        while "could not make chunk 1" not in caplog.text and time.monotonic() < end:
            time.sleep(0.002)
    assert "could not make chunk 1" in caplog.text and "No space left" in caplog.text
    assert made_ahead(manager.directory) == []  # the partial file was removed
    assert roll_over(writer) == 1  # made on the writer's thread, as before
    assert (manager.directory / chunk_file_name(1)).is_file()


def test_a_failed_directory_fsync_of_an_installed_chunk_fails_its_flushes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new name's fsync is part of the first fdatasync that vouches for the chunk:
    failing, it fails that flush, and (as a failed fdatasync) every later one."""
    manager = ChunkManager(
        tmp_path / "log",
        ChunkManagerConfig(chunk_data_size=MIN_CHUNK_DATA_SIZE, make_ahead=True, sync_flush=True),
    )
    writer = ChunkWriter(manager)
    try:
        writer.write(RECORD)
        wait_made_ahead(manager)
        monkeypatch.setattr(equeue.chunks.manager, "_name_durable", lambda chunk: None)

        def failing(directory: Path) -> None:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(equeue.chunks.completion, "fsync_directory", failing)
        with pytest.raises(StoreWriteError, match="Input/output error") as raised:
            for _ in range(100):
                writer.write(RECORD)
        assert not isinstance(raised.value, DiskFullError)
        installed = manager.last_chunk
        assert installed is not None and installed.start_number == 1
        with pytest.raises(StoreWriteError, match="an earlier fdatasync of it failed"):
            writer.write(RECORD)
    finally:
        with contextlib.suppress(StoreWriteError):
            manager.close()


def test_close_while_the_maker_waits_for_the_lock_behind_its_own_next_job_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A deadlock suite-core met in a parallel run (round 21; test_store_state_machine[c]
    hung for minutes): the maker finished a file for a chunk the roll-over had made, and
    waited for the manager's lock to ask for the next; a request queued a second job
    behind it on the one maker thread; close, holding the lock, waited for that second
    job, which could not start before the first returned. Here the same order is forced
    on one thread (the lock is re-entrant) and the close is bounded by a join (no fixture
    closes the manager: on a hang that close would hang too)."""
    manager = ChunkManager(
        tmp_path / "log", ChunkManagerConfig(chunk_data_size=MIN_CHUNK_DATA_SIZE, make_ahead=True)
    )
    writer = ChunkWriter(manager)
    release = hold_the_maker(monkeypatch)
    writer.write(RECORD)
    closed = threading.Event()

    def roll_over_then_request_then_close() -> None:
        with manager._lock:
            assert roll_over(writer) == 1  # made here: the maker is held on chunk 1's file
            release.set()
            wait_made_ahead(manager)  # the maker's file for chunk 1, which exists: stale
            time.sleep(0.05)  # the maker is past its finally, at the lock held here
            manager._request_ahead()  # discards the stale file, queues chunk 2's job
            with manager._ahead_cond:
                assert manager._ahead_busy
            manager.close()
        closed.set()

    closing = threading.Thread(target=roll_over_then_request_then_close, daemon=True)
    closing.start()
    closing.join(10)
    assert closed.is_set(), "close and the chunk maker wait for each other"
    assert made_ahead(manager.directory) == []
