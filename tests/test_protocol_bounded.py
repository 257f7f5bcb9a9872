"""equeue/protocol/bounded.py: a request body's msgpack objects bounded in number, not
only each container's length (a frame of tiny nested objects decodes slowly and big)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from equeue.errors import LimitExceededError, ProtocolError
from equeue.protocol.bounded import PLAIN_BELOW, Refused, decode_request, max_objects
from equeue.protocol.frames import decode_body

SETTING = "max_objects (the test's)"


def _array(items: list[bytes]) -> bytes:
    return b"\xdd" + len(items).to_bytes(4, "big") + b"".join(items)


def nested_empty_arrays(outer: int, inner: int) -> bytes:
    return _array([_array([b"\x90"] * inner)] * outer)


def test_a_body_of_more_objects_than_the_bound_is_refused_naming_the_setting() -> None:
    body = nested_empty_arrays(40, 4000)  # 160 k objects in 160 KB, each array bounded
    assert len(decode_body(body, "peer", 5000, "s")) == 40  # every container within 5000
    with pytest.raises(ProtocolError) as refused:
        decode_request(body, "peer 7", 5000, "s", 100_000, SETTING)
    text = str(refused.value)
    assert text.startswith("peer 7: a request body of ") and "more than 100000" in text
    assert SETTING in text and "per request" in text


def test_maps_count_their_pairs() -> None:
    maps = msgpack.packb([{f"k{i}": {} for i in range(1000)} for _ in range(100)])
    assert len(maps) > PLAIN_BELOW
    with pytest.raises(ProtocolError, match="more than 100000 msgpack objects"):
        decode_request(maps, "peer", 5000, "s", 100_000, SETTING)
    assert len(decode_request(maps, "peer", 5000, "s", 400_000, SETTING)) == 100


def _batch(count: int) -> list[object]:
    return [
        1, "send_batch",
        {"topic": "t", "messages": [
            {"body": b"x" * 20, "key": "k", "tag": "t",
             "properties": {str(p): "v" for p in range(7)}}
            for _ in range(count)
        ]},
    ]  # fmt: skip


def test_a_batch_within_the_bound_decodes_as_decode_body_does() -> None:
    batch = _batch(4096)
    body = msgpack.packb(batch)
    assert len(body) > max(PLAIN_BELOW, max_objects(4096))  # the counted way
    assert decode_request(body, "p", 8192, "s", max_objects(4096), SETTING) == batch
    assert decode_body(body, "p", 8192, "s") == batch


def test_a_small_body_decodes_plain_and_malformed_ones_are_protocol_errors() -> None:
    small = nested_empty_arrays(10, 100)  # 1 k objects, fewer bytes than PLAIN_BELOW
    assert len(decode_request(small, "p", 5000, "s", 10, SETTING)) == 10  # cannot exceed
    body = msgpack.packb(_batch(4096))
    with pytest.raises(ProtocolError, match=r"not valid msgpack \(Unpack failed: incomplete input"):
        decode_request(body[:-1], "p", 8192, "s", max_objects(4096), SETTING)
    with pytest.raises(ProtocolError, match="no array or map may hold more than s"):
        decode_request(body, "p", 100, "s", max_objects(4096), SETTING)


@pytest.mark.parametrize("request_id", [1, 127, 128, 65536, 2**32, 2**64 - 1])
def test_a_request_past_the_bound_is_refused_with_its_id_to_answer(request_id: int) -> None:
    """A body of a request (its id leads it) past the bound: Refused, carrying the id and
    a LimitExceededError (the broker answers it and keeps the connection)."""
    batch = _batch(4096)
    batch[0] = request_id
    body = msgpack.packb(batch)
    with pytest.raises(Refused) as refused:
        decode_request(body, "p", 8192, "s", max_objects(4096) // 2, SETTING)
    assert refused.value.request_id == request_id
    assert isinstance(refused.value.error, LimitExceededError)
    assert "more than 65536 msgpack objects" in str(refused.value.error)
    assert SETTING in str(refused.value.error)


@pytest.mark.parametrize("head", [0, -1, "1", None, [1]])
def test_a_body_past_the_bound_without_a_request_id_is_a_protocol_error(head: object) -> None:
    batch = _batch(4096)
    batch[0] = head
    with pytest.raises(ProtocolError, match="more than 65536 msgpack objects"):
        decode_request(msgpack.packb(batch), "p", 8192, "s", max_objects(4096) // 2, SETTING)
    longer = msgpack.packb([*_batch(4096), "a fourth item"])  # not [id, op, args]
    with pytest.raises(ProtocolError, match="more than 65536 msgpack objects"):
        decode_request(longer, "p", 8192, "s", max_objects(4096) // 2, SETTING)


def _malformed(kind: str, pad: int) -> bytes:
    """A request body msgpack refuses for another reason than a count, ``pad`` bytes of
    bin inside it (past PLAIN_BELOW, decode_request takes its counted way)."""
    args: dict[Any, Any] = {"body": b"\x00" * pad, "tag": "AB"}
    if kind == "map key":
        args["properties"] = {1: "a"}
    whole: bytes = msgpack.packb([1, "send", args])
    if kind == "utf-8":  # the tag's 2 characters made 2 bytes that are not UTF-8
        return whole.replace(b"\xa2AB", b"\xa2\xff\xff")
    return whole[:-1] if kind == "incomplete" else whole


@pytest.mark.parametrize("kind", ["map key", "utf-8", "incomplete"])
def test_a_malformed_body_is_not_blamed_on_the_item_bound(kind: str) -> None:
    """Only a container past the bound names it: a non-str map key read "(int is not
    allowed for map key ...; no array or map may hold more than 131072 items ...)"."""
    decoders: list[Callable[[], object]] = [
        lambda: decode_body(_malformed(kind, 10), "p", 8192, "s"),
        lambda: decode_request(
            _malformed(kind, PLAIN_BELOW), "p", 8192, "s", max_objects(4096), SETTING
        ),
    ]
    for decode in decoders:
        with pytest.raises(ProtocolError, match="not valid msgpack") as info:
            decode()
        assert "may hold more than" not in str(info.value)
    with pytest.raises(ProtocolError, match="no array or map may hold more than s"):
        decode_body(msgpack.packb([[0] * 8193]), "p", 8192, "s")
