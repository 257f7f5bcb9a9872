"""The footer's checksum hashed as the chunk fills (equeue/chunks/runninghash.py), at the
edges: a writer SIGKILLed mid-chunk and the chunk completed by the next open (hashed
whole at completion) beside chunks hashed as they filled; a torn tail cut by the open
first; chunks rewritten by a compaction first; retention deleting chunks while the
writer completes others; a read-only view in this process beside a live writer in
another. Each case ends with ``equeue verify`` finding nothing (it recomputes every
footer checksum) and every acknowledged message of ``t`` read back. Control: the
writer closes the store instead of being killed."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

from edges_writer import CHUNK, Retaining, body, config, prepare, topic_of
from store_helpers import frame_size, message_file

from equeue import MessageStore
from equeue.format.chunk import FRAME_PREFIX
from equeue.inspect.verify import verify_store

WRITER = Path(__file__).resolve().with_name("edges_writer.py")
COUNT = 1400  # about 1.5 log chunks: the kill lands mid-chunk
Ack = tuple[int, str, int, int]  # i, topic, queue offset, position


def acks_of(stdout: str) -> list[Ack]:
    rows = [line.split() for line in stdout.splitlines() if line.startswith("A ")]
    return [(int(r[1]), r[2], int(r[3]), int(r[4])) for r in rows]


def run_writer(path: Path, mode: str, count: int = COUNT) -> list[Ack]:
    proc = subprocess.run(
        [sys.executable, str(WRITER), str(path), mode, str(count)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == (0 if mode == "close" else -9), proc.stderr
    acks = acks_of(proc.stdout)
    assert len(acks) == count
    return acks


def fill(store: MessageStore, chunks: int, start: int) -> int:
    """Send until ``chunks`` more log chunks were completed; the next message number."""
    i = start
    for _ in range(chunks):
        last = store._messages.last_chunk
        for _ in range(4 * CHUNK // 1000):  # (bounded: a chunk holds < CHUNK / 1000)
            if store._messages.last_chunk is not last:
                break
            store.send(topic_of(i), body(i), queue_id=0)
            i += 1
        assert store._messages.last_chunk is not last
    return i


def reads_back(store: MessageStore, acks: list[Ack]) -> None:
    for i, topic, offset, position in acks:
        if topic == "t":
            [m] = store.pull("t", 0, offset, max_count=1).messages
            assert (m.position, m.body) == (position, body(i))


def complete_and_verify(path: Path, acks: list[Ack]) -> MessageStore:
    """Open (recovering), complete the chunk the writer left and one more, close, verify."""
    store = MessageStore.open(path, config())
    with store:
        prepare(store)
        reads_back(store, acks)
        fill(store, 2, len(acks))
    assert verify_store(path) == []
    return store


def test_control_a_closed_writer(tmp_path: Path) -> None:
    acks = run_writer(tmp_path, "close")
    complete_and_verify(tmp_path, acks)


def test_a_chunk_killed_mid_way_and_completed_after_the_reopen(tmp_path: Path) -> None:
    acks = run_writer(tmp_path, "kill")
    assert acks[-1][3] % CHUNK > CHUNK // 4  # mid-chunk, past the hash's first follows
    store = complete_and_verify(tmp_path, acks)
    assert not store.recovery.cuts


def test_a_torn_tail_cut_by_the_open_then_completed(tmp_path: Path) -> None:
    """A frame half written past the last acknowledged one (a length prefix and half its
    bytes): the open cuts it, the chunk is completed, its checksum verifies."""
    acks = run_writer(tmp_path, "kill")
    i, topic, _, position = acks[-1]
    end = position + frame_size(topic, body(i))
    file, at = message_file(tmp_path, CHUNK, end)
    with open(file, "r+b") as f:
        f.seek(at)
        f.write(FRAME_PREFIX.pack(1200) + b"\xab" * 600)
    store = complete_and_verify(tmp_path, acks)
    assert store.recovery.cuts, "the torn frame was not cut"


def test_a_chunk_completed_after_a_compaction_rewrote_earlier_ones(
    tmp_path: Path, spark: object
) -> None:
    from equeue.compaction.job import compact

    acks = run_writer(tmp_path, "kill", 2 * COUNT)  # ~3 chunks: 2 complete, to compact
    with MessageStore.open(tmp_path, config()):  # recovered first (the job reads files)
        pass
    report = compact(tmp_path, spark=spark, now=time.time() + 60)  # type: ignore[arg-type]
    assert report.records_removed > 0  # d's messages in the completed chunks
    store = complete_and_verify(tmp_path, acks)
    assert not store.recovery.cuts


def test_retention_deletes_chunks_while_the_writer_completes_others(tmp_path: Path) -> None:
    """max_store_bytes of 3 chunks and apply_retention in a loop on another thread while
    this one completes 6 chunks: every chunk left verifies, what is left of t reads."""
    acks = run_writer(tmp_path, "kill")
    limit = config(max_store_bytes=3 * (CHUNK + 8192))
    with MessageStore.open(tmp_path, limit) as store:
        prepare(store)
        retaining = Retaining(store)
        try:
            fill(store, 6, len(acks))
        finally:
            removed = retaining.stop()
        assert removed > 0, "retention removed nothing"
        first = store.queue_range("t", 0)[0]
        reads_back(store, [a for a in acks if a[1] == "t" and a[2] >= first])
    assert verify_store(tmp_path) == []


def _read_lines(proc: subprocess.Popen[str], count: int, timeout: float = 60) -> list[str]:
    """``count`` lines of the child's stdout, read on a thread joined with a bound: a child
    that hangs is killed (its pipe's EOF ends the reading) and the test fails."""
    assert proc.stdout is not None
    stdout = proc.stdout
    lines: list[str] = []
    reading = threading.Thread(
        target=lambda: lines.extend(stdout.readline() for _ in range(count)), daemon=True
    )
    reading.start()
    reading.join(timeout)
    if reading.is_alive():
        proc.kill()
        reading.join(20)
        printed = sum(1 for line in lines if line)
        raise AssertionError(f"the writer printed {printed} of {count} lines in {timeout} s")
    return lines


def test_a_read_only_view_beside_a_live_writer_sees_what_it_acknowledged(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(WRITER), str(tmp_path), "hold", str(COUNT)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdin is not None
        lines = _read_lines(proc, COUNT + 1)
        assert lines[-1] == "READY\n", (lines[-1], proc.stderr and proc.stderr.read())
        acks = acks_of("".join(lines))
        with MessageStore.open(tmp_path, read_only=True) as view:
            reads_back(view, acks)
            assert view.queue_range("t", 0) == (0, (COUNT + 1) // 2)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(20) == -9
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(20)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    complete_and_verify(tmp_path, acks)
