"""A writable store's pull: the queue's end for an offset past it, and the waits."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from equeue.errors import TopicNotFoundError
from equeue.store import follow
from equeue.store.queue import Queue
from equeue.store.types import PullResult

if TYPE_CHECKING:
    from equeue.store.store import MessageStore


def pull_once(
    store: MessageStore,
    queue: Queue,
    offset: int,
    max_count: int,
    wanted: dict[int, set[str]] | None,
    wait: float,
    max_bytes: int | None,
) -> PullResult:
    """One pull, waiting up to ``wait`` seconds for an entry past the queue's end."""
    if store.read_only:
        return follow.pull(store, queue, offset, max_count, wanted, wait, max_bytes)
    # Past the end, the end (as RocketMQ corrects an overflowing offset): else the
    # caller would go on from there and skip the messages sent up to it.
    offset = min(max(offset, queue.first_offset), queue.next_offset)
    if wait > 0 and offset >= queue.next_offset:
        _wait_for(store, queue, offset, wait)
        store._check_open()  # close() closed the queue too: ClosedError first
        if queue.closed:  # delete_topic ran meanwhile: this queue's offsets mean nothing now
            raise TopicNotFoundError(
                f"topic {queue.topic!r} was deleted while this pull waited, in {store.path}"
            )
    return PullResult(*store._log.pull_run(queue, offset, max_count, wanted, max_bytes))


def wait_on(
    store: MessageStore,
    queue: Queue,
    result: PullResult,
    max_count: int,
    wanted: dict[int, set[str]] | None,
    deadline: float,
    max_bytes: int | None,
) -> PullResult:
    """After an empty pull: entries the tag filter skipped arrived, but no message it
    keeps; pull on from past them until one does or the pull's ``deadline`` (monotonic)."""
    while not result and (remaining := deadline - time.monotonic()) > 0:
        store._check_open()
        offset = result.next_offset
        result = pull_once(store, queue, offset, max_count, wanted, remaining, max_bytes)
    return result


def _wait_for(store: MessageStore, queue: Queue, offset: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with store._arrived:
        store._waiting += 1
        try:
            while queue.next_offset <= offset and not queue.closed:  # delete_topic wakes it
                store._check_open()  # close() wakes this wait: the pull fails as a late one
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                store._arrived.wait(remaining)
        finally:
            store._waiting -= 1
