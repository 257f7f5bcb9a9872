"""The open-time recovery steps of a writable open, after the chunks and topics load:
where re-dispatch starts (checkpoint, live tail, or earlier for a damaged queue), a
rescan of the ongoing log chunk when re-dispatch must read before the tail hint, and
the queues' first offsets after retention. And the close of every file at the end."""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any

from equeue.store.queuerebuild import check_queues, finish_rebuilt
from equeue.store.recovery import recovery_start, redispatch, redispatch_start
from equeue.store.topicsfile import topics_state

if TYPE_CHECKING:
    from equeue.store.store import MessageStore

log = logging.getLogger("equeue.recovery")


def reconcile_at_open(store: MessageStore, checkpoint: dict[str, Any]) -> dict[str, Any] | None:
    """Bring the queues and the key index in line with the log; returns the log tail
    last known durable (the checkpoint's, if this open took its hint)."""
    skipped_to = store._messages.scan_started_at
    from_live = False
    if skipped_to is not None and store._messages.started_at_live_hint:
        from_live = True
        # The live tail names a point before which every queue entry is in place and
        # every key is in the key index (LiveTailWriter.advance): re-dispatch from there.
        position = checkpoint.get("log_position")
        checkpoint = checkpoint | {
            "log_position": max(skipped_to, position if isinstance(position, int) else 0)
        }
        store._keys.indexed_position = max(store._keys.indexed_position, skipped_to)
    check_queues(store, checkpoint)
    start = recovery_start(checkpoint, store._messages, store._queues, store.recovery)
    if any(q.rebuilt for qs in store._queues.values() for q in qs):
        start = store._messages.first_position
    if (
        skipped_to is not None
        and redispatch_start(start, store._keys, store._messages) < skipped_to
    ):
        # Re-dispatch will read records the hint let the scan skip (a queue or the key
        # index is behind the checkpoint): scan the chunk from its first record, as
        # without a hint, so that damage there is cut, not met by re-dispatch.
        log.warning(
            "re-dispatch starts before the checkpoint's log tail (%d): rescanning the "
            "ongoing log chunk from its first record",
            skipped_to,
        )
        store._messages.close()
        store._open_log(None, None)
        store.recovery.cuts += store._messages.recovery_cuts
        store.recovery.problems += store._messages.recovery_problems
    # The last tail known durable: the hint this open took, until a flush covers more.
    log_tail: dict[str, Any] | None = (
        checkpoint.get("log_tail") if store._messages.synced_hint is not None else None
    )
    # The checkpoint's queue offsets are each queue's end at its log position. From the
    # live tail on, a queue with no record past it ends where its entries reach it
    # (redispatch), not where the older checkpoint said: that would cut entries of
    # acknowledged messages sent between the two.
    recorded = None if from_live else checkpoint.get("queues")
    recorded_at = checkpoint.get("log_position") if recorded is not None else None
    redispatch(
        store._reader, start, store._queues, store._keys, store.recovery, recorded,
        store._deleted, store._files.logged,
        recorded_at if isinstance(recorded_at, int) else None, from_live,
    )  # fmt: skip
    finish_rebuilt(store, checkpoint.get("queues"))
    first = store._messages.first_position
    # A log from 0 lost nothing to retention: no search over (maybe damaged) entries.
    if first > 0:
        for queues in store._queues.values():
            for queue in queues:  # retention may have removed messages the queue still indexes
                if not queue.deferred:  # (its first offset is the checkpoint's, retention's)
                    queue.first_offset = queue.first_offset_at_or_after(first)
    return log_tail


def release_refused(store: MessageStore) -> None:
    """What a refused open had opened (any of it: the open stops anywhere), closed
    without a write of its own: no checkpoint, no fold of the topics journal, no batch of
    buffered keys (what recovery wrote before the refusal stays, as it would after a
    kill). Each close is tried; their failures are not the open's error, which the
    caller raises. Before, a refused open kept the log's
    ongoing chunk and the queues it had opened (reached from the half-made handle the
    exception's traceback holds): 2 descriptors a try for an application that retries it
    (review9 R9-4)."""
    fields = vars(store)
    stop, service = fields.get("_service_stop"), fields.get("_service")
    if stop is not None and service is not None and service.is_alive():
        stop.set()
        service.join()
    closers = [
        close
        for name, method in (
            ("_live_tail", "close"),
            ("_keys", "discard"),
            ("_messages", "close"),
            ("_topics_file", "close_fd"),
        )
        if (close := getattr(fields.get(name), method, None)) is not None
    ]
    closers += [q.close for qs in fields.get("_queues", {}).values() for q in qs]
    for close in closers:
        with contextlib.suppress(Exception):
            close()


def release_files(store: MessageStore) -> None:
    """Close every file; the first failure is raised after all were tried."""
    closers = [store._keys.close, store._messages.close]
    if not store.read_only and (store._guard is None or store._guard.failure is None):
        # the topics journal folded into topics.json: a clean close (never into a store
        # made again under this writer: its topics.json is not this store's)
        closers.append(lambda: store._topics_file.close(*topics_state(store)))
    else:
        closers.append(store._topics_file.close_fd)
    closers += [q.close for qs in store._queues.values() for q in qs]
    if store._live_tail is not None:
        closers.append(store._live_tail.close)
    failure: BaseException | None = None
    for close in closers:
        try:
            close()
        except Exception as exc:
            failure = failure or exc
    if failure is not None:
        raise failure
