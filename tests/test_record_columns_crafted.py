"""record_columns (equeue/cext/arrowcols.c, the Spark source's columns) against
record_columns_py (equeue/spark/columns.py) on the same crafted records: every field
length, flags with and without FLAG_HAS_KEY whatever the key length (a record whose key
length is set without the flag: a mis-written or crafted chunk whose checksum holds;
reviewd F1, where C sized key_data by the length and handed out uninitialised heap
bytes), properties present or not. The same bytes, column by column."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from equeue import speedups
from equeue.format.chunk import record_checksum
from equeue.format.message import FLAG_HAS_KEY, pack_message
from equeue.spark.columns import record_columns_py

fast = speedups.SPEEDUPS
pytestmark = pytest.mark.skipif(fast is None, reason="needs the C accelerator")

short = st.binary(max_size=255)
records = st.lists(
    st.tuples(
        st.integers(0, 255),  # flags (FLAG_HAS_KEY among them, or not)
        short,  # topic
        short,  # tag
        short,  # key: its length is written whatever the flags say
        st.binary(max_size=40),  # properties (bytes only: columns does not decode them)
        st.binary(max_size=40),  # body
        st.integers(0, 2**31 - 1),  # queue id
        st.integers(0, 2**63 - 1),  # queue offset
    ),
    min_size=1,
    max_size=12,
)


def _frames(
    given_records: list[tuple[int, bytes, bytes, bytes, bytes, bytes, int, int]],
) -> tuple[bytes, bytes]:
    """The records framed as a chunk holds them (length, payload, checksum, length), and
    their offsets packed as record_columns takes them."""
    buf = bytearray()
    offsets: list[int] = []
    for flags, topic, tag, key, props, body, qid, qoff in given_records:
        payload = pack_message(
            len(buf), 1_000_000_123, 2_000_000_456, qoff, qid, 0, 0, flags, topic, tag, key,
            props, body,
        )  # fmt: skip
        offsets.append(len(buf))
        buf += struct.pack("<I", len(payload)) + payload
        buf += struct.pack("<II", record_checksum(payload), len(payload))
    return bytes(buf), struct.pack(f"<{len(offsets)}q", *offsets)


def _check(given_records: list[tuple[int, bytes, bytes, bytes, bytes, bytes, int, int]]) -> None:
    assert fast is not None
    buf, offsets = _frames(given_records)
    junk = [b"\xab" * 4000 for _ in range(20)]  # (freed heap bytes for C to hand out)
    del junk
    got = fast.record_columns(buf, offsets, "0badcafe")
    want = record_columns_py(buf, offsets, "0badcafe")
    assert len(got) == len(want)
    for column, (c, py) in enumerate(zip(got, want, strict=True)):
        assert c == py, f"column {column}"


def test_a_key_length_without_the_key_flag_gives_no_key_bytes() -> None:
    # reviewd F1's repro: 16 records of a 250-byte key length, FLAG_HAS_KEY clear
    _check([(0, b"t", b"", b"K" * 250, b"", b"body", 1, i) for i in range(16)])
    _check([(FLAG_HAS_KEY if i % 2 else 0, b"t", b"g", b"K" * 9, b"", b"", 1, i) for i in range(9)])


@settings(max_examples=300, deadline=None)
@given(records)
def test_c_and_python_give_the_same_columns(
    given_records: list[tuple[int, bytes, bytes, bytes, bytes, bytes, int, int]],
) -> None:
    _check(given_records)
