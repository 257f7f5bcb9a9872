"""MessageStore's send path: ``send`` (the Python side of the C Sender, which calls it
for every send it does not take whole, and ``_wake``), ``send_batch`` and the write-lock
section they share. Apart from store.py because it is the hot path: what it looks up stays
a module global, a local or an attribute of the store, never a new indirection."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from equeue import speedups
from equeue.store import bodies, validate
from equeue.store.bodies import Append, Appended
from equeue.store.queue import Queue
from equeue.store.queuecache import reentered
from equeue.store.types import OutgoingMessage, SendResult
from equeue.store.validate import Checked

if TYPE_CHECKING:
    from equeue.store.store import MessageStore


def send(
    self: MessageStore,
    topic: str,
    body: bytes,
    *,
    tag: str = "",
    key: str | None = None,
    properties: dict[str, str] | None = None,
    code: int = 0,
    queue_id: int | None = None,
) -> SendResult:
    """Append one message to ``topic`` (created on first use unless auto_create_topics
    is off) and return where it went: SendResult (message id, queue id and offset, log
    position, stored_at in seconds). ``queue_id`` None: round robin over the queues.
    Durable as ``StoreConfig.flush`` says when it returns.

    Raises InvalidMessageError/InvalidTypeError for a bad argument,
    MessageTooLargeError past ``max_message_size`` / ``max_properties_size``,
    TopicNotFoundError, QueueNotFoundError, DiskFullError or StoreWriteError (nothing
    written), ReadOnlyError or ClosedError.
    """
    sender = self._sender
    if sender is not None:  # the common case, whole in C: cext/sender.c
        result = sender.send(topic, body, tag, key, properties, code, queue_id)
        if result is not None:
            return result  # type: ignore[no-any-return]
    queues, count = self._queues_and_count(topic)
    check = self._check_in_c
    checked = check(count, body, tag, key, properties, code, queue_id) if check else None
    if checked is None:  # anything unusual, and every error
        checked = validate.check_message(
            self.config, topic, count, body, tag, key, properties, code, queue_id
        )
    return self._store(topic, queues, [checked])[0]


def send_batch(
    self: MessageStore, topic: str, messages: Iterable[bytes | OutgoingMessage | dict[str, Any]]
) -> list[SendResult]:
    """Send many messages under one lock acquisition: all are checked first, so one
    bad message rejects the batch and nothing is written."""
    queues, count = self._queues_and_count(topic)
    items = validate.check_messages(messages)

    def check(message: object) -> Checked:
        fields = validate.outgoing(message)
        return validate.check_message(self.config, topic, count, *fields)

    fast = speedups.SPEEDUPS
    if bodies.plain(self, items):  # bytes alone: one C call per run (store/bodies.py)
        return self._locked(topic, queues, bodies.appending(self, topic, items, "results"))
    if fast is None:
        checked = [check(message) for message in items]
    else:  # the common cases in C, the rest (and every error) by check()
        config = self.config
        checked = fast.check_batch(
            items,  # a private copy: check() runs Python code
            OutgoingMessage, check, validate.check_tag,
            config.max_message_size, config.layout.chunk_data_size, count,
        )  # fmt: skip
    return self._store(topic, queues, checked)


def _store(
    self: MessageStore, topic: str, queues: list[Queue] | None, checked: list[Checked]
) -> list[SendResult]:
    return self._locked(topic, queues, lambda q: self._appender.append_all(topic, q, checked))


def _locked(
    self: MessageStore, topic: str, queues: list[Queue] | None, append: Append[Appended]
) -> Appended:
    """Append checked messages under the write lock; under "sync", flush the log before
    returning (the queues are a derived index: flush.py)."""
    if self._lock_owned():  # the lock is an RLock: re-entered, it would not block
        raise reentered(self.path, topic)
    if queues is None:
        queues = self._create_for_send(topic)
    if self._flush_error is not None:  # same class: DiskFullError stays DiskFullError
        raise type(self._flush_error)(
            self._flush_error.errno,
            f"refusing the send: the last group-commit or background flush failed "
            f"({self._flush_error}); after a failed fdatasync close and reopen the store to "
            "send again (other errors: sends resume once a flush succeeds)",
        )
    if self._group is not None:  # "sync": appended and flushed in a batch with others
        return self._group.submit(lambda: append(queues), lambda: reentered(self.path, topic))
    with self._lock:
        results = append(queues)
    if self._waiting:
        self._wake()
    return results


def _wake(self: MessageStore) -> None:
    if not self._waiting:
        return
    with self._arrived:
        self._arrived.notify_all()
