"""The broker's group commit when an fdatasync fails (review 32c): a batch whose chunk's
fdatasync failed on another caller while the C flusher's was in flight is answered with the
error, not acknowledged (F1: Linux reports a writeback error once per open file description,
so the C thread syncs a description of its own, and a success is no success once the chunk
has failed); a failed group-commit fdatasync refuses every later send, also after the
background service's next turns (F4, both flushers); the C thread blocks every signal (F2)
and a forked child frees its copy without joining a thread it does not have (F3); a store
subclass overriding flush_log gets the Python flusher thread (F8)."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from groupcommit_helpers import pipe_fdatasync
from server_helpers import short_home

import equeue
from equeue import MessageStore, StoreConfig
from equeue.errors import StoreWriteError
from equeue.server import BrokerThread, flushers
from equeue.server.groupcommit import CrossClientCommit
from equeue.store.flush import OwnDescriptor, log_sync_target

speedups = pytest.importorskip("equeue._speedups", reason="no C accelerator")

LIMIT_S = 20.0
SMALL = StoreConfig(chunk_data_size=64 * 1024, queue_chunk_records=1024)


base = pytest.fixture(short_home, name="base")  # a short path: Unix sockets in it


class Peer:
    def __init__(self) -> None:
        self.answers: dict[int, object] = {}

    def finish(self, request_id: int, outcome: object) -> None:
        self.answers[request_id] = outcome


def _fail_next_fdatasync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The next ``os.fdatasync`` (what Chunk.flush calls, not the C thread) fails with EIO,
    as it does for the one caller the kernel reports a writeback error to."""
    real = os.fdatasync

    def fail_once(fd: int) -> None:
        monkeypatch.setattr(os, "fdatasync", real)
        raise OSError(errno.EIO, "Input/output error (from the test)")

    monkeypatch.setattr(os, "fdatasync", fail_once)


def _fill_to_rollover(store: MessageStore) -> None:
    chunk = store._writer._chunk
    assert chunk is not None
    while chunk.data_size - chunk.data_end > 3000:  # bounded: a 64 KiB chunk
        store.send("t", b"f" * 900)
    store.flush_log()


@pytest.mark.parametrize("other", ["rollover", "service"])
def test_a_batch_is_not_acknowledged_when_another_fdatasync_of_its_chunk_failed_meanwhile(
    base: Path, monkeypatch: pytest.MonkeyPatch, other: str
) -> None:
    """Send A's C fdatasync is in flight when another fdatasync of the same chunk fails
    (a rollover's complete() on the loop, or the service's _flush_log on its thread); the
    C one itself succeeds (as it may, the error having been reported to the other caller):
    A must be answered with the error, and close() must still report the failure."""
    store = MessageStore.open(base / "s", SMALL)
    store.create_topic("t", 1)
    peer = Peer()
    store.send("t", b"x")
    _fill_to_rollover(store)
    chunk = store._writer._chunk
    assert chunk is not None

    async def scenario() -> None:
        commit = CrossClientCommit(asyncio.get_running_loop(), store.flush_log, store=store)
        try:
            assert isinstance(commit._sync, flushers.CSync)
            commit.add(peer, 1, store.send("t", b"A" * 900))  # its fdatasync starts now
            _fail_next_fdatasync(monkeypatch)
            if other == "rollover":
                with pytest.raises(StoreWriteError, match="flushing a chunk failed"):
                    store.send("t", b"B" * 30000)  # does not fit: complete() fdatasyncs
            else:
                failed: list[BaseException] = []

                def service() -> None:
                    try:
                        store._flush_log(0)
                    except StoreWriteError as exc:
                        failed.append(exc)

                thread = threading.Thread(target=service)
                thread.start()
                await asyncio.to_thread(thread.join, LIMIT_S)
                assert failed
            assert chunk._failed is not None
            deadline = time.monotonic() + LIMIT_S
            while 1 not in peer.answers and time.monotonic() < deadline:
                await asyncio.sleep(0.002)
        finally:
            commit.close()

    try:
        asyncio.run(scenario())
        answer = peer.answers[1]
        assert isinstance(answer, StoreWriteError), answer
        assert "may be lost" in str(answer)
        with pytest.raises(StoreWriteError, match="refusing the send"):
            store.send("t", b"C")
    finally:
        with pytest.raises(StoreWriteError):
            store.close()  # the failed range is not claimed durable: close reports it


def test_the_c_flusher_syncs_an_open_file_description_of_its_own(base: Path) -> None:
    """Not a dup of the chunk's descriptor (that shares the kernel's once-per-description
    error report with Chunk.flush): the same file, opened read-only."""
    with MessageStore.open(base / "s", SMALL) as store:
        store.create_topic("t", 1)
        store.send("t", b"x")
        own = OwnDescriptor()
        try:
            target = log_sync_target(store, own)
            assert target is not None
            chunk, fd, _ = target
            assert fd != chunk._fd
            assert fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
            assert fcntl.fcntl(chunk._fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR
            mine, its = os.fstat(fd), os.fstat(chunk._fd)
            assert (mine.st_dev, mine.st_ino) == (its.st_dev, its.st_ino)
            store.send("t", b"y")
            again = log_sync_target(store, own)
            assert again is not None and again[1] == fd  # one open per chunk
        finally:
            own.close()


@pytest.mark.parametrize("swap", ["symlink", "other file"])
def test_a_chunk_path_swapped_under_the_store_is_not_synced_and_refuses_sends(
    base: Path, swap: str
) -> None:
    store = MessageStore.open(base / "s", SMALL)
    try:
        store.create_topic("t", 1)
        store.send("t", b"x")
        chunk = store._writer._chunk
        assert chunk is not None
        moved = base / "moved"
        os.rename(chunk.path, moved)
        if swap == "symlink":
            os.symlink(moved, chunk.path)
        else:
            shutil.copyfile(moved, chunk.path)
        own = OwnDescriptor()
        try:
            with pytest.raises(StoreWriteError, match="refused until the store is reopened"):
                log_sync_target(store, own)
        finally:
            own.close()
        with pytest.raises(StoreWriteError, match="refusing the send"):
            store.send("t", b"y")
        os.unlink(chunk.path)
        os.rename(moved, chunk.path)
    finally:
        store.close()  # the chunk itself did not fail: its close flushes it


def _thread_fdatasync(monkeypatch: pytest.MonkeyPatch) -> Callable[[], None]:
    """For the Python flusher thread (selected by a replaced os.fdatasync): arm() makes
    its next fdatasync fail with EIO (only that thread's: not the service's)."""
    real = os.fdatasync
    armed: list[int] = []

    def fdatasync(fd: int) -> None:
        if armed and threading.current_thread().name == "equeue-broker-flush":
            armed.clear()
            raise OSError(errno.EIO, "Input/output error (from the test)")
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    return lambda: armed.append(1)


@pytest.mark.parametrize("flusher", ["c", "thread"])
def test_a_failed_group_commit_keeps_refusing_sends_after_the_service_ran(
    base: Path, monkeypatch: pytest.MonkeyPatch, flusher: str
) -> None:
    opened: list[int] = []
    arm = pipe_fdatasync(monkeypatch, opened) if flusher == "c" else _thread_fdatasync(monkeypatch)
    try:
        _refusing_after_service_turns(base, flusher, arm)
    finally:
        for fd in opened:
            os.close(fd)


def _refusing_after_service_turns(base: Path, flusher: str, arm: Callable[[], None]) -> None:
    # the broker's store flushes "async": its service turns every 20 ms here
    store = MessageStore.open(base / "s", StoreConfig(flush="async", flush_interval_ms=20))
    with (
        BrokerThread(store, flush="sync", listen=[f"unix:{base}/b.sock"]) as broker,
        equeue.connect(broker.urls[0]) as client,
    ):
        sync = broker.broker.commit._sync  # type: ignore[union-attr]
        assert isinstance(sync, flushers.CSync if flusher == "c" else flushers.ThreadSync)
        client.create_topic("t", 1)
        assert client.send("t", b"one").queue_offset == 0  # the control
        arm()
        with pytest.raises(StoreWriteError, match="may be lost"):
            client.send("t", b"two")
        end = client.queue_range("t", 0)
        time.sleep(0.3)  # about 15 service turns, each skipping the log (< 16 KiB unflushed)
        for body in (b"three", b"four"):
            with pytest.raises(StoreWriteError, match="refusing the send"):
                client.send("t", body)
        assert client.queue_range("t", 0) == end  # nothing stored by the refused sends
    with pytest.raises(StoreWriteError):  # the broker leaves a store it was given open
        store.close()


def test_a_store_subclass_overriding_flush_log_gets_the_python_flusher(base: Path) -> None:
    class Mirrored(MessageStore):
        def flush_log(self) -> None:  # e.g. ships the log, then flushes it
            super().flush_log()

    with Mirrored.open(base / "s", SMALL) as store:

        async def choose() -> object:
            loop = asyncio.get_running_loop()
            sync = flushers.make_sync(loop, store.flush_log, lambda e, t: None, store)
            sync.close()
            return sync

        assert isinstance(asyncio.run(choose()), flushers.ThreadSync)


def _flusher_task_status() -> str:
    deadline = time.monotonic() + LIMIT_S
    while time.monotonic() < deadline:  # the thread names itself once it runs
        for task in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{task}/comm") as comm:
                if comm.read().strip() == "equeue-flush":
                    with open(f"/proc/self/task/{task}/status") as status:
                        return status.read()
        time.sleep(0.001)
    raise AssertionError("no equeue-flush thread")


def test_the_c_thread_blocks_every_signal() -> None:
    flusher = speedups.Flusher()
    try:
        blocked = next(
            line for line in _flusher_task_status().splitlines() if line.startswith("SigBlk:")
        )
        mask = int(blocked.split()[1], 16)
        # every signal but the two the kernel never blocks and glibc's own (32, 33)
        assert mask | (1 << 8) | (1 << 18) | (3 << 31) == 0xFFFFFFFFFFFFFFFF, blocked
        assert mask & (1 << (15 - 1)) and mask & (1 << (2 - 1)), blocked  # SIGTERM, SIGINT
    finally:
        flusher.close()


# Run in a small process of its own: its fork is fast enough to catch the parent's new
# thread holding the flusher's lock (it takes it as it starts), which a child locking it,
# or joining the thread, would wait for forever. 24 tries; a hung child is killed.
_FORK_TRIES = """
import os, sys, time
from equeue._speedups import Flusher
hung = 0
for _ in range(24):
    flusher = Flusher()
    pid = os.fork()
    if pid == 0:
        del flusher  # the child's copy: the parent's thread is not here
        os._exit(0)
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline and not os.waitpid(pid, os.WNOHANG)[0]:
        time.sleep(0.002)
    else:
        if time.monotonic() >= deadline:
            hung += 1
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    flusher.close()
print(hung)
"""


def test_a_forked_child_frees_its_copy_without_joining_the_parents_thread() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _FORK_TRIES], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0", f"{done.stdout.strip()} of 24 children hung"


def test_a_forked_child_cannot_start_a_flush_on_its_copy() -> None:
    flusher = speedups.Flusher()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            try:
                flusher.start(0)
            except RuntimeError as exc:
                code = 0 if "forked" in str(exc) else 2
        finally:
            os._exit(code)  # no finalisation: the copy is not freed here
    try:
        _, raw = os.waitpid(pid, 0)  # start() never blocks
        assert os.waitstatus_to_exitcode(raw) == 0
    finally:
        flusher.close()


@pytest.mark.parametrize(
    ("code", "resumes"), [(errno.EMFILE, True), (errno.ENFILE, True), (errno.EACCES, False)]
)
def test_the_flushers_failed_open_refuses_until_a_flush_succeeds_when_transient(
    base: Path, monkeypatch: pytest.MonkeyPatch, code: int, resumes: bool
) -> None:
    """Review 32d F1: the C flusher opening a chunk of its own for a moment out of
    descriptors fails that batch only (nothing failed to reach the disk): the next flush
    opens again, the sends resume once a service turn succeeds. Any other open failure
    refuses every later send until a reopen, as a failed fdatasync does (the control)."""
    from equeue.store import flush as flush_module

    real = flush_module._open_own
    armed: list[int] = []

    def open_own(chunk: object) -> int:
        if armed:
            armed.clear()
            raise StoreWriteError(code, f"[Errno {code}] {os.strerror(code)}: injected")
        return real(chunk)  # type: ignore[arg-type]

    monkeypatch.setattr(flush_module, "_open_own", open_own)
    store = MessageStore.open(base / "s", StoreConfig(flush="async", flush_interval_ms=20))
    with (
        BrokerThread(store, flush="sync", listen=[f"unix:{base}/b.sock"]) as broker,
        equeue.connect(broker.urls[0]) as client,
    ):
        assert isinstance(broker.broker.commit._sync, flushers.CSync)  # type: ignore[union-attr]
        client.create_topic("t", 1)
        armed.append(1)  # the first flush opens the log chunk for the flusher
        with pytest.raises(StoreWriteError, match="refused until"):
            client.send("t", b"one")
        time.sleep(0.3)  # about 15 service turns
        if resumes:
            assert client.send("t", b"two").queue_offset == 1  # "one" was stored
        else:
            with pytest.raises(StoreWriteError, match="refusing the send"):
                client.send("t", b"two")
    store.close()  # nothing failed to reach the disk: the close's own fdatasync succeeds


@pytest.mark.parametrize("fail", [True, False])
def test_a_failed_log_fdatasync_under_async_flush_refuses_sends_until_a_reopen(
    base: Path, monkeypatch: pytest.MonkeyPatch, fail: bool
) -> None:
    """Review 32d F2: flush="async", ``flush()`` fails on the log's chunk (EIO): every
    later send is refused, also after the service's turns that skip the log (fewer than
    flush_least_pages unflushed) succeed; nothing more is stored into the chunk no flush
    can make durable. The control (no failure): the same sends are stored."""
    config = StoreConfig(flush="async", flush_interval_ms=20, flush_thorough_interval_ms=200)
    store = MessageStore.open(base / "s", config)
    try:
        store.create_topic("t", 1)
        store.send("t", b"x")
        if fail:
            _fail_next_fdatasync(monkeypatch)
            with pytest.raises(StoreWriteError):
                store.flush()
        stored = refused = 0
        deadline = time.monotonic() + 0.5  # ~25 service turns
        while time.monotonic() < deadline:
            try:
                store.send("t", b"y")
                stored += 1
            except StoreWriteError:
                refused += 1
            time.sleep(0.005)
        assert (stored == 0) == fail and (refused == 0) != fail, (stored, refused)
        assert store.queue_range("t", 0) == (0, 1 + stored)
    finally:
        if fail:
            with pytest.raises(StoreWriteError):
                store.close()
        else:
            store.close()
