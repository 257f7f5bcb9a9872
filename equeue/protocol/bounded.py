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
"""

from __future__ import annotations

from typing import Any, Final

import msgpack

from equeue.errors import ProtocolError
from equeue.protocol.frames import decode_body

# Objects per message of a full send_batch: its place in the batch (1), its map of
# send's 7 arguments (15), a properties map of 7 entries (15), and the request's own.
OBJECTS_PER_MESSAGE: Final = 32
PLAIN_BELOW: Final = 64 * 1024  # bytes: a body this small is decoded without counting


def max_objects(max_batch_messages: int) -> int:
    """The bound on the objects of one request body for a broker's max_batch_messages."""
    return OBJECTS_PER_MESSAGE * max_batch_messages


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
    """frames.decode_body, and ProtocolError naming ``objects_setting`` once the body
    holds more than ``objects`` msgpack objects (arrays and maps count their items and
    themselves), stopping there."""
    if len(payload) <= max(PLAIN_BELOW, objects):
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
        raise ProtocolError(
            f"{where}: a frame body of {len(payload)} bytes holds more than {objects} "
            f"msgpack objects, the most a request may ({objects_setting})"
        ) from None
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ProtocolError(f"{where}: the frame body is not one msgpack object ({exc})") from exc
    except (ValueError, TypeError, UnicodeDecodeError) as exc:
        limit = f"; no array or map may hold more than {setting}" if setting else ""
        raise ProtocolError(f"{where}: the frame body is not valid msgpack ({exc}{limit})") from exc
