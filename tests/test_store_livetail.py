"""The live tail (``tail.live``): recovery in the boot that wrote it starts where the
killed writer last noted its tail, and in any other boot it is ignored.

Kill tests run tests/livetail_writer.py (32 MiB chunks, 1 KiB messages, so the log
passes many half windows) and SIGKILL it mid-batch; each reopened store is checked
message by message against what the writer acknowledged, beside a copy reopened as
if after a reboot (another boot id), which must find the same messages.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from livetail_writer import BATCH, CONFIG, TOPIC, body, has_keys, key

import equeue.store.livetail
from equeue import MessageStore
from equeue.chunks.config import MiB
from equeue.cli import main
from equeue.errors import StoreWriteError
from equeue.format.chunk import HEADER_SIZE
from equeue.format.livetail import (
    FILE_SIZE,
    LIVE_TAIL_FILE,
    SLOT_OFFSETS,
    SLOT_SIZE,
    LiveTail,
    LiveTailHeader,
    newest,
)
from equeue.inspect import layout
from equeue.store import store as store_module
from equeue.store.livetail import current_boot_id, read_live_tail

WRITER = Path(__file__).with_name("livetail_writer.py")
BOOT = current_boot_id()
needs_boot_id = pytest.mark.skipif(BOOT is None, reason="no boot id on this system")


# --- the format ---------------------------------------------------------------


def test_slot_round_trips_and_a_torn_slot_falls_back_to_the_other() -> None:
    boot, chunk = uuid.uuid4(), uuid.uuid4()
    older, newer = LiveTail(6, chunk, 4096, 3), LiveTail(7, chunk, 8192, 7)
    assert LiveTail.unpack(newer.pack()) == newer
    raw = bytearray(LiveTailHeader(boot).pack() + older.pack() + newer.pack())
    assert len(raw) == FILE_SIZE and SLOT_OFFSETS[1] + SLOT_SIZE == FILE_SIZE
    assert newest(bytes(raw), boot) == newer
    raw[SLOT_OFFSETS[1] + 30] ^= 1  # a byte of the newer slot: its checksum fails
    assert newest(bytes(raw), boot) == older
    raw[SLOT_OFFSETS[0] + 9] ^= 1
    assert newest(bytes(raw), boot) is None


@pytest.mark.parametrize("case", ["another boot", "no magic", "short", "empty slots"])
def test_anything_but_a_whole_slot_of_this_boot_is_no_hint(case: str) -> None:
    boot = uuid.uuid4()
    slot = LiveTail(1, uuid.uuid4(), 4096, 3).pack()
    raw = {
        "another boot": LiveTailHeader(uuid.uuid4()).pack() + slot + slot,
        "no magic": bytes(8) + LiveTailHeader(boot).pack()[8:] + slot + slot,
        "short": (LiveTailHeader(boot).pack() + slot)[: SLOT_OFFSETS[0] + 20],
        "empty slots": LiveTailHeader(boot).pack() + bytes(2 * SLOT_SIZE),
    }[case]
    assert newest(raw, boot) is None
    assert newest(LiveTailHeader(boot).pack() + slot, boot) is not None  # the control


# --- the writer ---------------------------------------------------------------


@needs_boot_id
def test_the_slot_names_a_record_boundary_behind_the_tail(tmp_path: Path) -> None:
    assert BOOT is not None
    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.send_batch(TOPIC, [body(i) for i in range(3000)])  # ~3 MiB: several windows
        slot = read_live_tail(tmp_path / "s", BOOT)
        assert slot is not None
        last = store._messages.last_chunk
        assert last is not None and slot.chunk_id == last.header.chunk_id
        assert 0 < slot.data_end < last.data_end
        ends = [offset + len(record) + 12 for offset, record in last.iter_records(0)]
        assert ends[slot.record_count - 1] == slot.data_end
    with MessageStore.open(tmp_path / "s", CONFIG) as store:  # a later open starts afresh
        assert read_live_tail(tmp_path / "s", BOOT) is None


@needs_boot_id
def test_no_slot_past_a_key_still_buffered(tmp_path: Path) -> None:
    """A slot past a key not yet in the key index would let recovery skip re-indexing it."""
    assert BOOT is not None

    def slot_position(store: MessageStore) -> int:
        slot = read_live_tail(tmp_path / "s", BOOT)
        assert slot is not None
        chunk = next(c for c in store._messages if c.header.chunk_id == slot.chunk_id)
        return chunk.start_position + slot.data_end

    with MessageStore.open(tmp_path / "s", CONFIG) as store:
        store.send_batch(TOPIC, [body(i) for i in range(2000)])
        keyed = store.send(TOPIC, body(2000), key="k").position
        for start in range(2001, 8001, 2000):
            store.send_batch(TOPIC, [body(i) for i in range(start, start + 2000)])
            assert slot_position(store) <= keyed  # ~6 MiB later, still before the key
        store.flush()  # commits the key index
        for start in range(8001, 12001, 2000):
            store.send_batch(TOPIC, [body(i) for i in range(start, start + 2000)])
        assert slot_position(store) > keyed + 4 * MiB


# --- kills --------------------------------------------------------------------


def run_and_kill(store: Path, *, keys: bool, acks: int) -> int:
    """Run the writer until it acknowledged ``acks`` messages, then SIGKILL it during the
    batches after; the number it acknowledged (its last line, read after the kill: the
    pipe holds lines the reader had not reached)."""
    args = [sys.executable, str(WRITER), str(store)] + (["--keys"] if keys else [])
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    acked = 0
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            acked = int(line.split()[1])
            if acked >= acks:
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        # Through the reader, not communicate(): that reads the pipe itself and would
        # miss the lines this reader has buffered already.
        rest = proc.stdout.read()
        assert proc.stderr is not None
        err = proc.stderr.read()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, err
    for line in rest.splitlines():
        if line.startswith("A "):
            acked = int(line.split()[1])
    return acked


def bodies(store: MessageStore) -> Iterator[bytes]:
    offset = 0
    while messages := store.pull(TOPIC, 0, offset, 512).messages:
        yield from (m.body for m in messages)
        offset += len(messages)


def check_store(store: MessageStore, acked: int, *, keys: bool) -> int:
    """Every acknowledged message, in order and byte-identical, and nothing but messages
    the writer sent; with keys, each acknowledged message found by its key."""
    found = 0
    for i, got in enumerate(bodies(store)):
        assert got == body(i), f"message {i} differs"
        found += 1
    # Past the last line: a batch that returned before its line was written, and the one
    # the kill interrupted.
    assert acked <= found <= acked + 2 * BATCH
    if keys:  # each key once per message sent with it, none twice (re-indexed past the tail)
        for k in {key(i) for i in range(found) if has_keys(i)}:
            indexed = [m.body for m in store.query_by_key(TOPIC, k, limit=10_000)]
            expected = [body(i) for i in range(found) if has_keys(i) and key(i) == k]
            assert sorted(indexed) == sorted(expected), k
    return found


@needs_boot_id
@pytest.mark.parametrize("acks", [9_000, 40_000])  # 10 MB into chunk 0, and into chunk 1
def test_after_a_kill_recovery_starts_at_the_live_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, acks: int
) -> None:
    path = tmp_path / "s"
    acked = run_and_kill(path, keys=False, acks=acks)
    rebooted = tmp_path / "rebooted"
    shutil.copytree(path, rebooted)
    with MessageStore.open(path, CONFIG) as store:
        assert store._messages.started_at_live_hint
        last = store._messages.last_chunk
        assert last is not None
        # What recovery walked: from the live tail, at most a window or two of records.
        assert store._messages.committed_position - store.recovery.start_position < 2 * MiB
        found = check_store(store, acked, keys=False)
    # The control: another boot ignores tail.live, walks from the checkpoint, finds the same.
    monkeypatch.setattr(store_module, "current_boot_id", uuid.uuid4)
    with MessageStore.open(rebooted, CONFIG) as store:
        assert not store._messages.started_at_live_hint
        assert check_store(store, acked, keys=False) == found


@needs_boot_id
def test_after_a_kill_with_keys_every_key_is_found_once(tmp_path: Path) -> None:
    path = tmp_path / "s"
    acked = run_and_kill(path, keys=True, acks=12_000)
    with MessageStore.open(path, CONFIG) as store:
        assert store._messages.started_at_live_hint  # past the last flushed keyed batch
        check_store(store, acked, keys=True)


QUIET_QUEUE_WRITER = """
import dataclasses, os, sys
from equeue import MessageStore
from livetail_writer import CONFIG, body
store = MessageStore.open(sys.argv[1], dataclasses.replace(CONFIG, flush=sys.argv[2]))
for i in range(5):
    store.send("quiet", body(i))
store.flush()  # a checkpoint: queue quiet/0 ends at 5
for i in range(5, 15):
    store.send("quiet", body(i))
for j in range(0, 3000, 100):  # the live tail moves on past them, a batch at a time
    store.send_batch("busy", [body(i) for i in range(j, j + 100)])
os._exit(0)  # no close: the next open recovers
"""


@needs_boot_id
@pytest.mark.parametrize("policy", ["async", "sync"])
def test_a_queue_quiet_since_the_checkpoint_keeps_its_entries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, policy: str
) -> None:
    """From the live tail on, a queue with no record past it ends where its entries
    reach it, not at the older checkpoint's offset (a review found the 10 sends cut)."""
    path = tmp_path / "s"
    run = subprocess.run(
        [sys.executable, "-c", QUIET_QUEUE_WRITER, str(path), policy],
        cwd=WRITER.parent,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    rebooted = tmp_path / "rebooted"
    shutil.copytree(path, rebooted)
    with MessageStore.open(path, CONFIG) as store:
        assert store._messages.started_at_live_hint
        assert not store.recovery.cuts
        assert store.queue_range("quiet", 0) == (0, 15)
    monkeypatch.setattr(store_module, "current_boot_id", uuid.uuid4)
    with MessageStore.open(rebooted, CONFIG) as store:  # the control
        assert store.queue_range("quiet", 0) == (0, 15)


@needs_boot_id
def test_a_failed_fdatasync_withdraws_the_live_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a failed fdatasync the page cache may hold pages the disk never got; the
    next open in this boot must verify from the checkpoint, as after a reboot."""
    assert BOOT is not None
    store = MessageStore.open(tmp_path / "s", CONFIG)
    try:
        store.send_batch(TOPIC, [body(i) for i in range(3000)])
        assert read_live_tail(tmp_path / "s", BOOT) is not None  # the control

        def failing(fd: int) -> None:
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(os, "fdatasync", failing)
        with pytest.raises(StoreWriteError):
            store.flush()
        assert read_live_tail(tmp_path / "s", BOOT) is None
        with pytest.raises(StoreWriteError, match="refusing the send"):  # until a reopen
            store.send_batch(TOPIC, [body(i) for i in range(3000, 6000)])
        assert read_live_tail(tmp_path / "s", BOOT) is None  # and none is written after
    finally:
        monkeypatch.undo()
        with contextlib.suppress(StoreWriteError):
            store.close()


@needs_boot_id
def test_a_live_tail_off_a_record_boundary_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s"
    acked = run_and_kill(path, keys=False, acks=9_000)
    assert BOOT is not None
    slot = read_live_tail(path, BOOT)
    assert slot is not None
    forged = LiveTail(slot.sequence + 1, slot.chunk_id, slot.data_end + 1, slot.record_count)
    raw = bytearray((path / LIVE_TAIL_FILE).read_bytes())
    at = SLOT_OFFSETS[forged.sequence % 2]
    raw[at : at + SLOT_SIZE] = forged.pack()
    (path / LIVE_TAIL_FILE).write_bytes(bytes(raw))
    with MessageStore.open(path, CONFIG) as store:
        assert not store._messages.started_at_live_hint
        check_store(store, acked, keys=False)


@needs_boot_id
def test_a_reboot_after_lost_pages_is_not_fooled_by_the_live_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As if a power cut lost the log's last pages but kept tail.live: in another boot
    the zeroed records are found and cut, none is returned."""
    path = tmp_path / "s"
    run_and_kill(path, keys=False, acks=9_000)
    assert BOOT is not None
    slot = read_live_tail(path, BOOT)
    assert slot is not None
    chunk = next(
        p for p in (path / "messages").iterdir() if slot.chunk_id.bytes in p.read_bytes()[:128]
    )
    data = bytearray(chunk.read_bytes())
    hole = HEADER_SIZE + slot.data_end - 64 * 1024
    data[hole : hole + 4096] = bytes(4096)  # a page behind the live tail, never flushed
    chunk.write_bytes(bytes(data))
    monkeypatch.setattr(store_module, "current_boot_id", uuid.uuid4)
    with MessageStore.open(path, CONFIG) as store:
        assert not store._messages.started_at_live_hint
        assert store.recovery.cuts  # the hole and everything after it
        for i, got in enumerate(bodies(store)):
            assert got == body(i)


@needs_boot_id
def test_inspect_shows_where_recovery_would_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s"
    run_and_kill(path, keys=False, acks=9_000)
    assert BOOT is not None
    slot = read_live_tail(path, BOOT)
    assert slot is not None
    assert main(["inspect", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    chunk = next(c for c in doc["message_chunks"] if c["state"] == "ongoing")
    assert doc["live_tail_position"] == chunk["start_position"] + slot.data_end
    assert doc["checkpoint_position"] <= doc["live_tail_position"]
    assert main(["inspect", str(path)]) == 0
    assert f"live tail {doc['live_tail_position']}" in capsys.readouterr().out
    monkeypatch.setattr(layout, "current_boot_id", uuid.uuid4)  # another boot: none shown
    assert main(["inspect", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["live_tail_position"] is None


def test_a_live_tail_that_cannot_be_written_only_costs_recovery_speed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its open fails as a full or read-only file system fails it (a directory in its
    # place is another matter: StorePathError, tests/test_store_hostile.py).
    def refused(path: Path, flags: int) -> int:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

    monkeypatch.setattr(equeue.store.livetail, "open_fd", refused)
    path = tmp_path / "s"
    with MessageStore.open(path, CONFIG) as store:
        store.send_batch(TOPIC, [body(i) for i in range(3000)])
        assert store._live_tail is None
    assert BOOT is None or "no live tail" in caplog.text
    with MessageStore.open(path, CONFIG) as store:
        assert list(bodies(store)) == [body(i) for i in range(3000)]
