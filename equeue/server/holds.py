"""Long-poll pulls held by the broker (EQueue's suspended pull requests).

A pull with ``wait_ms`` whose answer is empty is parked here, no thread per pull: the
broker is the store's only writer, so its handlers ``note`` each message they append
(queue, offset, tag), and after each batch of requests ``arrived`` pulls again only the
parked pulls whose tag filter one of those tags matches: a send nobody waits for costs
no pull. The group coordinator's retry mover notes its appends too (``noted``). An append
nobody noted shows as a gap between the queue's end as last seen and the first offset
noted, or, at ``poll``, as a queue end past it: then every parked pull of that queue is
pulled. ``poll`` looks at POLL_QUEUES queues a tick, in turn, so an idle broker's tick
costs the same however many queues are held (reviewg F13). At its deadline a pull is
answered with what there is, empty most likely.

What held pulls keep is bounded: at most ``max_held`` of them over every connection, and
per connection tag filters of at most ``max_filter_bytes`` (each distinct filter kept
once: heldfilters.py). A pull past either is not held (``hold`` says False): it is
answered as a pull without a wait (empty, ``next_offset`` its offset or past entries its
filter skipped: nothing skipped, nothing kept) at the broker's next tick (``later``);
counted in ``not_held`` (review4 R4: one connection held 1,000 pulls of 1,024-tag
filters, +346 MB).

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
import math
from collections.abc import Callable, Iterable
from typing import Any

from equeue.errors import GroupError
from equeue.server.config import DEFAULT_MAX_HELD_FILTER_BYTES, DEFAULT_MAX_HELD_PULLS
from equeue.server.heldfilters import Filters
from equeue.store.store import MessageStore
from equeue.store.types import PullResult

log = logging.getLogger("equeue.server")

QueueKey = tuple[str, int]

POLL_QUEUES = 64  # queues ``poll`` looks at a tick (every 100 ms)
NOT_HELD_LOG_S = 60.0  # a pull not held is logged at most this often


class HeldPull:
    __slots__ = (
        "check", "deadline", "group", "key", "max_bytes", "max_count", "offset", "owner",
        "pack", "request_id", "tags", "timer",
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
        # what it pulls: not the request's args, whose tag list (up to 1,024 tags) would
        # be kept beside the filter (review4 R4)
        self.max_count: int = args["max_count"]
        self.max_bytes: int = args["max_bytes"]
        # the tags it waits for (Holds.hold sets the connection's kept copy: heldfilters.py);
        # None: every message
        self.tags: frozenset[str] | None = None
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
        self,
        loop: asyncio.AbstractEventLoop,
        store: MessageStore,
        answer: Answer,
        *,
        max_held: int = DEFAULT_MAX_HELD_PULLS,
        max_filter_bytes: int = DEFAULT_MAX_HELD_FILTER_BYTES,
    ) -> None:
        self._loop = loop
        self._store = store
        self._answer = answer
        self.max_held = max_held  # held pulls of every connection
        self.max_filter_bytes = max_filter_bytes  # filters' weight a connection's keep
        self._by_queue: dict[QueueKey, dict[HeldPull, None]] = {}
        self._seen: dict[QueueKey, int] = {}  # a queue's end as last seen, while pulls wait on it
        self.appended: dict[QueueKey, Appended] = {}
        self.count = 0
        # a connection's, by request id, in hold order (cancel_pull finds one by its id)
        self._by_owner: dict[Any, dict[int, HeldPull]] = {}
        # pulls that may have an answer, waiting for their connection to have room
        self._starved: dict[Any, dict[HeldPull, None]] = {}
        self._filters: dict[Any, Filters] = {}  # a connection's held pulls' tag filters
        self.filter_bytes = 0  # their weight, over every connection
        # pulls with a wait answered empty (``later``) because a bound was reached
        self.not_held = 0
        self._not_held_said = -math.inf  # loop.time() when that was last logged
        self._sweep: list[QueueKey] = []  # queues ``poll`` has still to look at this round
        # answers of pulls not held (connection, request id, answer), for the next ``poll``
        self._later: list[tuple[Any, int, object]] = []

    def hold(self, held: HeldPull, tags: str | Iterable[str] | None, wait_s: float) -> bool:
        """Hold ``held`` (its filter ``tags`` as the request gave it, checked) for up to
        ``wait_s``; False, and nothing kept, where that would pass ``max_held`` pulls or
        the connection's ``max_filter_bytes``: the caller answers it (``later``). A pull
        whose request id one of its connection's held pulls has (a client breaking the
        rule that ids in flight are unique) is not held either: cancel_pull finds a held
        pull by its id."""
        owned = self._by_owner.get(held.owner)
        if owned is not None and held.request_id in owned:
            return False
        if self.count >= self.max_held:
            self._refused(held, f"max_held_pulls={self.max_held} (--max-held-pulls)")
            return False
        if tags is not None and tags != "*":
            owner = held.owner
            filters = self._filters.get(owner)
            if filters is None:
                self._filters[owner] = filters = Filters()
            before = filters.weight
            kept = filters.keep(tags, self.max_filter_bytes)
            if kept is None:
                if not filters.weight:
                    del self._filters[owner]
                self._refused(
                    held,
                    f"max_held_filter_bytes={self.max_filter_bytes} (--max-held-filter-bytes)"
                    f" of tag filters on its connection, {filters.weight} kept",
                )
                return False
            self.filter_bytes += filters.weight - before
            held.tags = kept
        held.deadline = self._loop.time() + wait_s
        held.timer = self._loop.call_at(held.deadline, self._expire, held)
        key = held.key
        waiting = self._by_queue.get(key)
        if waiting is None:
            self._by_queue[key] = waiting = {}
            self._seen[key] = held.offset  # its pull read to the queue's end
        waiting[held] = None
        if owned is None:
            self._by_owner[held.owner] = owned = {}
        owned[held.request_id] = held
        self.count += 1
        return True

    def _refused(self, held: HeldPull, bound: str) -> None:
        self.not_held += 1
        now = self._loop.time()
        if now - self._not_held_said >= NOT_HELD_LOG_S:
            self._not_held_said = now
            log.warning(
                "%s: a pull with a wait answered empty at the next tick, not held: it would "
                "pass %s; %d such pulls since the broker started (stats pulls_not_held)",
                getattr(held.owner, "where", "a connection"), bound, self.not_held,
            )  # fmt: skip

    def note(self, topic: str, queue_id: int, offset: int, tag: str) -> None:
        """A handler appended a message with ``tag`` at ``offset`` of this queue."""
        key = (topic, queue_id)
        found = self.appended.get(key)
        if found is None:
            self.appended[key] = Appended(offset, tag)
        else:
            found.end = max(found.end, offset + 1)
            found.tags.add(tag)

    def later(self, owner: Any, request_id: int, answer: object) -> None:
        """A pull ``hold`` refused, answered empty as without a wait: at the broker's next
        tick (``answer_later``, within 100 ms), not at once, so that a client pulling again
        at once (the library's consumer does, after an empty long poll) polls 10 times a
        second, not thousands (measured: 5,600 pulls a second, a quarter of the broker's
        CPU, for one idle consumer of 4 queues answered at once). It keeps the answer
        alone (~150 bytes) for at most a tick, a request in flight like any other
        (``max_in_flight`` bounds them)."""
        self._later.append((owner, request_id, answer))

    def answer_later(self) -> None:
        """Answer the pulls ``later`` put off."""
        later, self._later = self._later, []
        for owner, request_id, answer in later:
            owner.finish(request_id, answer)  # (a closed connection ignores it)

    def noted(self, topic: str, queue_id: int, offset: int, tag: str) -> None:
        """``note``, for an appender that does not look at ``count`` first (the retry
        mover: retry.py ``appended``); ``arrived`` follows at the end of the tick or read."""
        if self.count:
            self.note(topic, queue_id, offset, tag)

    def _pull(self, held: HeldPull) -> PullResult:
        topic, queue_id = held.key
        return self._store.pull(
            topic, queue_id, held.offset, held.max_count, held.tags, 0.0,
            max_bytes=held.max_bytes,
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
        del owned[held.request_id]
        if not owned:
            del self._by_owner[owner]
        if held.tags is not None:
            self._unfilter(held)
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

    def _unfilter(self, held: HeldPull) -> None:
        assert held.tags is not None
        owner = held.owner
        filters = self._filters[owner]
        self.filter_bytes -= filters.release(held.tags)
        if not filters.weight:
            del self._filters[owner]

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
        for held in [h for h in self._by_owner.get(owner, {}).values() if h in starved]:
            if self._by_owner.get(owner, {}).get(held.request_id) is held:  # (not dropped)
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
        """Look at up to POLL_QUEUES queues with held pulls, in turn, for appends nobody
        ``note``d and topics deleted. Every append the broker makes is noted (its
        handlers', the retry mover's), so this is a safety net whose cost a tick does not
        grow with the queues held (reviewg F13: all 20,400 a tick, 9.4 % of a core idle)."""
        sweep = self._sweep
        if not sweep:  # a new round (a list of the queues once every len / POLL_QUEUES ticks)
            sweep.extend(self._by_queue)
        for _ in range(min(POLL_QUEUES, len(sweep))):
            key = sweep.pop()
            waiting = self._by_queue.get(key)
            if not waiting:
                continue  # (its pulls were answered since the round began)
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
        filters = self._filters.pop(owner, None)
        if filters is not None:
            self.filter_bytes -= filters.weight
        for held in self._by_owner.pop(owner, {}).values():
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
        for held in list(self._by_owner.get(owner, {}).values()):
            self._try(held, final=True)

    def cancel(self, owner: object, request_id: int) -> bool:
        """cancel_pull: the pull ``request_id`` of ``owner``, if held, answered now, empty
        (``next_offset`` its offset: nothing skipped, nothing read), whatever its room: its
        client gave up on it and drops the answer; False if none is held under that id
        (answered already, never held, or not a pull)."""
        held = self._by_owner.get(owner, {}).get(request_id)
        if held is None:
            return False
        self._release(held, PullResult([], held.offset))
        return True

    def answer_group(self, group: str, topic: str) -> None:
        """``group`` was deleted: its members' pulls and the pulls of its retry topic
        ``topic`` are answered now (a member's with the GroupError of its check)."""
        for waiting in list(self._by_queue.values()):
            for held in list(waiting):
                if held.group == group or held.key[0] == topic:
                    self._try(held, final=True)

    def answer_all(self) -> None:
        """Draining: answer every held pull with what there is now."""
        self.answer_later()
        for waiting in list(self._by_queue.values()):
            for held in list(waiting):
                self._try(held, final=True)
