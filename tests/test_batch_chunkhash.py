"""Chunk footers' checksums taken as the writer goes (equeue/chunks/runninghash.py): the
same checksum as hashing the whole chunk, for log and queue chunks filled by the C batch
path and the single send path, and for a chunk resumed after a reopen (hashed whole at
complete, as before); ``equeue verify`` finds nothing. And complete() no longer hashes
the chunk from its start (the stall of a batched broker's loop at each 256 MiB)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import xxhash

from equeue import MessageStore, StoreConfig
from equeue.chunks import completion, space
from equeue.chunks.chunk import Chunk
from equeue.errors import DiskFullError
from equeue.format.chunk import FOOTER_SIZE, HEADER_SIZE, ChunkFooter
from equeue.inspect.verify import verify_store

CONFIG = StoreConfig(chunk_data_size=1 << 20, queue_chunk_records=2000, flush="async")


def _footers(path: Path) -> list[tuple[Path, ChunkFooter, bytes]]:
    out = []
    for file in sorted(path.rglob("chunk-*")):
        data = file.read_bytes()
        try:
            footer = ChunkFooter.unpack(data[-FOOTER_SIZE:])
        except Exception:  # the chunk being written: no footer yet
            continue
        out.append((file, footer, data))
    return out


def test_footers_hashed_as_the_writer_goes_are_the_whole_chunks_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[int] = []
    complete = Chunk.complete

    def where_hashing_starts(self: Chunk) -> object:
        hashed = getattr(self, "_hashed", None)  # (None before runninghash.py)
        started.append(hashed.upto if hashed is not None else 0)
        return complete(self)

    monkeypatch.setattr(Chunk, "complete", where_hashing_starts)
    path = tmp_path / "s"
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t", 3)
        for b in range(120):  # the C batch path, 100 B and some 3 KiB bodies
            store.send_batch(
                "t", [(b"%d-%d" % (b, i)).ljust(100 + 3000 * (i == 7)) for i in range(100)]
            )
        for i in range(3000):  # the single send path
            store.send("t", b"single %d" % i)
    resumed = len(started)
    with MessageStore.open(path, CONFIG) as store:  # the open chunks resumed: hashed whole
        for _ in range(40):
            store.send_batch("t", [b"after reopen %d" % i for i in range(100)])
    footers = _footers(path)
    assert sum("queues" in str(f) for f, _, _ in footers) >= 3  # queue chunks completed too
    assert len(footers) >= 6 and len(started) == len(footers)
    for file, footer, data in footers:
        whole = xxhash.xxh3_64_intdigest(data[: HEADER_SIZE + footer.physical_data_size])
        assert footer.checksum == whole, file
    # Fresh chunks were hashed to near their end before complete(): at most a half window
    # (256 KiB) of the log's 1 MiB, a queue chunk's window (256 KiB) left
    assert all(start > 0 for start in started[:resumed])
    assert started[resumed:][0] == 0 or resumed == len(started)
    assert verify_store(path) == []


@pytest.mark.parametrize("footer_fails", [False, True])
def test_a_complete_retried_after_its_footer_failed_hashes_the_chunk_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, footer_fails: bool
) -> None:
    # The footer's block allocation meets a full disk once (after the rest was hashed);
    # the next send completes the chunk again: its footer must still be the chunk's hash.
    # Control: no failure, the same sends, the same checks.
    real = space.allocate
    armed = {"fail": False, "failed": 0}

    def allocate(fd: int, offset: int, length: int) -> bool:
        if armed["fail"] and length == FOOTER_SIZE:
            armed["fail"] = False
            armed["failed"] += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, offset, length)

    monkeypatch.setattr(completion, "_allocate", allocate)  # the footer's block
    path = tmp_path / "s"
    refused = 0
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("t", 1)
        for i in range(20_000):  # 1 MiB log chunks: several complete
            armed["fail"] = armed["fail"] or (footer_fails and i == 9000)
            try:
                store.send("t", b"x" * 100)
            except DiskFullError:
                refused += 1
    assert armed["failed"] == refused == int(footer_fails)
    footers = _footers(path)
    assert len(footers) >= 3
    for file, footer, data in footers:
        whole = xxhash.xxh3_64_intdigest(data[: HEADER_SIZE + footer.physical_data_size])
        assert footer.checksum == whole, file
    assert verify_store(path) == []
    with MessageStore.open(path, CONFIG) as store:
        assert store.queue_range("t", 0)[1] == 20_000 - refused
