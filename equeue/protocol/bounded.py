"""A request body decoded with the number of msgpack objects bounded, not only each
array's and map's length (frames.decode_body's ``max_items``).

Why: a frame of tiny objects costs the decoder per object, not per byte. Measured on
this machine (CPU time, msgpack 1.x, every container bounded to 131072 items): a
64 MiB frame of empty arrays took 20 s and 5 GB to decode, of nils 0.9 s; an 8 MiB
one of empty arrays 1.4 s. Bounding each container does not help: arrays of arrays
nest. Here every array and map counts its items as it is built (``list_hook``,
``object_hook``), and past ``max_objects`` the decoding stops: the 64 MiB frame of empty
arrays is refused after about 0.45 s and 250 MB at the default bound, of nils after
about 30 ms.

A body of at most ``PLAIN_BELOW`` bytes holds at most that many objects (each takes a
byte at least), so it is decoded plain: the hooks cost about 0.1 us per map or array
(about 30 % of the decoding of a batch of small messages), paid by large frames only.

The bound is per request, not per message: a batch of fewer messages with more
properties each reaches it too (``message_objects``; the clients count a send_batch so
before sending it). A body past it that begins as a request does (``[id, ...``) is
answered LimitExceededError with that id, and its connection stays (``Refused``): the
frame was read whole, and the request id is read from the body's first bytes. A body
that does not (no id to answer) is a ProtocolError that closes the connection.
"""

from __future__ import annotations

from typing import Any, Final

import msgpack

from equeue.errors import LimitExceededError, ProtocolError
from equeue.protocol.frames import CONNECTION_REQUEST_ID, decode_body, not_valid

# Objects per message of a full send_batch: its place in the batch (1), its map of
# send's 7 arguments (15), a properties map of 7 entries (15), and the request's own.
OBJECTS_PER_MESSAGE: Final = 32
PLAIN_BELOW: Final = 64 * 1024  # bytes: a body this small is decoded without counting
# A send_batch request's own objects: [id, op, args] (4), the args map of topic and
# messages (5), the messages' array (1).
SEND_BATCH_OBJECTS: Final = 10
# Bytes enough for a request's head: an array header and a request id of up to 9 bytes.
_HEAD_BYTES: Final = 10


def max_objects(max_batch_messages: int) -> int:
    """The bound on the objects of one request body for a broker's max_batch_messages."""
    return OBJECTS_PER_MESSAGE * max_batch_messages


def counted_above(objects: int) -> int:
    """The body size past which a request's objects are counted (against ``objects``):
    a body of fewer bytes cannot hold more objects (each takes a byte at least)."""
    return max(PLAIN_BELOW, objects)


def message_objects(fields: dict[str, Any]) -> int:
    """The msgpack objects of one send_batch message's wire map as decode_request counts
    them: its place in the messages' array, the map's keys and values and itself, and its
    properties map's entries and itself (7 + 2 a property for a body with properties)."""
    properties = fields.get("properties")
    return 2 + 2 * len(fields) + (2 * len(properties) + 1 if type(properties) is dict else 0)


def objects_refused(size: int, objects: int, setting: str) -> str:
    """What a request body of ``size`` bytes past ``objects`` is told, naming the bound's
    ``setting``: the bound is per request, not per message."""
    return (
        f"a request body of {size} bytes holds more than {objects} msgpack objects (arrays "
        f"and maps count their items), the most one request past {counted_above(objects)} "
        f"bytes may hold: the bound is per request ({setting}), {OBJECTS_PER_MESSAGE} a "
        "message of a full batch (12 properties with a body alone); send messages of many "
        "properties in smaller batches (send_many splits them)"
    )


class Refused(Exception):
    """A request body past the object bound whose request id leads it: answered ``error``
    with that id, the connection kept (the frame was read whole, so the next one starts
    where it ends; the decoder stopped at the bound either way). Caught by the broker's
    connection, never raised to a client."""

    def __init__(self, request_id: int, error: LimitExceededError) -> None:
        super().__init__(str(error))
        self.request_id = request_id
        self.error = error


class _TooMany(Exception):
    pass


def decode_request(
    payload: bytes | memoryview,
    where: str,
    max_items: int,
    setting: str,
    objects: int,
    objects_setting: str,
) -> Any:
    """frames.decode_body, stopping once the body holds more than ``objects`` msgpack
    objects (arrays and maps count their items and themselves): Refused naming
    ``objects_setting`` when a request id leads the body, else ProtocolError."""
    if len(payload) <= counted_above(objects):
        return decode_body(payload, where, max_items, setting)
    count = 0

    def counted_list(value: list[Any]) -> list[Any]:
        nonlocal count
        count += len(value) + 1
        if count > objects:
            raise _TooMany
        return value

    def counted_map(value: dict[Any, Any]) -> dict[Any, Any]:
        nonlocal count
        count += 2 * len(value) + 1
        if count > objects:
            raise _TooMany
        return value

    try:
        return msgpack.unpackb(
            payload, raw=False, strict_map_key=True, use_list=True,
            max_array_len=max_items, max_map_len=max_items,
            list_hook=counted_list, object_hook=counted_map,
        )  # fmt: skip
    except _TooMany:
        text = f"{where}: {objects_refused(len(payload), objects, objects_setting)}"
        request_id = _leading_request_id(payload)
        if request_id is None:
            raise ProtocolError(text) from None
        raise Refused(request_id, LimitExceededError(text)) from None
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ProtocolError(f"{where}: the frame body is not one msgpack object ({exc})") from exc
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        raise not_valid(exc, where, setting) from exc


def _leading_request_id(payload: bytes | memoryview) -> int | None:
    """The request id of a body that begins as a request does (an array of 3 whose first
    item is a uint > 0), read from its first bytes alone; None for any other beginning."""
    head = msgpack.Unpacker(raw=False)
    head.feed(payload[:_HEAD_BYTES])
    try:
        if head.read_array_header() != 3:
            return None
        request_id = head.unpack()
    except (msgpack.OutOfData, msgpack.FormatError, msgpack.StackError, ValueError):
        return None
    if type(request_id) is int and request_id > CONNECTION_REQUEST_ID:
        return request_id
    return None
