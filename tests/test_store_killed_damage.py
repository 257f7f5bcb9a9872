"""A killed store with one damaged record in a completed log chunk written after the
checkpoint: re-dispatch meets it, and the writable open must still succeed.

A child (tests/store_kill_child.py, mode ``killed``) sends to t/0 and t/1 after the
open's checkpoint and SIGKILLs itself; one record of a completed chunk is then damaged
(a bit of its body flipped, or its frame length changed). The open reports that one
record (file and offset) in ``store.recovery.problems``; reading it raises an equeue
error naming it; every other acknowledged message reads back exactly; each queue's
next offset stays past everything acknowledged; ``equeue verify`` exits 1; the next
open is clean. Control: the same kill, no damage.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from code_paths import code_path  # noqa: F401 - the fixture
from store_helpers import error_locations, locations
from store_kill_child import TAIL, body, config, run_child

from equeue import MessageStore
from equeue.cli import main as cli_main
from equeue.errors import CorruptRecordError, EQueueError
from equeue.format.chunk import FRAME_PREFIX_SIZE, HEADER_SIZE
from equeue.format.message import QUEUE_RECORD_SIZE

CHUNK = 4096
SENT = 200  # alternately to t/0 and t/1, then TAIL more to t/1


def killed_store(path: Path) -> list[tuple[int, int, int]]:
    outcome = run_child(path, "killed", SENT)
    assert outcome.killed
    acks = outcome.acknowledged()
    assert len(acks) == SENT + TAIL
    return acks


def flip(path: Path, position: int, within: int) -> tuple[Path, int]:
    """Flip one bit ``within`` bytes into the frame at ``position``; (file, frame offset)."""
    chunk = path / "messages" / f"chunk-{position // CHUNK:012d}.0000"
    frame = HEADER_SIZE + position % CHUNK
    data = bytearray(chunk.read_bytes())
    data[frame + within] ^= 0x10
    chunk.write_bytes(bytes(data))
    return chunk, frame


def reads_back(store: MessageStore, acks: list[tuple[int, int, int]], skip: set[int]) -> None:
    """Every acknowledged message but those at ``skip`` (positions) pulls and reads exactly."""
    for i, (queue_id, offset, position) in enumerate(acks):
        if position in skip:
            continue
        [m] = store.pull("t", queue_id, offset, max_count=1).messages
        assert (m.queue_offset, m.position, m.body) == (offset, position, body(i))
        assert store.read(position).body == body(i)
    for queue_id in (0, 1):
        end = 1 + max(offset for q, offset, _ in acks if q == queue_id)
        assert store.queue_range("t", queue_id) == (0, end)


def verify_exit(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli_main(["verify", str(path), "--json"])
    return code, capsys.readouterr().out


# Which acknowledged message is damaged, and where in its frame: its body, the last
# message of t/0 (no later record of its queue vouches for its entry), its length, or
# the last message of t/0 whose queue entry is lost as well.
CASES = {
    "body": (SENT // 2, 80),
    "last of its queue": (SENT - 2, 80),
    "frame length": (SENT // 2, 1),
    "entry lost too": (SENT - 2, 80),  # and its queue entry zeroed: re-added from the head
}


@pytest.mark.usefixtures("code_path")
@pytest.mark.parametrize("case", CASES)
def test_a_damaged_record_after_the_checkpoint_does_not_refuse_the_open(
    tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """On both re-dispatch paths: the C matcher stops at the record, the Python loop
    meets it either way."""
    path = tmp_path / "store"
    acks = killed_store(path)
    index, within = CASES[case]
    queue_id, offset, position = acks[index]
    last_chunk = max(p for _, _, p in acks) // CHUNK
    assert position // CHUNK < last_chunk  # in a completed chunk
    file, frame = flip(path, position, within)
    if case == "entry lost too":
        entries = path / "queues" / "t" / str(queue_id) / "chunk-000000000000.0000"
        data = bytearray(entries.read_bytes())
        at = HEADER_SIZE + offset * QUEUE_RECORD_SIZE
        assert any(data[at : at + QUEUE_RECORD_SIZE]) and not any(data[at + QUEUE_RECORD_SIZE :])
        data[at : at + QUEUE_RECORD_SIZE] = bytes(QUEUE_RECORD_SIZE)
        entries.write_bytes(bytes(data))
    with MessageStore.open(path, config()) as store:
        [problem] = store.recovery.problems
        assert ("re-added" in problem) == (case == "entry lost too"), problem
        assert (file, frame) in locations(problem), problem
        assert not store.recovery.cuts
        with pytest.raises(CorruptRecordError) as pulled:
            store.pull("t", queue_id, offset, max_count=1)
        assert (file, frame) in error_locations(pulled.value)
        with pytest.raises(EQueueError):
            store.read(position)
        reads_back(store, acks, {position})
    code, out = verify_exit(path, capsys)
    assert code == 1 and str(file) in out, out[:2000]
    with MessageStore.open(path, config()) as store:
        assert store.recovery.clean, store.recovery  # reported once, by the first open
        reads_back(store, acks, {position})
        end = store.queue_range("t", queue_id)[1]
        assert store.send("t", b"next", queue_id=queue_id).queue_offset == end


def test_control_the_same_kill_without_damage(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "store"
    acks = killed_store(path)
    with MessageStore.open(path, config()) as store:
        assert store.recovery.problems == [] and store.recovery.cuts == []
        reads_back(store, acks, set())
    code, out = verify_exit(path, capsys)
    assert code == 0, out[:2000]
    assert json.loads(out)["problems"] == []


def test_the_damage_cases_hit_what_they_say(tmp_path: Path) -> None:
    """The frame-length case changes the length prefix; the others a body byte."""
    assert CASES["frame length"][1] < FRAME_PREFIX_SIZE
    acks = killed_store(tmp_path / "store")
    index, _ = CASES["last of its queue"]
    queue_id = acks[index][0]
    assert all(q != queue_id for q, _, _ in acks[index + 1 :])
