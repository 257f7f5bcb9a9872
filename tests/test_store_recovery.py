"""Crash consistency of the message store, without subprocesses.

A crash is simulated by copying the store directory while the store is open
(after ``flush()``, so the copy holds everything written so far, as the page
cache would after a process crash), then damaging the copy the way a crash or
a bad disk can: lost queue entries, a lost or damaged checkpoint, a torn
message-log tail, damaged metadata files.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from store_helpers import settle_chunk_maker

from equeue import Message, MessageStore, SendResult, StoreConfig
from equeue.errors import EQueueError, MessageNotFoundError
from equeue.format.chunk import HEADER_SIZE

CHUNK = 4096
CONFIG = StoreConfig(chunk_data_size=CHUNK, queue_chunk_records=400, default_queue_count=3)
TOPICS = {"t": 3, "u": 1}


# --- helpers -----------------------------------------------------------------------


def send_some(store: MessageStore, prefix: str, count: int) -> list[SendResult]:
    results = []
    for i in range(count):
        results.append(
            store.send(
                "t",
                f"{prefix}{i}".encode() * (1 + i % 9),
                tag=f"tag{i % 3}",
                key=f"key{i % 5}",
                properties={"n": str(i)} if i % 2 else None,
                code=i,
                queue_id=i % 3,
            )
        )
        results.append(store.send("u", f"{prefix}u{i}".encode() * 3, queue_id=0))
    return results


def everything(store: MessageStore) -> dict[tuple[str, int], list[Message]]:
    result = {}
    for topic in store.topics():
        for q in store.queue_ids(topic):
            messages: list[Message] = []
            offset = 0
            while True:
                pulled = store.pull(topic, q, offset, max_count=200)
                messages += pulled.messages
                if pulled.next_offset == offset:
                    break
                offset = pulled.next_offset
            result[(topic, q)] = messages
    return result


def keys_of(store: MessageStore) -> dict[str, list[Message]]:
    return {f"key{i}": store.query_by_key("t", f"key{i}", limit=1000) for i in range(5)}


def crash_copy(store: MessageStore, dest: Path) -> Path:
    """The directory as a process crash right now would leave it: copying reads the page
    cache, which holds every write (flush() is not called: it would write a checkpoint).
    The chunk maker first finishes the file it makes ahead (not data; it would vanish or
    appear under the copy)."""
    settle_chunk_maker(store)
    shutil.copytree(store.path, dest)
    return dest


def chunk_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("chunk-*"))


def queue_entries_in_last_chunk(path: Path) -> int:
    data = path.read_bytes()
    count = 0
    while data[HEADER_SIZE + count * 12 : HEADER_SIZE + (count + 1) * 12] not in (b"", bytes(12)):
        count += 1
    return count


def zero_queue_tail(store_path: Path, topic: str, queue_id: int, count: int) -> int:
    """Zero the last ``count`` entries of a queue (at most those of its last chunk)."""
    last = chunk_files(store_path / "queues" / topic / str(queue_id))[-1]
    entries = queue_entries_in_last_chunk(last)
    count = min(count, entries)
    data = bytearray(last.read_bytes())
    start = HEADER_SIZE + (entries - count) * 12
    data[start : start + count * 12] = bytes(count * 12)
    last.write_bytes(bytes(data))
    return count


def frame_end(chunk: Path) -> int:
    """Data offset just past the last valid-looking frame of a message chunk."""
    data = chunk.read_bytes()
    p = 0
    while True:
        (n,) = struct.unpack_from("<I", data, HEADER_SIZE + p)
        if n == 0:
            return p
        p += n + 12


def flip_byte(path: Path, index: int, mask: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[index] ^= mask
    path.write_bytes(bytes(data))


def open_copy(path: Path) -> MessageStore:
    return MessageStore.open(path, CONFIG)


@pytest.fixture
def two_phase(tmp_path: Path) -> Iterator[tuple[MessageStore, list[SendResult], list[SendResult]]]:
    """Phase A closed cleanly (so the checkpoint covers it), phase B sent after a reopen."""
    path = tmp_path / "store"
    with MessageStore.open(path, CONFIG) as s:
        s.create_topic("u", 1)
        phase_a = send_some(s, "a", 120)
    with MessageStore.open(path, CONFIG) as s:
        assert s.recovery.clean
        phase_b = send_some(s, "b", 120)
        yield s, phase_a, phase_b


# --- tests -----------------------------------------------------------------------------


def test_clean_close_and_reopen_is_clean(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with MessageStore.open(path, CONFIG) as s:
        assert s.recovery.clean
        send_some(s, "m", 150)
        before = everything(s)
        keys = keys_of(s)
    for _ in range(2):
        with MessageStore.open(path, CONFIG) as s:
            report = s.recovery
            assert report.clean
            assert (report.cuts, report.problems, report.redispatched) == ([], [], 0)
            assert everything(s) == before
            assert keys_of(s) == keys


def test_crash_copy_without_damage_loses_nothing(
    two_phase: tuple[MessageStore, list[SendResult], list[SendResult]], tmp_path: Path
) -> None:
    store, _, _ = two_phase
    # Keys are read after copying; test_query_by_key_before_a_crash covers a query before
    # the crash (which commits pending keys early).
    copy = crash_copy(store, tmp_path / "copy")
    before, keys = everything(store), keys_of(store)
    with open_copy(copy) as s:
        assert s.recovery.cuts == []
        assert s.recovery.problems == []
        assert s.recovery.redispatched == 0
        assert everything(s) == before
        assert keys_of(s) == keys


@pytest.mark.parametrize("checkpoint", ["intact", "deleted", "garbled"])
def test_lost_queue_entries_are_redispatched(
    two_phase: tuple[MessageStore, list[SendResult], list[SendResult]],
    tmp_path: Path,
    checkpoint: str,
) -> None:
    store, phase_a, phase_b = two_phase
    # Keys are read after copying; test_query_by_key_before_a_crash covers a query before
    # the crash (which commits pending keys early).
    copy = crash_copy(store, tmp_path / "copy")
    before, keys = everything(store), keys_of(store)
    # With the checkpoint intact, only entries written after it can be missing.
    lost = 30 if checkpoint == "intact" else 70
    in_phase_b = min(sum(1 for r in phase_b if (r.topic, r.queue_id) == k) for k in before)
    # Without it, entries written before the checkpoint's position are lost too.
    assert (lost < in_phase_b) if checkpoint == "intact" else (lost > in_phase_b)
    zeroed = sum(zero_queue_tail(copy, t, q, lost) for t, q in before)
    assert zeroed >= 4 * 30
    if checkpoint == "deleted":
        (copy / "checkpoint.json").unlink()
    elif checkpoint == "garbled":
        flip_byte(copy / "checkpoint.json", 12)
    with open_copy(copy) as s:
        report = s.recovery
        assert report.redispatched == zeroed
        assert report.cuts == []
        if checkpoint == "garbled":
            assert len(report.problems) == 1
            assert "checkpoint.json" in report.problems[0]
        else:
            assert report.problems == []
        if checkpoint == "intact":
            assert 0 < report.start_position <= min(r.position for r in phase_b)
            assert report.start_position > max(r.position for r in phase_a)
        else:
            assert report.start_position == 0
        assert not report.clean
        assert everything(s) == before
        assert keys_of(s) == keys
        for (topic, q), messages in before.items():
            assert s.queue_range(topic, q) == (0, len(messages))
        more = s.send("t", b"after recovery", queue_id=2)
        assert more.queue_offset == len(before[("t", 2)])
    with open_copy(copy) as s:
        assert s.recovery.clean
        assert s.pull("t", 2, more.queue_offset).messages[0].body == b"after recovery"


def test_lost_last_queue_chunk_file(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with MessageStore.open(path, CONFIG) as s:
        s.create_topic("u", 1)
        results = [s.send("u", b"%d" % i) for i in range(500)]  # 2 queue chunks of 400
        before = everything(s)
        copy = crash_copy(s, tmp_path / "copy")
    queue_chunks = chunk_files(copy / "queues" / "u" / "0")
    assert len(queue_chunks) == 2
    queue_chunks[-1].unlink()
    (copy / "checkpoint.json").unlink()
    with open_copy(copy) as s:
        assert s.recovery.redispatched == 100
        assert everything(s) == before
        assert s.queue_range("u", 0) == (0, 500)
        assert s.send("u", b"next").queue_offset == 500
        assert s.get(results[450].message_id).body == b"450"


@pytest.mark.parametrize(
    "garbage",
    [
        pytest.param(b"\xff" * 64, id="ff"),
        pytest.param(b"\xde\xad\xbe\xef" * 50, id="deadbeef"),
        pytest.param(struct.pack("<I", 40) + b"\x01" * 30, id="short-frame"),
        pytest.param(
            struct.pack("<I", 20) + b"\x02" * 20 + b"\x00" * 4 + b"\x14\0\0\0", id="bad-sum"
        ),
    ],
)
def test_torn_message_log_tail_is_cut(
    two_phase: tuple[MessageStore, list[SendResult], list[SendResult]],
    tmp_path: Path,
    garbage: bytes,
) -> None:
    store, _, phase_b = two_phase
    # Keys are read after copying; test_query_by_key_before_a_crash covers a query before
    # the crash (which commits pending keys early).
    copy = crash_copy(store, tmp_path / "copy")
    before, keys = everything(store), keys_of(store)
    last = chunk_files(copy / "messages")[-1]
    end = frame_end(last)
    assert last.name == f"chunk-{phase_b[-1].position // CHUNK:012d}.0000"
    assert end == phase_b[-1].position % CHUNK + len(store.read(phase_b[-1].position).body) + (
        56 + 1 + 12
    )
    garbage = garbage[: CHUNK - end]
    data = bytearray(last.read_bytes())
    data[HEADER_SIZE + end : HEADER_SIZE + end + len(garbage)] = garbage
    last.write_bytes(bytes(data))
    with open_copy(copy) as s:
        report = s.recovery
        cuts = [c for c in report.cuts if Path(c.file) == last]
        assert len(cuts) == 1, report.cuts
        assert cuts[0].offset == HEADER_SIZE + end
        assert cuts[0].length == len(garbage.rstrip(b"\0"))
        assert Path(cuts[0].side_file).read_bytes() == garbage.rstrip(b"\0")
        assert all(Path(c.file).parent == copy / "messages" for c in report.cuts)
        assert everything(s) == before
        assert keys_of(s) == keys
        nxt = s.send("u", b"next", queue_id=0)
        assert nxt.position == (phase_b[-1].position // CHUNK) * CHUNK + end
    assert (last.read_bytes()[HEADER_SIZE + end : HEADER_SIZE + end + 4]) != garbage[:4]


def test_torn_last_record_removes_its_queue_entry(
    two_phase: tuple[MessageStore, list[SendResult], list[SendResult]], tmp_path: Path
) -> None:
    store, _, phase_b = two_phase
    before = everything(store)
    victim = phase_b[-2]  # the last message of topic "t"
    assert victim.topic == "t"
    victim_message = store.read(victim.position)
    copy = crash_copy(store, tmp_path / "copy")
    keys = {k: [m for m in ms if m.position != victim.position] for k, ms in keys_of(store).items()}
    last = chunk_files(copy / "messages")[-1]
    local = victim.position % CHUNK
    assert last.name == f"chunk-{victim.position // CHUNK:012d}.0000"
    flip_byte(last, HEADER_SIZE + local + 4 + 60)  # inside the payload: checksum mismatch
    with open_copy(copy) as s:
        report = s.recovery
        message_cuts = [c for c in report.cuts if Path(c.file) == last]
        assert [c.offset for c in message_cuts] == [HEADER_SIZE + local]
        queue_dir = copy / "queues" / "t" / str(victim.queue_id)
        assert any(Path(c.file).parent == queue_dir for c in report.cuts)
        after = everything(s)
        expected = dict(before)
        expected[("t", victim.queue_id)] = before[("t", victim.queue_id)][:-1]
        expected[("u", 0)] = before[("u", 0)][:-1]  # sent after the victim: cut too
        assert after == expected
        assert s.queue_range("t", victim.queue_id) == (0, victim.queue_offset)
        with pytest.raises(MessageNotFoundError):
            s.get(victim.message_id)
        assert keys_of(s) == keys
        # The freed offset and position are reused by the next message.
        again = s.send("t", b"replacement", queue_id=victim.queue_id)
        assert (again.queue_offset, again.position) == (victim.queue_offset, victim.position)
        assert s.pull("t", victim.queue_id, victim.queue_offset).messages[0].body == b"replacement"
    assert victim_message.body != b"replacement"
    with open_copy(copy) as s:
        assert s.recovery.clean


def test_each_cut_is_logged_once(
    two_phase: tuple[MessageStore, list[SendResult], list[SendResult]],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 20 item 20: the chunk layer logged each cut where it made it, and the store
    logged them all again. Control: a clean reopen logs no recovery line."""
    store, _, phase_b = two_phase
    copy = crash_copy(store, tmp_path / "copy")
    victim = phase_b[-2]
    flip_byte(chunk_files(copy / "messages")[-1], HEADER_SIZE + victim.position % CHUNK + 64)
    with caplog.at_level(logging.INFO, logger="equeue"), open_copy(copy) as s:
        cuts = s.recovery.cuts
    assert len(cuts) >= 2  # the log's tail and a queue's
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("recovery: ")]
    assert sorted(lines) == sorted(f"recovery: {cut}" for cut in cuts)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="equeue"), open_copy(copy) as s:
        assert s.recovery.clean
    assert not [r for r in caplog.records if "recovery" in r.getMessage()]


def test_key_index_after_a_log_cut(tmp_path: Path) -> None:
    path = tmp_path / "store"
    with MessageStore.open(path, CONFIG) as s:
        sent = [s.send("t", b"v%d" % i, key="k", queue_id=0) for i in range(5)]
    last = chunk_files(path / "messages")[-1]
    flip_byte(last, HEADER_SIZE + sent[-1].position % CHUNK + 4 + 60)
    with MessageStore.open(path, CONFIG) as s:
        assert s.recovery.cuts
        assert [m.body for m in s.query_by_key("t", "k")] == [b"v3", b"v2", b"v1", b"v0"]
        s.send("t", b"new", key="k", queue_id=0)
        assert [m.body for m in s.query_by_key("t", "k")] == [b"new", b"v3", b"v2", b"v1", b"v0"]


def test_query_by_key_before_a_crash(
    two_phase: tuple[MessageStore, list[SendResult], list[SendResult]], tmp_path: Path
) -> None:
    store, _, _ = two_phase
    keys = keys_of(store)  # commits phase B's keys to the index
    copy = crash_copy(store, tmp_path / "copy")
    with open_copy(copy) as s:
        assert keys_of(s) == keys


def json_body_span(path: Path) -> range:
    """Byte indexes of the file's body (between '"body": ' and '"xxh64"')."""
    raw = path.read_bytes()
    start = raw.index(b'"body": ') + len(b'"body": ')
    return range(start, raw.index(b'"xxh64"'))


@pytest.mark.parametrize("name", ["checkpoint.json", "offsets.json"])
def test_flipped_byte_in_metadata_is_reported(tmp_path: Path, name: str) -> None:
    path = tmp_path / "store"
    with MessageStore.open(path, CONFIG) as s:
        s.create_topic("u", 1)
        send_some(s, "m", 40)
        s.commit_offset("g", "t", 1, 3)
        before, keys = everything(s), keys_of(s)
    pristine = {n: (path / n).read_bytes() for n in ("checkpoint.json", "offsets.json")}
    target = path / name
    indexes = [0, 1, *json_body_span(target), len(pristine[name]) - 1]
    for index in indexes:
        for n, raw in pristine.items():
            (path / n).write_bytes(raw)
        flip_byte(target, index)
        with MessageStore.open(path, CONFIG) as s:
            problems = s.recovery.problems
            assert len(problems) == 1, (index, problems)
            assert name in problems[0]
            assert str(target) in problems[0]
            assert everything(s) == before
            assert keys_of(s) == keys
            expected_offset = None if name == "offsets.json" else 3
            assert s.committed_offset("g", "t", 1) == expected_offset
        moved = sorted((path / "recovered").glob(f"{name}.*.damaged"))
        assert moved, index
        assert moved[-1].read_bytes() != pristine[name]
        shutil.rmtree(path / "recovered")
    with MessageStore.open(path, CONFIG) as s:
        assert s.recovery.problems == []


@pytest.mark.parametrize("name", ["checkpoint.json", "offsets.json"])
def test_non_hex_hash_in_metadata_is_reported(tmp_path: Path, name: str) -> None:
    path = tmp_path / "store"
    with MessageStore.open(path, CONFIG) as s:
        s.send("t", b"x", queue_id=0)
        s.commit_offset("g", "t", 0, 1)
    doc: dict[str, Any] = json.loads((path / name).read_bytes())
    doc["xxh64"] = "z" + doc["xxh64"][1:]  # one flipped bit can turn a hex digit into a letter
    (path / name).write_text(json.dumps(doc, sort_keys=True))
    with MessageStore.open(path, CONFIG) as s:
        assert any(name in p for p in s.recovery.problems)
        assert s.pull("t", 0, 0).messages[0].body == b"x"


class _CountingSpeedups:
    """The C module, counting the records ``match_run`` confirmed."""

    def __init__(self, module: Any) -> None:
        self._module = module
        self.matched = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def match_run(self, *args: Any) -> tuple[int, int]:
        stop, matched = self._module.match_run(*args)
        self.matched += matched
        return stop, matched


def test_redispatch_in_c_decides_as_the_python_loop(
    two_phase: tuple[MessageStore, list[SendResult], list[SendResult]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Lost entries at the tails and a damaged entry mid-way (a tag hash differs, so its
    queue is cut there and rebuilt): C confirms the records whose entries are in place,
    hands the rest to the Python loop, and the outcome is the Python loop's own."""
    from equeue import speedups

    if speedups.SPEEDUPS is None:
        pytest.skip("the C accelerator is not built")
    store, _, phase_b = two_phase
    crashed = crash_copy(store, tmp_path / "crashed")
    before, keys = everything(store), keys_of(store)
    zero_queue_tail(crashed, "t", 1, 10)
    zero_queue_tail(crashed, "u", 0, 25)
    damaged = next(r for r in phase_b if (r.topic, r.queue_id) == ("t", 2))
    queue_chunk = chunk_files(crashed / "queues" / "t" / "2")[-1]
    first = int(queue_chunk.name.split("-")[1].split(".")[0]) * CONFIG.layout.queue_chunk_records
    flip_byte(queue_chunk, HEADER_SIZE + (damaged.queue_offset - first) * 12 + 8)  # tag hash
    outcomes = []
    counting = _CountingSpeedups(speedups.SPEEDUPS)
    for kind, module in (("c", counting), ("python", None)):
        copy = shutil.copytree(crashed, tmp_path / kind)
        with monkeypatch.context() as m:
            m.setattr(speedups, "SPEEDUPS", module)
            with open_copy(copy) as s:
                r = s.recovery
                cuts = [(Path(c.file).relative_to(copy), c.offset, c.length) for c in r.cuts]
                outcomes.append((r.redispatched, r.reindexed_keys, cuts, r.problems))
                assert everything(s) == before
                assert keys_of(s) == keys
    assert outcomes[0] == outcomes[1]
    redispatched, _, cuts, _ = outcomes[0]
    assert redispatched > 35 and len(cuts) == 1  # the tails, and t/2 from the damaged entry
    assert counting.matched > 50  # most records past the checkpoint were confirmed in C


def test_redispatch_in_c_follows_the_queue_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the checkpoint a queue's entries span several of its chunks (342 entries
    each, the fewest a chunk takes): C reads each from the chunk that holds it, not
    only from the last one, and the outcome is the Python loop's."""
    from equeue import speedups

    if speedups.SPEEDUPS is None:
        pytest.skip("the C accelerator is not built")
    config = replace(CONFIG, queue_chunk_records=342, flush="os")  # no checkpoint but open's
    with MessageStore.open(tmp_path / "store", config) as s:
        s.create_topic("u", 1)
        sent = [s.send("u", b"m%d" % i, key=f"k{i % 7}") for i in range(1100)]
        crashed = crash_copy(s, tmp_path / "crashed")
        before = everything(s)
    zero_queue_tail(crashed, "u", 0, 20)
    counting = _CountingSpeedups(speedups.SPEEDUPS)
    outcomes = []
    for kind, module in (("c", counting), ("python", None)):
        copy = shutil.copytree(crashed, tmp_path / kind)
        with monkeypatch.context() as m:
            m.setattr(speedups, "SPEEDUPS", module)
            with MessageStore.open(copy, config) as s:
                r = s.recovery
                outcomes.append((r.redispatched, r.reindexed_keys, r.cuts, r.problems))
                assert everything(s) == before
                assert [m.body for m in s.query_by_key("u", "k3", limit=1000)][-1] == b"m3"
    assert outcomes[0][:2] == outcomes[1][:2] == (20, len(sent))
    assert outcomes[0][2:] == outcomes[1][2:] == ([], [])
    assert counting.matched >= 1000  # entries in three queue chunks before the last


# --- the tail hint: recovery's scan starts at the checkpoint --------------------------


@pytest.mark.parametrize("checkpoint", ["with the log's tail", "written before it had one"])
def test_reopen_scans_the_log_from_the_checkpoint(
    tmp_path: Path, scan_starts: list[int], checkpoint: str
) -> None:
    from equeue.atomicfile import read_json, write_json
    from equeue.inspect.verify import verify_store

    starts = scan_starts
    path = tmp_path / "store"
    config = replace(CONFIG, chunk_data_size=64 * 1024)  # many records in the last chunk
    with MessageStore.open(path, config) as s:
        send_some(s, "m", 150)
        before, keys = everything(s), keys_of(s)
    body = read_json(path / "checkpoint.json")
    tail = body["log_tail"]
    assert tail["data_end"] > 0 and tail["records"] > 0
    if checkpoint == "written before it had one":
        del body["log_tail"]
        write_json(path / "checkpoint.json", body)
    starts.clear()
    with MessageStore.open(path, config) as s:
        assert starts == ([tail["data_end"]] if "log_tail" in body else [0])
        assert s.recovery.clean
        assert everything(s) == before
        assert keys_of(s) == keys
        send_some(s, "n", 400)  # completes the chunk it resumed: its footer counts it all
        assert s._messages.get_chunk_for(tail_position(path, tail)).is_completed
    assert verify_store(path) == []


def tail_position(path: Path, tail: dict[str, Any]) -> int:
    """The log position where a checkpoint's log tail says its chunk's records ended."""
    from equeue.format.chunk import ChunkHeader

    for chunk in chunk_files(path / "messages"):
        with open(chunk, "rb") as f:
            header = ChunkHeader.unpack(f.read(HEADER_SIZE))
        if header.chunk_id.hex == tail["chunk_id"]:
            return int(header.start_position + tail["data_end"])
    raise AssertionError(f"no chunk {tail['chunk_id']} in {path}")


def test_checkpoint_gives_no_log_tail_past_what_was_synced(tmp_path: Path) -> None:
    from equeue.atomicfile import read_json

    # After a crash the records recovery finds may be in the page cache only: the
    # checkpoint written at open must not name them as a tail the next open trusts
    # without walking them (a power loss could still take them).
    config = replace(CONFIG, chunk_data_size=64 * 1024, flush="os")
    with MessageStore.open(tmp_path / "store", config) as s:
        last = send_some(s, "m", 50)[-1]  # to topic "u": a 56-byte head, 1-byte topic
        copy = crash_copy(s, tmp_path / "copy")
    with MessageStore.open(copy, config) as c:
        assert "log_tail" not in read_json(copy / "checkpoint.json")
        c.flush()  # settles: an fdatasync covers what recovery found, now a tail is given
        tail = read_json(copy / "checkpoint.json")["log_tail"]
        assert tail_position(copy, tail) == last.position + len(c.read(last.position).body) + (
            56 + 1 + 12
        )
    with MessageStore.open(tmp_path / "store", config):
        # the control: the original closed cleanly, so its checkpoint has one
        assert read_json(tmp_path / "store" / "checkpoint.json")["log_tail"]["records"] > 0


@pytest.mark.parametrize("key_index", ["intact", "lost"])
def test_damage_before_the_log_tail_when_redispatch_must_read_it(
    tmp_path: Path, scan_starts: list[int], key_index: str
) -> None:
    # A record before the tail hint damaged (by the disk). With the key index intact,
    # re-dispatch starts at the checkpoint and the damage is left to reads. With the key
    # index lost, re-dispatch re-reads the log from the start: the chunk is scanned from
    # its first record as without a hint, and the damage is cut where that scan stops.
    path = tmp_path / "store"
    config = replace(CONFIG, chunk_data_size=64 * 1024)
    with MessageStore.open(path, config) as s:
        sent = send_some(s, "m", 150)
    last = chunk_files(path / "messages")[-1]
    number = int(last.name.split("-")[1].split(".")[0])
    in_last = [r.position for r in sent if r.position // (64 * 1024) == number]
    damaged = in_last[5]
    with MessageStore.open(path, config, read_only=True) as r:
        bodies = {p: r.read(p).body for p in in_last}
    flip_byte(last, HEADER_SIZE + damaged % (64 * 1024) + 4 + 60, 0x10)
    if key_index == "lost":
        (path / "keys.sqlite").unlink()
        for extra in path.glob("keys.sqlite-*"):
            extra.unlink()
    scan_starts.clear()
    with MessageStore.open(path, config) as s:
        cuts = s.recovery.cuts
        if key_index == "intact":
            assert len(scan_starts) == 1 and scan_starts[0] > damaged % (64 * 1024)
            assert cuts == []
            with pytest.raises(EQueueError, match="checksum"):
                s.read(damaged)
            assert s.read(in_last[6]).body == bodies[in_last[6]]
        else:
            assert scan_starts[0] > damaged % (64 * 1024) and scan_starts[1:] == [0]
            log_cuts = [c for c in cuts if Path(c.file).parent == path / "messages"]
            assert [(Path(c.file), c.offset) for c in log_cuts] == [
                (last, HEADER_SIZE + damaged % (64 * 1024))
            ]
            assert s.read(in_last[4]).body == bodies[in_last[4]]
            with pytest.raises(MessageNotFoundError):
                s.read(damaged)
