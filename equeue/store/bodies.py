"""send_batch of plain bodies: bytes alone, no tag, key, properties, code or queue id.

The broker's ``send_bodies`` and ``send_batch(topic, [bytes, ...])``. All bodies are
checked before any is written (as any batch); then, under the write lock, each run of
bodies that fits the current log chunk and queue chunks is framed, entered and
published by one C call (``Sender.append_bodies``, equeue/cext/batch.c), and a body
that needs a chunk completed, created or reserved goes through ``Appender.append`` as a
single send does. The bytes on disk are those the checked-tuple path writes.
``send_columns`` answers in columns (SendColumns) and makes no object per message.
Without the accelerator, both go through ``send_batch``'s Python path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from equeue.errors import StoreWriteError
from equeue.store.queue import Queue
from equeue.store.types import SendColumns, SendResult

if TYPE_CHECKING:
    from equeue.store.store import MessageStore

Appended = TypeVar("Appended")
Append = Callable[[list[Queue]], Appended]


def plain(store: MessageStore, items: list[Any]) -> bool:
    """Whether every item is a bytes body the checks of a send pass as it is (in C:
    Sender.plain_bodies). False without the accelerator."""
    sender = store._appender.sender
    return sender is not None and bool(sender.plain_bodies(items))


def appending(store: MessageStore, topic: str, items: list[Any], as_columns: bool) -> Append[Any]:
    """What MessageStore._store runs under the write lock for checked plain bodies:
    their SendResults, or (as_columns) their SendColumns."""
    appender = store._appender

    def append(queues: list[Queue]) -> list[SendResult] | SendColumns:
        appender.check_open(topic, queues)
        sender = appender.sender
        lists: list[list[Any]] = [[], [], [], [], []] if as_columns else [[]]
        done, count = 0, len(items)
        try:
            while done < count:
                done = sender.append_bodies(topic, queues, items, done, lists)
                if done < count:  # it needs a chunk completed, created or reserved
                    sent = appender.append(
                        topic, queues, items[done], b"", 0, b"", None, b"", 0, None
                    )
                    if as_columns:
                        for column, value in zip(lists, _fields(sent), strict=True):
                            column.append(value)
                    else:
                        lists[0].append(sent)
                    done += 1
        except StoreWriteError as exc:  # a batch cut short by the disk: what was stored
            exc.sent = SendColumns(topic, *lists).results() if as_columns else lists[0]
            raise
        return SendColumns(topic, *lists) if as_columns else lists[0]

    return append


def _fields(sent: SendResult) -> tuple[str, int, int, int, float]:
    return sent.message_id, sent.queue_id, sent.queue_offset, sent.position, sent.stored_at


def send_columns(store: MessageStore, topic: str, items: list[bytes]) -> SendColumns:
    """``store.send_batch(topic, items)`` of bytes, its results as SendColumns."""
    if not plain(store, items):
        return SendColumns.of(topic, store.send_batch(topic, items))
    queues, _ = store._queues_and_count(topic)
    columns: SendColumns = store._locked(topic, queues, appending(store, topic, items, True))
    return columns
