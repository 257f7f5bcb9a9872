"""topics.json's generation (equeue/format/topicsjson.py): it decides whether
topics.journal is replayed, so a damaged one is a CorruptionError naming the file and
the field, for a writable open, a read-only one, a consumer's read and ``equeue
verify``, and the store is left as it was; an undamaged store, a fold cut short (the
one legitimate older journal), and the heads older versions wrote open with nothing
reported."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import xxhash

from equeue import MessageStore, StoreConfig
from equeue.atomicfile import write_json
from equeue.cli import main
from equeue.errors import CorruptionError
from equeue.format.topicsjournal import TOPICS_JOURNAL_FILE, pack_header
from equeue.store import topicsfile
from equeue.store.meta import TOPICS_FILE

CONFIG = StoreConfig(flush="os", chunk_data_size=1 << 20, queue_chunk_records=1024)


def _store(path: Path) -> int:
    """ "a" in topics.json (folded at a clean close), "b" in the journal only (as after a
    crash); returns topics.json's generation, the journal's too."""
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("a", 2)
        store.send("a", b"m", queue_id=1)  # (a queue file: "a" can be rebuilt from it)
    store = MessageStore.open(path, CONFIG)
    try:
        store.create_topic("b", 1)
        store._topics_file.close_fd()  # no fold at the close: "b" stays in the journal
    finally:
        store.close()
    generation = topicsfile.file_generation(path / TOPICS_FILE)
    assert generation >= 1
    assert (path / TOPICS_JOURNAL_FILE).read_bytes()[: len(pack_header(generation))] == (
        pack_header(generation)
    )
    return generation


def _higher_digit(raw: bytearray, at: int) -> None:
    """Flip one bit of the digit at ``at`` so that it becomes a higher digit."""
    for bit in (1, 2, 4, 8):
        if chr(raw[at] ^ bit).isdigit() and raw[at] ^ bit > raw[at]:
            raw[at] ^= bit
            return
    raise AssertionError(f"no bit makes {chr(raw[at])!r} a higher digit")


def _damage(path: Path, kind: str) -> None:
    file = path / TOPICS_FILE
    raw = bytearray(file.read_bytes())
    if kind == "generation raised":  # the journal then looks folded in already
        _higher_digit(raw, raw.index(b'"generation": ') + len(b'"generation": '))
    elif kind == "generation key":
        raw[raw.index(b"generation")] ^= 0x01  # "fenaration": no generation at all
    elif kind == "generation past u64":  # crafted, with a checksum that matches
        big = 10**20 - 1
        check = f"{xxhash.xxh32_intdigest(b'generation %d' % big):08x}".encode()
        start = raw.index(b'"body": ')
        raw[:start] = b'{"generation": %d, "generation_xxh32": "%s", ' % (big, check)
    elif kind == "checksum":
        at = raw.index(b'"generation_xxh32": "') + len(b'"generation_xxh32": "')
        raw[at] = ord("0") if raw[at] != ord("0") else ord("1")
    else:
        raise AssertionError(kind)
    file.write_bytes(bytes(raw))


def _verify(path: Path) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(["verify", str(path)])
    return code, out.getvalue()


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.mark.parametrize(
    "kind", ["generation raised", "generation key", "checksum", "generation past u64"]
)
def test_a_damaged_generation_is_refused_naming_the_file_and_field(
    tmp_path: Path, kind: str
) -> None:
    """Before the check, "generation raised" opened with topics ["a"]: the journal's
    "b" skipped without a word."""
    _store(tmp_path)
    _damage(tmp_path, kind)
    before = _files(tmp_path)
    for read_only in (True, False):
        with pytest.raises(CorruptionError, match="field generation") as caught:
            MessageStore.open(tmp_path, CONFIG, read_only=read_only)
        assert caught.value.file == str(tmp_path / TOPICS_FILE)
        assert "restore topics.json, or move it out of the store" in str(caught.value)
        assert _files(tmp_path) == before  # refused: nothing written, moved or cut
    with pytest.raises(CorruptionError, match="field generation"):
        topicsfile.read_topics_body(tmp_path)  # (consumer commits read it so)
    code, output = _verify(tmp_path)
    assert code == 1 and "field generation" in output and TOPICS_FILE in output, output
    # the remedy the message gives: topics.json moved out, "a" rebuilt from its queue
    # directory (default policy, reported), "b" from the journal
    (tmp_path / TOPICS_FILE).rename(tmp_path.parent / "topics.json.damaged")
    with MessageStore.open(tmp_path, CONFIG) as store:
        assert store.topics() == ["a", "b"] and store.queue_ids("a") == [0, 1]
        assert any("rebuilt from the directories" in p for p in store.recovery.problems)


def test_control_an_undamaged_store_opens_with_nothing_reported(tmp_path: Path) -> None:
    generation = _store(tmp_path)
    head = (tmp_path / TOPICS_FILE).read_bytes()[:80]
    check = f"{xxhash.xxh32_intdigest(b'generation %d' % generation):08x}"
    assert head.startswith(
        b'{"generation": %d, "generation_xxh32": "%s", "body": ' % (generation, check.encode())
    )
    for read_only in (True, False):
        with MessageStore.open(tmp_path, CONFIG, read_only=read_only) as store:
            assert store.topics() == ["a", "b"]
            assert not store.recovery.problems and not store.recovery.cuts
    assert _verify(tmp_path)[0] == 0


def test_control_a_fold_cut_short_skips_the_older_journal_unreported(tmp_path: Path) -> None:
    """The one legitimate older journal: a crash between a fold's topics.json (the next
    generation, checksummed) and its fresh journal. Its records ("b" created) are in the
    file already and are not replayed; nothing is reported."""
    generation = _store(tmp_path)
    old = (tmp_path / TOPICS_JOURNAL_FILE).read_bytes()
    with MessageStore.open(tmp_path, CONFIG) as store:  # folds "b" in: generation + 1
        store.delete_topic("b")
        store._topics_file.close_fd()
        store._topics_file.write(*topicsfile.topics_state(store))  # the fold's topics.json
    (tmp_path / TOPICS_JOURNAL_FILE).write_bytes(old)  # ... and not its fresh journal
    assert topicsfile.file_generation(tmp_path / TOPICS_FILE) > generation
    for read_only in (True, False):
        with MessageStore.open(tmp_path, CONFIG, read_only=read_only) as store:
            assert store.topics() == ["a"] and "b" in store.deleted_topics()
            assert not store.recovery.problems and not store.recovery.cuts


@pytest.mark.parametrize("head", ["unchecked", "none"])
def test_heads_older_versions_wrote_are_read(tmp_path: Path, head: str) -> None:
    """The head the version before the checksum wrote ({"generation": N, "body": ...),
    and none (write_json's, an older equeue's) beside a journal of generation 0 (as the
    versions before this one began one beside it): read, the journal replayed over them
    when it is not older, and the next fold writes the checked head. (None beside a
    journal of generation 1 or more: test_topics_downgrade.py.)"""
    generation = _store(tmp_path)
    path = tmp_path / TOPICS_FILE
    body = json.loads(path.read_bytes())["body"]
    write_json(path, body)
    if head == "unchecked":
        path.write_bytes(b'{"generation": %d, ' % generation + path.read_bytes()[1:])
        assert topicsfile.file_generation(path) == generation
    else:
        assert topicsfile.file_generation(path) == 0
        journal = tmp_path / TOPICS_JOURNAL_FILE
        journal.write_bytes(pack_header(0) + journal.read_bytes()[len(pack_header(0)) :])
    with MessageStore.open(tmp_path, CONFIG, read_only=True) as reader:
        assert reader.topics() == ["a", "b"] and not reader.recovery.problems
    with MessageStore.open(tmp_path, CONFIG) as store:
        assert store.topics() == ["a", "b"] and not store.recovery.problems
    assert b'"generation_xxh32": ' in path.read_bytes()[:80]
