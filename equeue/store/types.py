"""What the store hands back: send results, messages, pull results."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import repeat
from typing import TYPE_CHECKING, NamedTuple, overload

from equeue import speedups


class SendResult(NamedTuple):
    """Where ``send`` stored a message (``send_batch`` returns one per message).

    ``message_id``: 24 hex digits (store id, log position), for ``get``;
    ``queue_id``/``queue_offset``: its place in the topic's queue, for ``pull``;
    ``position``: its byte position in the message log, for ``read``;
    ``stored_at``: seconds since the epoch (float, from the stored int64 nanoseconds).
    """

    message_id: str
    topic: str
    queue_id: int
    queue_offset: int
    position: int
    stored_at: float  # seconds since the epoch, as time.time()


# With the C accelerator, SendResult is its C type (equeue/cext/sendresult.c): the same
# fields, methods, equality, hash, repr and pickling, but not a tuple; the C send makes
# its id, ints and float when read. TupleSendResult stays the NamedTuple above either way.
TupleSendResult = SendResult
if not TYPE_CHECKING and speedups.SPEEDUPS is not None:
    # pickle finds a class by its module and __qualname__: this module's SendResult is the
    # C type here, so the NamedTuple is pickled by the name it has here (a pure process
    # binds TupleSendResult too). __name__ stays: the repr is the NamedTuple's.
    TupleSendResult.__qualname__ = "TupleSendResult"
    speedups.SPEEDUPS.send_result_doc(SendResult.__doc__)
    SendResult = speedups.SPEEDUPS.SendResult


class SendColumns(NamedTuple):
    """The SendResults of one batch to one topic as columns, in the messages' order (the
    broker's ``send_bodies`` answer): a list per field, no object per message."""

    topic: str
    message_ids: list[str]
    queue_ids: list[int]
    queue_offsets: list[int]
    positions: list[int]
    stored_at: list[float]

    def results(self) -> list[SendResult]:
        return list(
            map(SendResult, self.message_ids, repeat(self.topic), self.queue_ids,
                self.queue_offsets, self.positions, self.stored_at)
        )  # fmt: skip

    @classmethod
    def of(cls, topic: str, results: list[SendResult]) -> SendColumns:
        if not results:
            return cls(topic, [], [], [], [], [])
        ids, _, queue_ids, offsets, positions, stored = map(list, zip(*results, strict=True))
        return cls(topic, ids, queue_ids, offsets, positions, stored)


class Message(NamedTuple):
    """A stored message, as ``pull``, ``get``, ``read`` and ``query_by_key`` return it.

    ``key`` is None for a message sent without one; ``code`` is the sender's int;
    ``created_ns`` and ``stored_ns`` are int64 nanoseconds since the epoch, exact: when
    the message was made, and when it was appended to the log. ``created_at`` and
    ``stored_at`` are the same in float seconds (a float holds today's times to about
    240 ns), computed when asked for: a pull builds no float.
    """

    message_id: str
    topic: str
    queue_id: int
    queue_offset: int
    position: int
    tag: str
    key: str | None
    properties: dict[str, str]
    code: int
    body: bytes
    created_ns: int
    stored_ns: int

    @property
    def created_at(self) -> float:
        return self.created_ns / 1e9

    @property
    def stored_at(self) -> float:
        return self.stored_ns / 1e9


# With the C accelerator, Message is its C type (equeue/cext/message.c): the same
# fields, methods, equality, repr and pickling, but not a tuple; a pulled one makes its
# id, ints and empty properties dict when read, and is not tracked by the garbage
# collector until its properties dict is handed out. TupleMessage stays the NamedTuple
# above either way (messages of both compare equal and unpickle as each other).
TupleMessage = Message
if not TYPE_CHECKING and speedups.SPEEDUPS is not None:
    TupleMessage.__qualname__ = "TupleMessage"  # pickled by this name (as TupleSendResult)
    speedups.SPEEDUPS.message_doc(Message.__doc__)
    Message = speedups.SPEEDUPS.Message


class PullResult:
    """What ``pull`` returns: the messages, and ``next_offset``, the queue offset to pull
    from next (past the last message returned, or past entries the tag filter skipped).

    It is a sequence of its messages: ``len(result)``, ``for m in result``,
    ``result[0]``; an empty result is false, so ``while batch := store.pull(...)``
    stops when the queue has nothing more.
    """

    __slots__ = ("messages", "next_offset")

    def __init__(self, messages: list[Message], next_offset: int) -> None:
        self.messages = messages
        self.next_offset = next_offset

    def __len__(self) -> int:
        return len(self.messages)

    def __iter__(self) -> Iterator[Message]:
        return iter(self.messages)

    @overload
    def __getitem__(self, index: int) -> Message: ...
    @overload
    def __getitem__(self, index: slice) -> list[Message]: ...
    def __getitem__(self, index: int | slice) -> Message | list[Message]:
        return self.messages[index]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PullResult):
            return NotImplemented
        return self.messages == other.messages and self.next_offset == other.next_offset

    __hash__ = None  # type: ignore[assignment]  # (it holds a list)

    def __repr__(self) -> str:
        return f"PullResult({len(self.messages)} messages, next_offset={self.next_offset})"


class OutgoingMessage(NamedTuple):
    """One message of ``send_batch``."""

    body: bytes
    tag: str = ""
    key: str | None = None
    properties: dict[str, str] | None = None
    code: int = 0
    queue_id: int | None = None
