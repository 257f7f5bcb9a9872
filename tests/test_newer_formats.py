"""A file of a newer equeue (its own checks hold, its format version is above the one
this library reads) is refused as newer, never taken for damage (review i F4, F5): the
same NewerFormatError for topics.journal, a queue chunk, a message chunk and store.json,
by both opens, with nothing moved, rebuilt or rewritten; ``equeue rebuild-topics``
refuses a newer journal; ``equeue verify`` reports the file once and derives nothing
from it. The files are built with the format modules' own ``pack()``, the version bumped
and the checksum redone."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import struct
from pathlib import Path

import pytest
import xxhash
from store_helpers import snapshot

from equeue import MessageStore, StoreConfig
from equeue.atomicfile import write_json
from equeue.cli import main
from equeue.errors import ConfigError, CorruptionError, NewerFormatError
from equeue.format.chunk import FORMAT_VERSION, HEADER_SIZE, ChunkHeader
from equeue.format.topicsjournal import TOPICS_JOURNAL_FILE, VERSION, pack_header
from equeue.store.offsets import file_name

CONFIG = StoreConfig(flush="os", chunk_data_size=1 << 20, queue_chunk_records=1024)


def _run(*args: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(list(args))
    return code, out.getvalue()


def _store(path: Path, *, crash: bool = False) -> None:
    """Topic a (2 queues, 10 messages); with ``crash`` b is in the journal only."""
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("a", 2)
        for i in range(10):
            store.send("a", b"m%d" % i, queue_id=i % 2)
    if crash:
        store = MessageStore.open(path, CONFIG)
        store.create_topic("b", 1)
        store._topics_file.close_fd()  # (no fold at the close: as after a crash)
        store.close()


def _newer_journal(path: Path) -> Path:
    journal = path / TOPICS_JOURNAL_FILE
    raw = bytearray(journal.read_bytes())
    header = bytearray(pack_header(struct.unpack_from("<Q", raw, 12)[0]))
    struct.pack_into("<I", header, 8, VERSION + 1)
    struct.pack_into("<I", header, 20, xxhash.xxh32_intdigest(bytes(header[:20])))
    journal.write_bytes(bytes(header) + bytes(raw[len(header) :]))
    return journal


def _newer_chunk(path: Path) -> None:
    raw = path.read_bytes()
    header = ChunkHeader.unpack(raw[:HEADER_SIZE], file=str(path))
    newer = dataclasses.replace(header, version=FORMAT_VERSION + 1)  # a valid checksum
    path.write_bytes(newer.pack() + raw[HEADER_SIZE:])


def _assert_refused(path: Path, file: Path, what: str) -> None:
    before = snapshot(path)
    for read_only in (True, False):
        with pytest.raises(NewerFormatError) as raised:
            MessageStore.open(path, CONFIG, read_only=read_only).close()
        error = raised.value
        assert not isinstance(error, CorruptionError) and isinstance(error, ConfigError)
        assert error.file == str(file) and what in str(error)
        assert "written by a newer equeue" in str(error) and "rebuild" not in str(error)
        assert snapshot(path) == before  # nothing moved to recovered/, nothing rebuilt
    code, out = _run("verify", str(path))
    assert code == 1 and out.count("newer format") == 1 and "1 problem found" in out, out
    assert snapshot(path) == before


@pytest.mark.parametrize("crash", [False, True])
def test_a_newer_topics_journal_is_refused_as_newer_and_not_rebuilt(
    tmp_path: Path, crash: bool
) -> None:
    """Seen failing before the fix: refused as a CorruptionError with the rebuild-topics
    remedy (and, in the reviewer's run, rebuild-topics replayed its records with version
    2's layout and wrote a version-2 journal over it, exit 0)."""
    _store(tmp_path, crash=crash)
    journal = _newer_journal(tmp_path)
    _assert_refused(tmp_path, journal, f"topics journal format version {VERSION + 1}")
    before = snapshot(tmp_path)
    code, out = _run("rebuild-topics", str(tmp_path))
    assert code != 0 and f"version {VERSION + 1}" in out and "newer equeue" in out, out
    assert snapshot(tmp_path) == before


def test_a_newer_queue_chunk_is_refused_and_not_rebuilt(tmp_path: Path) -> None:
    """Seen failing before the fix: refused as a CorruptionError whose remedy is the
    rebuild (and the writable open moved the chunk to recovered/ as damaged and rebuilt
    the queue in version 1, the reviewer's run)."""
    _store(tmp_path)
    chunk = next((tmp_path / "queues" / "a" / "0").glob("chunk-*"))
    _newer_chunk(chunk)
    _assert_refused(tmp_path, chunk, f"chunk format version {FORMAT_VERSION + 1}")


def test_a_newer_message_chunk_is_reported_once_by_verify(tmp_path: Path) -> None:
    """Seen failing before the fix: refused as a CorruptionError (and verify derived a log
    end below the checkpoint and queue entries "into a damaged header" from it: 4
    problems, the reviewer's run)."""
    _store(tmp_path)
    chunk = next((tmp_path / "messages").glob("chunk-*"))
    _newer_chunk(chunk)
    _assert_refused(tmp_path, chunk, f"chunk format version {FORMAT_VERSION + 1}")


def test_control_the_current_versions_open_and_verify(tmp_path: Path) -> None:
    _store(tmp_path, crash=True)
    assert _run("verify", str(tmp_path))[0] == 0
    with MessageStore.open(tmp_path, CONFIG, read_only=True) as store:
        assert store.topics() == ["a", "b"]


def _with_format(path: Path, found: int) -> None:
    """The metadata document at ``path`` marked ``"format": found`` beside its body and
    checksum (equeue/atomicfile.py), as a later equeue that changed the body would."""
    doc = json.loads(path.read_bytes())
    path.write_bytes(json.dumps(doc | {"format": found}, sort_keys=True).encode())


@pytest.mark.parametrize("name", ["topics.json", "checkpoint.json", "offsets.json", "group"])
def test_a_newer_metadata_document_is_refused_as_newer(tmp_path: Path, name: str) -> None:
    """Seen failing before the fix: the field was ignored and the body read as this
    version's (the opens succeeded)."""
    _store(tmp_path)
    with MessageStore.open(tmp_path, CONFIG) as store:
        store.commit_offset("billing", "a", 0, 3)
    if name == "group":
        (tmp_path / "consumers").mkdir(exist_ok=True)
        file = tmp_path / "consumers" / file_name("cg")
        write_json(file, {"group": "cg", "offsets": {"a": {"0": 2}}})
    else:
        file = tmp_path / name
    for found in (1, 2):
        _with_format(file, found)
        if found == 1:  # control: the format this version writes (implicitly) opens
            with MessageStore.open(tmp_path, CONFIG, read_only=True) as store:
                assert store.topics() == ["a"]
            continue
        before = snapshot(tmp_path)
        for read_only in (True, False):
            with pytest.raises(NewerFormatError) as raised:
                MessageStore.open(tmp_path, CONFIG, read_only=read_only).close()
            assert raised.value.file == str(file) and "metadata format 2" in str(raised.value)
            assert snapshot(tmp_path) == before  # nothing set aside as damaged
