"""What a store keeps mapped stays bounded by a window, not by what it wrote or read:
each chunk's resident pages, read from /proc/self/smaps, before and after."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from equeue import MessageStore, OutgoingMessage, StoreConfig, speedups
from equeue.chunks import ChunkManager, ChunkManagerConfig, ChunkReader, ChunkWriter
from equeue.chunks.prefault import PREFAULTER, WINDOW, Prefaulter
from equeue.chunks.recovery import scan_variable
from equeue.format.chunk import FRAME_OVERHEAD

MiB = 1 << 20
# What a chunk may keep resident: the window behind the writer or reader plus the half
# window before the next release, the window prefaulted ahead, one more that a lagging
# prefault request may fault in after the writer moved on, and the kernel mapping whole
# large folios (up to 2 MiB here) around a fault. Every control holds tens of MiB.
BOUND = 4 * WINDOW + 2 * MiB
SMAPS = Path("/proc/self/smaps")
pytestmark = pytest.mark.skipif(not SMAPS.exists(), reason="needs /proc/self/smaps (Linux)")


def resident(path: Path) -> int:
    """Bytes of ``path`` resident in this process's mappings of it."""
    total, inside = 0, False
    for line in SMAPS.read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5:  # a mapping's first line
            inside = len(fields) >= 6 and fields[5] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


def write_unflushed(writer: ChunkWriter, size: int) -> None:
    record = os.urandom(4000)
    for _ in range(size // len(record)):
        writer.write(record)


@pytest.mark.parametrize("release", [True, False])
def test_writer_keeps_a_window_of_what_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, release: bool
) -> None:
    """Pages a window behind the writer leave its resident set, flushed or not (under
    "async" a writer outruns the disk); without the release (the control) all stay."""
    if not release:
        monkeypatch.setattr("equeue.chunks.chunk.Chunk._release", lambda *a: None)
    config = ChunkManagerConfig(chunk_data_size=64 * MiB)
    with ChunkManager(tmp_path, config) as manager:
        writer = ChunkWriter(manager)
        write_unflushed(writer, 40 * MiB)
        chunk = manager.last_chunk
        assert chunk is not None and chunk.data_end > 39 * MiB
        assert chunk.unflushed_bytes == chunk.data_end
        held = resident(chunk.path)
        if release:
            assert held <= BOUND, held
        else:
            assert held >= 36 * MiB, held
        writer.complete()  # hashes the whole chunk: a step at a time, each step released
        if release:
            assert resident(chunk.path) <= BOUND
        else:
            assert resident(chunk.path) >= 39 * MiB


@pytest.mark.parametrize("release", [True, False])
def test_fixed_size_writer_keeps_a_window_of_what_it_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, release: bool
) -> None:
    """Queue chunks (12-byte entries, written by ``try_append_fixed`` on the pure-Python
    path) release behind the writer as the log does, by their smaller window; without
    the release (the control) all 6 MiB written stay resident."""
    if not release:
        monkeypatch.setattr("equeue.chunks.chunk.Chunk._release", lambda *a: None)
    config = ChunkManagerConfig(chunk_data_size=12 * MiB, record_size=12)
    with ChunkManager(tmp_path, config) as manager:
        writer = ChunkWriter(manager)
        write = writer.write
        entry = os.urandom(12)
        for _ in range(6 * MiB // 12):
            write(entry)
        chunk = manager.last_chunk
        assert chunk is not None and chunk.data_end == 6 * MiB
        held = resident(chunk.path)
        window = chunk._window
        assert window < WINDOW
        if release:
            assert held <= 4 * window + 2 * MiB, held
        else:
            assert held >= 6 * MiB - window, held


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("release", [True, False])
def test_a_recovery_scan_keeps_a_window_of_what_it_walked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fast: bool, release: bool
) -> None:
    """Recovery walks the last chunk a step at a time and releases each step, in C and
    in the pure-Python loop alike; without the release (the control) the 40 MiB walked
    stay resident."""
    config = ChunkManagerConfig(chunk_data_size=64 * MiB)
    with ChunkManager(tmp_path, config) as manager:
        write_unflushed(ChunkWriter(manager), 40 * MiB)
        chunk = manager.last_chunk
        assert chunk is not None
        path, written, records = chunk.path, chunk.data_end, chunk.record_count
    if not fast:
        monkeypatch.setattr(speedups, "SPEEDUPS", None)
    if not release:
        monkeypatch.setattr("equeue.chunks.recovery.release_walked", lambda *a: None)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        result = scan_variable(mm, config.chunk_data_size, 64 * MiB - FRAME_OVERHEAD)
        assert (result.data_end, result.record_count, result.problem) == (written, records, None)
        held = resident(path)
        if release:
            assert held <= BOUND, held
        else:
            assert held >= 39 * MiB, held


@pytest.mark.parametrize("release", [True, False])
def test_released_unflushed_pages_keep_their_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, release: bool
) -> None:
    """MADV_DONTNEED on a shared file mapping only unmaps: the dirty pages stay in the page
    cache, so 40 MiB written and released before any flush reads back intact, in this
    process and after a reopen. The control keeps every page mapped."""
    if not release:
        monkeypatch.setattr("equeue.chunks.chunk.Chunk._release", lambda *a: None)
    config = ChunkManagerConfig(chunk_data_size=64 * MiB)
    records = [os.urandom(4000) for _ in range(64)]
    count = 40 * MiB // 4000
    with ChunkManager(tmp_path, config) as manager:
        writer = ChunkWriter(manager)
        for i in range(count):
            writer.write(records[i % 64])
        chunk = manager.last_chunk
        assert chunk is not None and chunk.flushed_end == 0
        assert (resident(chunk.path) <= BOUND) == release
        assert [r for _, r in ChunkReader(manager).iter_from(0)] == [
            records[i % 64] for i in range(count)
        ]
    with ChunkManager(tmp_path, config) as reopened:
        assert reopened.recovery_cuts == []
        assert [r for _, r in ChunkReader(reopened).iter_from(0)] == [
            records[i % 64] for i in range(count)
        ]


def test_a_new_prefault_request_replaces_the_older_one_of_its_mapping() -> None:
    """A writer that outruns the prefault thread must not have it fault in the windows
    it already passed (and released): only each mapping's newest request is kept, and a
    closed mapping's request goes (the Python thread; the C one is below)."""
    prefaulter = Prefaulter(in_c=False)
    prefaulter.enabled = True
    prefaulter._thread = threading.current_thread()  # never start the real one
    prefaulter.request(0x1000, 0x1000, WINDOW)
    prefaulter.request(0x9000, 0x9000, WINDOW)
    prefaulter.request(0x1000, 0x1000 + WINDOW // 2, WINDOW)
    assert list(prefaulter._requests.items()) == [
        (0x9000, (0x9000, WINDOW)),
        (0x1000, (0x1000 + WINDOW // 2, WINDOW)),
    ]
    prefaulter.forget(0x9000)
    assert list(prefaulter._requests) == [0x1000]


@pytest.mark.parametrize("same_mapping", [True, False])
def test_python_forget_waits_for_the_request_being_served(same_mapping: bool) -> None:
    """forget() returns only once the Python thread has finished a request it is serving
    for that mapping (served after the unmap, the range could be another mapping's); a
    request of another mapping (the control) does not hold it up."""
    prefaulter = Prefaulter(in_c=False)
    prefaulter.enabled = True
    entered, finish = threading.Event(), threading.Event()

    def slow_madvise(address: int, length: int, advice: int) -> int:
        entered.set()
        finish.wait(10)
        return 0

    prefaulter._madvise = slow_madvise
    prefaulter.request(0x1000, 0x1000, WINDOW)
    assert entered.wait(10)
    mapping = 0x1000 if same_mapping else 0x9000
    forgetting = threading.Thread(target=prefaulter.forget, args=(mapping,))
    forgetting.start()
    forgetting.join(0.3)
    assert forgetting.is_alive() == same_mapping
    finish.set()
    forgetting.join(10)
    assert not forgetting.is_alive()
    prefaulter.forget(0x1000)  # waits out the request in the control too
    assert prefaulter._serving is None


def c_prefault() -> Any:
    fast = speedups.SPEEDUPS
    if fast is None:
        pytest.skip("the C accelerator was not built")
    if not fast.prefault_supported():
        pytest.skip("the kernel lacks MADV_POPULATE_WRITE")
    return fast


def fresh_mapping(path: Path, size: int) -> mmap.mmap:
    with open(path, "w+b") as f:
        os.posix_fallocate(f.fileno(), 0, size)
        return mmap.mmap(f.fileno(), 0)


@pytest.mark.parametrize("requested", [True, False])
def test_the_c_prefault_thread_faults_in_what_was_asked(tmp_path: Path, requested: bool) -> None:
    """The C thread faults in the window asked for (without the request, the control,
    nothing of the fresh mapping becomes resident) and writes nothing; a request that
    fails (here EINVAL, on a read-only mapping: what a reused address range can give)
    leaves prefaulting on."""
    fast = c_prefault()
    path = tmp_path / "f"
    mm = fresh_mapping(path, 8 * MiB)
    address = Prefaulter.address_of(mm)
    if requested:
        assert fast.prefault_request(address, address + MiB, 2 * MiB)
    deadline = time.monotonic() + 5
    while resident(path) < 2 * MiB and time.monotonic() < deadline:
        time.sleep(0.01)
    held = resident(path)
    assert (held >= 2 * MiB) == requested, held
    assert held <= 2 * MiB + 64 * 1024  # the window only (fault-around may add a little)
    assert mm[: 3 * MiB] == bytes(3 * MiB)
    fast.prefault_forget(address)
    mm.close()
    read_only = mmap.mmap(-1, MiB)
    bad = Prefaulter.address_of(read_only)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    assert libc.mprotect(bad, MiB, mmap.PROT_READ) == 0
    assert fast.prefault_request(bad, bad, MiB)
    while bad in fast.prefault_pending():
        time.sleep(0.001)
    fast.prefault_forget(bad)  # returns once the thread is done with it
    read_only.close()
    live = fresh_mapping(tmp_path / "g", MiB)
    live_address = Prefaulter.address_of(live)
    assert fast.prefault_request(live_address, live_address, MiB)  # still on
    fast.prefault_forget(live_address)
    live.close()


@pytest.mark.parametrize("forget", [True, False])
def test_forget_drops_a_mappings_pending_request(tmp_path: Path, forget: bool) -> None:
    """Requests for 32 fresh 4 MiB mappings keep the thread busy for milliseconds; forget()
    takes each one's request off the queue before the thread gets to it (the control,
    without forget, still has some queued)."""
    fast = c_prefault()
    maps = [fresh_mapping(tmp_path / f"m{i}", 4 * MiB) for i in range(32)]
    addresses = [Prefaulter.address_of(mm) for mm in maps]
    for address in addresses:
        assert fast.prefault_request(address, address, 4 * MiB)
    if forget:
        for address in addresses:
            fast.prefault_forget(address)
    queued = set(fast.prefault_pending()) & set(addresses)
    assert (not queued) == forget, len(queued)
    for address, mm in zip(addresses, maps, strict=True):
        fast.prefault_forget(address)  # before the unmap, as Chunk does
        mm.close()
    assert not set(fast.prefault_pending()) & set(addresses)


@pytest.mark.parametrize("release", [True, False])
def test_pulls_keep_a_window_of_what_they_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, release: bool
) -> None:
    """A consumer reading through a 48 MiB completed chunk and the ongoing one keeps
    a few windows of each resident; without the release (the control) all it read."""
    config = StoreConfig(chunk_data_size=48 * MiB, flush="os")
    body = os.urandom(1000)
    with MessageStore.open(tmp_path, config) as store:
        store.create_topic("t", 1)
        for _ in range(70):
            store.send_batch("t", [OutgoingMessage(body)] * 1000)
        store.flush()
        paths = [c.path for c in store._messages]
        assert len(paths) == 2
        for path in paths:  # the writer's own pages: dropped by flush() and the window
            if release:
                assert resident(path) <= BOUND
        if not release:
            monkeypatch.setattr("equeue.chunks.chunk.Chunk.release_behind", lambda *a: None)
        offset, pulled = 0, 0
        while True:
            batch = store.pull("t", 0, offset, max_count=256)
            messages, offset = batch.messages, batch.next_offset
            if not messages:
                break
            pulled += len(messages)
        assert pulled == 70_000
        held = [resident(path) for path in paths]
        if release:
            assert all(h <= BOUND for h in held), held
        else:
            assert held[0] >= 40 * MiB, held  # the completed chunk, read end to end


@pytest.mark.parametrize("append", [False, True])
def test_a_reopened_store_maps_no_write_window_until_it_appends(
    tmp_path: Path, append: bool
) -> None:
    """Opening a store asks for no window ahead of the writer: a process that only reads
    (or recovers and closes) maps none of it. The first append asks for it (the control:
    then the window shows up, so the measure can see it)."""
    if not PREFAULTER.enabled:
        pytest.skip("the kernel lacks MADV_POPULATE_WRITE")
    config = StoreConfig(chunk_data_size=16 * MiB, flush="os")
    with MessageStore.open(tmp_path, config) as store:
        store.create_topic("t", 1)
        store.send_batch("t", [OutgoingMessage(os.urandom(1000))] * 4000)
    with MessageStore.open(tmp_path, config) as store:
        chunk = store._messages.last_chunk
        assert chunk is not None
        if append:
            store.send("t", b"one more")
        # Long enough for a request made at open to have been served (under a millisecond).
        deadline = time.monotonic() + (5 if append else 0.5)
        while resident(chunk.path) < WINDOW // 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # the prefault thread runs apart from the writer
        held = resident(chunk.path)
        if append:
            assert held >= WINDOW // 2, held
        else:
            assert held == 0, held


def test_importing_the_store_leaves_numpy_and_spark_out() -> None:
    """The store process pays for what it uses: numpy (12 MiB resident) and pyspark
    belong to the compaction job, whose modules the store imports only for types."""
    code = "import sys, equeue; print(sorted(m for m in ('numpy', 'pyspark') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
