"""The streaming source's offsets (stream.py): ``{topic: {queue_id: next_offset}}`` with
queue ids as strings, as Spark keeps them as JSON in the query's checkpoint, and two
marks beside the topics: ``FROM`` (where a batch begins a queue other than at the start
offset) and ``DELETED`` (where each topic read was last deleted). Here: the marks, the
one order an offset serializes in, the check of an offset Spark hands back, and the
parse of a JSON ``startingOffsets`` (the batch source's ``endingOffsets`` too: offsets.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from equeue.digits import ascii_number
from equeue.errors import CorruptionError, SparkOptionError

Offsets = dict[str, dict[str, int]]  # topic -> queue id (a string) -> next offset
# In a batch's end offset: {topic: {queue: offset}} where the batch begins a queue other
# than at the start offset (a new queue, a topic created again, offsets retention took).
# Not a topic name: those are [A-Za-z0-9._-].
FROM: Final = "@from"
# In an offset: {topic: the log position of its last deletion} for the topics read that
# were ever deleted (the store's deleted_topics()). A topic whose position differs at the
# next planning was deleted and created again since: what the query read is gone, and the
# offsets are the new topic's (reviewj F1: a new topic already past them was read on from
# there, its first messages skipped). In every offset since 2026-11-27 (maybe empty);
# absent: an older version's offset, or a broker that cannot say (before protocol
# version 5): the topics are then taken as they are.
DELETED: Final = "@deleted"

EARLIEST: Final = -2
LATEST: Final = -1
_INT32_MAX: Final = (1 << 31) - 1  # the queue_id column is an int, queue_offset a long
_INT64_MAX: Final = (1 << 63) - 1


def offsets_json(text: str, option: str = "startingOffsets") -> dict[str, dict[str, int]]:
    """A JSON offsets option (``startingOffsets``; the batch source's ``endingOffsets``
    too): topic -> queue id (a string) -> offset, -2 the earliest, -1 the latest."""

    def bad(why: str) -> SparkOptionError:
        return SparkOptionError(
            f"option {option}={text!r}: {why}; it must be 'earliest', 'latest' or JSON "
            'like {"topic": {"0": 23, "1": -2}} (-2: the earliest offset, -1: the latest)'
        )

    try:
        parsed = json.loads(text)
    except (ValueError, RecursionError):
        raise bad("not JSON") from None
    if not isinstance(parsed, dict):
        raise bad("not a JSON object")
    out: dict[str, dict[str, int]] = {}
    for topic, queues in parsed.items():
        if not isinstance(queues, dict):
            raise bad(f"topic {topic!r} maps to {queues!r}, not to an object of queue ids")
        out[topic] = {}
        for queue, offset in queues.items():
            # ascii_number: isdigit() alone lets "²" through (a digit to Unicode, not to
            # int()), and int() refuses 4,301 digits (builtin ValueErrors)
            number = ascii_number(queue)
            if number is None or number > _INT32_MAX:
                raise bad(f"queue id {queue[:40]!r} of topic {topic!r} is not a queue number")
            if type(offset) is not int or not EARLIEST <= offset <= _INT64_MAX:
                raise bad(f"offset {offset!r} of {topic}/{queue} is not -2, -1 or an offset")
            out[topic][str(number)] = offset
    return out


def ordered(offsets: Mapping[str, Any]) -> dict[str, Any]:
    """``offsets`` with topics and queues in one order: Spark compares offsets as JSON text,
    so an unchanged offset must serialize the same."""
    out: dict[str, Any] = {
        t: {q: offsets[t][q] for q in sorted(offsets[t], key=int)}
        for t in sorted(offsets)
        if offsets[t] and t not in (FROM, DELETED)
    }
    if offsets.get(FROM):
        out[FROM] = ordered(offsets[FROM])
    if DELETED in offsets:
        out[DELETED] = dict(sorted(offsets[DELETED].items()))
    return out


def checked_offset(offset: object) -> dict[str, Any]:
    """An offset Spark hands back from the query's checkpoint, as this source writes it:
    topic -> {queue id: offset >= 0}, FROM the same, DELETED {topic: log position}. A
    hand-edited or foreign checkpoint is refused here, not met as a builtin TypeError
    later or a text mark taken for a re-creation (reviewl L7)."""

    def bad(why: str) -> CorruptionError:
        return CorruptionError(
            f"the query's checkpoint holds an offset this source did not write ({why}): "
            f"{json.dumps(offset, default=repr)[:200]}",
            remedy="restore the checkpoint, or start the query with a new checkpointLocation "
            "(startingOffsets applies then)",
        )

    def queues(topic: str, given: object) -> None:
        if not isinstance(given, dict):
            raise bad(f"topic {topic!r} maps to {given!r}, not to an object of queue ids")
        for queue, at in given.items():
            number = ascii_number(queue)  # (not int(): see offsets_json)
            if number is None or number > _INT32_MAX:
                raise bad(f"queue id {queue[:40]!r} of topic {topic!r} is not a queue number")
            if type(at) is not int or not 0 <= at <= _INT64_MAX:
                raise bad(f"offset {at!r} of {topic}/{queue} is not an offset")

    if not isinstance(offset, dict):
        raise bad("not a JSON object")
    for topic, given in offset.items():
        if topic == DELETED:
            if not isinstance(given, dict) or not all(
                type(mark) is int and 0 <= mark <= _INT64_MAX for mark in given.values()
            ):
                raise bad(f"{DELETED} must map topics to log positions, not {given!r}")
        elif topic == FROM:
            if not isinstance(given, dict):
                raise bad(f"{FROM} must map topics to queue offsets, not {given!r}")
            for moved, at in given.items():
                queues(moved, at)
        else:
            queues(topic, given)
    return offset


def deleted_of(offsets: Mapping[str, Any], topic: str) -> int | None:
    """Where ``topic`` was last deleted as ``offsets`` has it: -1 never, None not known."""
    marks = offsets.get(DELETED)
    return None if marks is None else marks.get(topic, -1)
