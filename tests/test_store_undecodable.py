"""A message record whose frame checksum is intact but whose topic, tag or key bytes are
not UTF-8 (a crafted or mis-written chunk; reviewd F2): `get` and `pull` raise
CorruptionError naming the chunk file and the record's position (as MessageLogRecord.unpack
does; not MessageNotFoundError, which `get` makes of a CorruptRecordError), on the C accelerator
(whose decode hands such a record to the Python one) and on the pure-Python paths alike,
not a builtin UnicodeDecodeError; the store stays readable before and after it."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from code_paths import code_path  # noqa: F401 - the fixture

from equeue import MessageStore, StoreConfig
from equeue.errors import CorruptionError, MessageNotFoundError
from equeue.format.chunk import HEADER_SIZE, record_checksum
from equeue.format.message import MESSAGE_HEAD_SIZE

pytestmark = pytest.mark.usefixtures("code_path")

# field -> (its bytes' offset after the head, given its topic and tag lengths)
FIELDS: dict[str, Callable[[int, int], int]] = {
    "topic": lambda tl, gl: 0,
    "tag": lambda tl, gl: tl,
    "key": lambda tl, gl: tl + gl,
}


def _damage(chunk: Path, record: int, field: str) -> None:
    """The record's first two bytes of `field` made b"\\xc3(" (no UTF-8), its checksum
    rewritten to match."""
    data = bytearray(chunk.read_bytes())
    p = HEADER_SIZE
    for _ in range(record):  # (length, payload, checksum, length again)
        p += 4 + struct.unpack_from("<I", data, p)[0] + 8
    size = struct.unpack_from("<I", data, p)[0]
    payload = bytearray(data[p + 4 : p + 4 + size])
    at = MESSAGE_HEAD_SIZE + FIELDS[field](payload[45], payload[46])
    payload[at : at + 2] = b"\xc3("
    data[p + 4 : p + 4 + size] = payload
    struct.pack_into("<I", data, p + 4 + size, record_checksum(bytes(payload)))
    chunk.write_bytes(bytes(data))


@pytest.mark.parametrize("field", sorted(FIELDS))
def test_a_record_not_utf8_is_reported_as_corrupt(tmp_path: Path, field: str) -> None:
    home = tmp_path / "s"
    with MessageStore.open(home, StoreConfig(flush="async")) as store:
        store.create_topic("tt", 1)
        before = store.send("tt", b"before", tag="g0", key="k0")
        damaged = store.send("tt", b"damaged", tag="g1", key="k1")
        after = store.send("tt", b"after", tag="g2", key="k2")
    chunk = sorted(home.rglob("chunk-*"))[0]  # (the message log's first)
    _damage(chunk, 1, field)
    with MessageStore.open(home, StoreConfig(flush="async")) as store:
        assert store.get(before.message_id).body == b"before"
        assert store.get(after.message_id).body == b"after"
        for call in (
            lambda: store.get(damaged.message_id),
            lambda: store.pull("tt", 0, 0, 10),
            lambda: store.pull("tt", 0, 1, 1),
        ):
            with pytest.raises(CorruptionError) as raised:
                call()
            assert not isinstance(raised.value, MessageNotFoundError)
            assert raised.value.file == str(chunk)
            assert f"position {damaged.position}" in str(raised.value)
            assert "UTF-8" in str(raised.value)
        assert [m.body for m in store.pull("tt", 0, 2, 10).messages] == [b"after"]
