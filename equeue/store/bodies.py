"""send_batch of plain bodies: bytes alone, no tag, key, properties, code or queue id.

The broker's ``send_bodies`` and ``send_batch(topic, [bytes, ...])``. All bodies are
checked before any is written (as any batch); then, under the write lock, each run of
bodies that fits the current log chunk and queue chunks is framed, entered and
published by one C call (``Sender.append_bodies``, equeue/cext/batch.c), and a body
that needs a chunk completed, created or reserved goes through ``Appender.append`` as a
single send does. The bytes on disk are those the checked-tuple path writes, but for
the stored time (read once per run). ``send_columns`` answers in columns (SendColumns:
a list per field, so an id string and ints per message); ``send_packed`` answers with
the columns already msgpack-encoded, no object per message.
Without the accelerator, both go through ``send_batch``'s Python path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from equeue.errors import StoreWriteError
from equeue.protocol.records import packed_answer, packed_fields, unpack_packed
from equeue.store.queue import Queue
from equeue.store.types import SendColumns, SendResult

if TYPE_CHECKING:
    from equeue.store.store import MessageStore

Appended = TypeVar("Appended")
Append = Callable[[list[Queue]], Appended]


def plain(store: MessageStore, items: Sequence[Any]) -> bool:
    """Whether every item is a bytes body the checks of a send pass as it is (in C:
    Sender.plain_bodies). False without the accelerator."""
    sender = store._appender.sender
    return sender is not None and bool(sender.plain_bodies(items))


def appending(store: MessageStore, topic: str, items: Sequence[Any], kind: str) -> Append[Any]:
    """What MessageStore._locked runs under the write lock for checked plain bodies:
    their SendResults (kind "results"), SendColumns ("columns"), or the broker's answer
    packed as records.pack_columns packs those columns ("packed", bytes)."""
    appender = store._appender

    def append(queues: list[Queue]) -> list[SendResult] | SendColumns | bytes:
        appender.check_open(topic, queues)
        sender = appender.sender
        lists: list[Any] = (  # (literals: a comprehension is a call of its own)
            [[]] if kind == "results"
            else [bytearray(), bytearray(), bytearray(), bytearray(), bytearray()]
            if kind == "packed" else [[], [], [], [], []]
        )  # fmt: skip
        done, count = 0, len(items)
        try:
            while done < count:
                done = sender.append_bodies(topic, queues, items, done, lists)
                if done < count:  # it needs a chunk completed, created or reserved
                    sent = appender.append(
                        topic, queues, items[done], b"", 0, b"", None, b"", 0, None
                    )
                    if kind == "results":
                        lists[0].append(sent)
                    else:
                        fields = packed_fields(sent) if kind == "packed" else _fields(sent)
                        for column, value in zip(lists, fields, strict=True):
                            column += value if kind == "packed" else [value]
                    done += 1
        except StoreWriteError as exc:  # a batch cut short by the disk: what was stored
            exc.sent = (
                lists[0] if kind == "results" else unpack_packed(topic, lists)
                if kind == "packed" else SendColumns(topic, *lists).results()
            )  # fmt: skip
            raise
        if kind == "packed":
            return packed_answer(topic, count, lists)
        return SendColumns(topic, *lists) if kind == "columns" else lists[0]

    return append


def _fields(sent: SendResult) -> tuple[str, int, int, int, float]:
    return sent.message_id, sent.queue_id, sent.queue_offset, sent.position, sent.stored_at


def send_columns(store: MessageStore, topic: str, items: list[bytes]) -> SendColumns:
    """``store.send_batch(topic, items)`` of bytes, its results as SendColumns."""
    store._check_writable()  # (a read-only handle has no appender to ask)
    if not plain(store, items):
        return SendColumns.of(topic, store.send_batch(topic, items))
    queues, _ = store._queues_and_count(topic)
    columns: SendColumns = store._locked(topic, queues, appending(store, topic, items, "columns"))
    return columns


def send_packed(
    store: MessageStore, topic: str, items: Sequence[bytes], checked: bool = False
) -> bytes | None:
    """``send_columns`` with the columns msgpack-encoded as the broker answers them
    (records.pack_columns's bytes), written by the C append as it goes: no object per
    message. None (nothing sent) unless the bodies are plain and the accelerator built.
    ``checked``: the caller found ``plain(store, items)`` true (not checked again)."""
    if not checked:
        store._check_writable()
        if not plain(store, items):
            return None
    queues, _ = store._queues_and_count(topic)  # (checks the handle is writable first)
    packed: bytes = store._locked(topic, queues, appending(store, topic, items, "packed"))
    return packed
