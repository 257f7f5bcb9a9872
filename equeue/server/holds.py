"""Long-poll pulls held by the broker (EQueue's suspended pull requests).

A pull with ``wait_ms`` whose answer is empty is parked here, no thread per pull: the
broker is the store's only writer, so its handlers ``note`` each message they append
(queue, offset, tag), and after each batch of requests ``arrived`` pulls again only the
parked pulls whose tag filter one of those tags matches: a send nobody waits for costs
no pull. Appends the broker's handlers did not make (the group coordinator's retry
mover) show as a gap between the queue's end as last seen and the first offset noted,
or, at ``poll``, as a queue end past it: then every parked pull of that queue is pulled.
At its deadline a pull is answered with what there is, empty most likely.

A held pull is answered outside its connection's reads, so the read's backpressure
(connection.py ``_serve``) does not bound it: a pull is answered only while its connection
has room (``has_room``: under ``write_buffer_high`` with what waits to be written). One
that may have an answer and finds no room waits, in the order it was held, until the
connection has room again (``room_made``: ``resume_writing``); at its deadline without room
it is answered empty (next_offset its offset: nothing skipped), a small answer. So the
answers one connection buffers stay near ``write_buffer_high`` plus one answer, however
many pulls it holds (reviewg F1: 300 held pulls answered one 1 MiB message each, 300 MiB).

A group member's pull is checked for ownership again whenever it is answered (``check``):
while it was held its member may have lost the queue (its session expired, the queue
went to another member), and an answer with messages would then give one queue two
consumers at a time. It is answered with the GroupError instead, upon which the client
joins again (a queue it no longer holds it ignores).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from equeue.errors import GroupError
from equeue.store.store import MessageStore
from equeue.store.types import PullResult

log = logging.getLogger("equeue.server")

QueueKey = tuple[str, int]


class HeldPull:
    __slots__ = (
        "args", "check", "deadline", "group", "key", "offset", "owner", "pack", "request_id",
        "tags", "timer",
    )  # fmt: skip

    def __init__(
        self,
        owner: Any,
        request_id: int,
        key: QueueKey,
        offset: int,
        args: dict[str, Any],
        check: Callable[[], None] | None = None,
        group: str | None = None,
    ) -> None:
        self.owner = owner  # the connection to answer
        self.request_id = request_id
        self.key = key
        self.offset = offset
        self.args = args  # max_count, tags, max_bytes
        tags = args["tags"]
        # the tags it waits for (as the store's tag filter reads them); None: every message
        self.tags: frozenset[str] | None = (
            None
            if tags is None or tags == "*"
            else frozenset([tags] if type(tags) is str else tags)
        )
        self.deadline = 0.0
        self.timer: asyncio.TimerHandle | None = None
        # a group member's pull: GroupError unless the member still holds the queue
        self.check = check
        self.group = group  # the group a member's pull is for (delete_group answers it)
        # a pull_columns: its answer packed here (errors too: a message no frame carries)
        self.pack: Callable[[PullResult], object] | None = None


class Appended:
    """What the handlers appended to one queue since the last ``arrived``."""

    __slots__ = ("end", "first", "tags")

    def __init__(self, offset: int, tag: str) -> None:
        self.first = offset
        self.end = offset + 1
        self.tags = {tag}


# The outcome: the PullResult, the exception to answer, or (a pull_columns) the packed
# answer, which the broker's fit_pull passes on as it is.
Answer = Callable[[HeldPull, Any], None]


class Holds:
    def __init__(
        self, loop: asyncio.AbstractEventLoop, store: MessageStore, answer: Answer
    ) -> None:
        self._loop = loop
        self._store = store
        self._answer = answer
        self._by_queue: dict[QueueKey, dict[HeldPull, None]] = {}
        self._seen: dict[QueueKey, int] = {}  # a queue's end as last seen, while pulls wait on it
        self.appended: dict[QueueKey, Appended] = {}
        self.count = 0
        self._by_owner: dict[Any, dict[HeldPull, None]] = {}  # a connection's, in hold order
        # pulls that may have an answer, waiting for their connection to have room
        self._starved: dict[Any, dict[HeldPull, None]] = {}

    def hold(self, held: HeldPull, wait_s: float) -> None:
        held.deadline = self._loop.time() + wait_s
        held.timer = self._loop.call_at(held.deadline, self._expire, held)
        key = held.key
        waiting = self._by_queue.get(key)
        if waiting is None:
            self._by_queue[key] = waiting = {}
            self._seen[key] = held.offset  # its pull read to the queue's end
        waiting[held] = None
        owned = self._by_owner.get(held.owner)
        if owned is None:
            self._by_owner[held.owner] = owned = {}
        owned[held] = None
        self.count += 1

    def note(self, topic: str, queue_id: int, offset: int, tag: str) -> None:
        """A handler appended a message with ``tag`` at ``offset`` of this queue."""
        key = (topic, queue_id)
        found = self.appended.get(key)
        if found is None:
            self.appended[key] = Appended(offset, tag)
        else:
            found.end = max(found.end, offset + 1)
            found.tags.add(tag)

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
            self._seen.pop(held.key, None)
        owner = held.owner
        owned = self._by_owner[owner]
        del owned[held]
        if not owned:
            del self._by_owner[owner]
        if self._starved:  # (none, mostly: no call for it)
            self._fed(held)
        self.count -= 1
        if held.timer is not None:
            held.timer.cancel()
        answer: object = outcome
        if held.pack is not None and not isinstance(outcome, BaseException):
            try:
                answer = held.pack(outcome)
            except Exception as exc:  # a message no frame can carry
                answer = exc
        self._answer(held, answer)

    def _try(self, held: HeldPull, *, final: bool) -> None:
        if held.check is not None:
            try:
                held.check()
            except GroupError as exc:  # the queue moved while the pull was held
                self._release(held, exc)
                return
        if not held.owner.has_room():
            if final:  # its time is up: an answer that adds next to nothing
                self._release(held, PullResult([], held.offset))
            else:
                self._starve(held)
            return
        try:
            result = self._pull(held)
        except Exception as exc:  # the topic was deleted, the store closed: the pull's answer
            self._release(held, exc)
            return
        if result.messages or final:
            self._release(held, result)
        else:  # entries another tag filter skipped: wait on from past them
            held.offset = result.next_offset

    def _starve(self, held: HeldPull) -> None:
        owner = held.owner
        starved = self._starved.get(owner)
        if starved is None:
            self._starved[owner] = starved = {}
            owner.wait_for_room()  # then room_made
        starved[held] = None

    def room_made(self, owner: object) -> None:
        """``owner`` has room for answers again: pull its pulls that waited for it, in
        the order they were held, as far as the room goes (the rest wait again)."""
        starved = self._starved.pop(owner, None)
        if not starved:
            return
        for held in [h for h in self._by_owner.get(owner, ()) if h in starved]:
            if held in self._by_owner.get(owner, ()):  # (not dropped meanwhile)
                self._try(held, final=False)

    def _fed(self, held: HeldPull) -> None:
        """``held`` is answered: it waits for room no longer."""
        starved = self._starved.get(held.owner)
        if starved is not None:
            starved.pop(held, None)
            if not starved:
                del self._starved[held.owner]

    def _expire(self, held: HeldPull) -> None:
        held.timer = None
        self._try(held, final=True)

    def arrived(self) -> None:
        """After a batch of requests: pull again the held pulls that what was ``note``d
        may answer."""
        appended, self.appended = self.appended, {}
        for key, found in appended.items():
            waiting = self._by_queue.get(key)
            if not waiting:
                continue
            seen = self._seen.get(key, 0)
            foreign = found.first > seen  # someone else appended in between
            self._seen[key] = max(seen, found.end)
            tags = found.tags
            for held in list(waiting):
                if foreign or held.tags is None or not held.tags.isdisjoint(tags):
                    self._try(held, final=False)

    def poll(self) -> None:
        """Look at every queue with held pulls for appends the handlers did not make
        (retries the group coordinator moved)."""
        for key, waiting in list(self._by_queue.items()):
            try:
                end: int | None = self._store.queue_range(*key)[1]
            except Exception:  # the pull itself reports it
                end = None
            if end is not None and end <= self._seen.get(key, 0):
                continue
            if end is not None:
                self._seen[key] = end
            for held in list(waiting):
                if end is None or end > held.offset:
                    self._try(held, final=False)

    def holding(self, owner: object) -> bool:
        return owner in self._by_owner

    def starving(self, owner: object) -> bool:
        """Whether pulls of ``owner`` wait for it to have room (``room_made``)."""
        return owner in self._starved

    def drop(self, owner: object) -> None:
        """The connection went away: forget its pulls."""
        self._starved.pop(owner, None)
        for held in self._by_owner.pop(owner, ()):
            waiting = self._by_queue[held.key]
            del waiting[held]
            self.count -= 1
            if held.timer is not None:
                held.timer.cancel()
            if not waiting:
                del self._by_queue[held.key]
                self._seen.pop(held.key, None)

    def answer_now(self, owner: object) -> None:
        """The client ended its side of the connection: answer its pulls with what there
        is now (empty where it has no room), not at their deadlines."""
        for held in list(self._by_owner.get(owner, ())):
            self._try(held, final=True)

    def answer_group(self, group: str, topic: str) -> None:
        """``group`` was deleted: its members' pulls and the pulls of its retry topic
        ``topic`` are answered now (a member's with the GroupError of its check)."""
        for waiting in list(self._by_queue.values()):
            for held in list(waiting):
                if held.group == group or held.key[0] == topic:
                    self._try(held, final=True)

    def answer_all(self) -> None:
        """Draining: answer every held pull with what there is now."""
        for waiting in list(self._by_queue.values()):
            for held in list(waiting):
                self._try(held, final=True)
