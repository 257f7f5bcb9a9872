"""Long-poll pulls held by the broker (EQueue's suspended pull requests).

A pull with ``wait_ms`` whose answer is empty is parked here, no thread per pull: the
broker is the store's only writer, so it tells ``arrived`` which queues each batch of
requests appended to, and a parked pull is pulled again then (the store applies its
tag filter: a message with another tag only moves the pull's offset on). At its
deadline it is answered with what there is, empty most likely.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

from equeue.store.store import MessageStore
from equeue.store.types import PullResult

log = logging.getLogger("equeue.server")

QueueKey = tuple[str, int]


class HeldPull:
    __slots__ = ("args", "deadline", "key", "offset", "owner", "request_id", "timer")

    def __init__(
        self, owner: Any, request_id: int, key: QueueKey, offset: int, args: dict[str, Any]
    ) -> None:
        self.owner = owner  # the connection to answer
        self.request_id = request_id
        self.key = key
        self.offset = offset
        self.args = args  # max_count, tags, max_bytes
        self.deadline = 0.0
        self.timer: asyncio.TimerHandle | None = None


Answer = Callable[[HeldPull, PullResult | BaseException], None]


class Holds:
    def __init__(
        self, loop: asyncio.AbstractEventLoop, store: MessageStore, answer: Answer
    ) -> None:
        self._loop = loop
        self._store = store
        self._answer = answer
        self._by_queue: dict[QueueKey, dict[HeldPull, None]] = {}
        self.count = 0

    def hold(self, held: HeldPull, wait_s: float) -> None:
        held.deadline = self._loop.time() + wait_s
        held.timer = self._loop.call_at(held.deadline, self._expire, held)
        self._by_queue.setdefault(held.key, {})[held] = None
        self.count += 1

    def _pull(self, held: HeldPull) -> PullResult:
        topic, queue_id = held.key
        args = held.args
        return self._store.pull(
            topic, queue_id, held.offset, args["max_count"], args["tags"], 0.0,
            max_bytes=args["max_bytes"],
        )  # fmt: skip

    def _release(self, held: HeldPull, outcome: PullResult | BaseException) -> None:
        waiting = self._by_queue.get(held.key)
        if waiting is None or held not in waiting:
            return
        del waiting[held]
        if not waiting:
            del self._by_queue[held.key]
        self.count -= 1
        if held.timer is not None:
            held.timer.cancel()
        self._answer(held, outcome)

    def _try(self, held: HeldPull, *, final: bool) -> None:
        try:
            result = self._pull(held)
        except Exception as exc:  # the topic was deleted, the store closed: the pull's answer
            self._release(held, exc)
            return
        if result.messages or final:
            self._release(held, result)
        else:  # entries another tag filter skipped: wait on from past them
            held.offset = result.next_offset

    def _expire(self, held: HeldPull) -> None:
        held.timer = None
        self._try(held, final=True)

    def arrived(self, keys: Iterable[QueueKey]) -> None:
        """Messages were appended to these queues: pull their held pulls again."""
        for key in keys:
            waiting = self._by_queue.get(key)
            if waiting:
                for held in list(waiting):
                    self._try(held, final=False)

    def poll(self) -> None:
        """Look at every queue with held pulls (appends the broker did not see itself:
        retries the group coordinator moved)."""
        for key, waiting in list(self._by_queue.items()):
            try:
                end = self._store.queue_range(*key)[1]
            except Exception:  # the pull itself reports it
                end = None
            for held in list(waiting):
                if end is None or end > held.offset:
                    self._try(held, final=False)

    def drop(self, owner: object) -> None:
        """The connection went away: forget its pulls."""
        for key, waiting in list(self._by_queue.items()):
            for held in [h for h in waiting if h.owner is owner]:
                del waiting[held]
                self.count -= 1
                if held.timer is not None:
                    held.timer.cancel()
            if not waiting:
                del self._by_queue[key]

    def answer_all(self) -> None:
        """Draining: answer every held pull with what there is now."""
        for waiting in list(self._by_queue.values()):
            for held in list(waiting):
                self._try(held, final=True)
