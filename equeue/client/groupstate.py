"""What a member of a consumer group knows, without I/O: shared by the blocking loop
(equeue/client/consumer.py) and the asyncio one (equeue/client/consumer_aio.py).

Per queue it holds: where its next pull starts (``positions``), how far the messages
handed out and processed go (``processed``), and what it last committed. A message
handed out is processed once the caller comes back for the next one (or commits, or
closes). An assignment (the broker's answer to join and heartbeat) is applied between
messages: the queues it no longer lists are committed (with auto_commit) and dropped,
the new ones start at the group's committed offset (the queue's first retained offset
where the group committed none), and the generation applied is reported by the next
heartbeat, which lets the broker hand the dropped queues on.

A join is answered a ``join_id`` (a broker from before join ids answers none) that every
later request of that membership carries: a join of the same consumer id elsewhere
fences this member (FencedMemberError), which then stops rather than join again (that
would fence the other in turn, each rejoin dropping the queues uncommitted).
"""

from __future__ import annotations

import enum
import os
import secrets
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any, Final, NamedTuple

from equeue.client import forks
from equeue.errors import (
    EQueueError,
    FencedMemberError,
    InvalidMessageError,
    InvalidTypeError,
    ProtocolError,
)
from equeue.protocol.pullcols import unpack_any
from equeue.protocol.retries import RETRY_PREFIX, check_max_retries, restore
from equeue.store.consumerargs import (
    Start,
    check_count,
    check_seconds,
    check_start,
    check_tags,
    check_topics,
)
from equeue.store.offsets import check_group
from equeue.store.types import Message

Queue = tuple[str, int]
DEFAULT_SESSION_TIMEOUT: Final = 10.0
DEFAULT_AUTO_COMMIT_INTERVAL: Final = 1.0
# Kafka's max.poll.interval.ms: a member whose caller has not asked for a message for this
# long stops heartbeating, so the queues it holds go to the others after its session
# timeout (a handler stuck for good would hold them, revoked ones too, forever).
DEFAULT_MAX_POLL_INTERVAL: Final = 300.0
# A long-poll pull is held this long at most: then the loop looks at its assignment.
POLL_WAIT_MS: Final = 1000
MAX_POLLERS: Final = 64  # pulls in flight at once (threads of the blocking loop)
MIN_POLL_WAIT_MS: Final = 10
# Batches of a queue a member holds at most, handed-out ones not counted: its buffered
# messages and the one pull in flight. 2: the next pull is sent as soon as the queue's
# buffer holds no more than one batch, so it is answered while that batch is handled.
DEFAULT_PREFETCH: Final = 2
MAX_PREFETCH: Final = 64
# While a member holds no queue and awaits some another member still holds (a joiner,
# in a rebalance's handover), it heartbeats this many times as often, at most once per
# the broker's tick (a release is granted at once, an expiry at the next tick): a joiner
# heard of its queues only at its first heartbeat, 3.3 s after the join by default
# (review19 R19-5). Not every tick, and not for members that hold some queues: a join
# into 200 members of 16,384 queues leaves 98 of them awaiting a queue, and there a
# heartbeat that reports its generation costs the broker ~0.7 ms (it scans the holders
# for queues to release): 3 a second each for a handover was ~0.7 s of CPU a join.
AWAITING_BEATS: Final = 10
AWAITING_BEAT_S: Final = 0.1


# Places of the broker's max_in_flight a member leaves free of long polls: a heartbeat's
# and a commit's (a held pull holds its place until answered: with every place held,
# they would wait behind the pulls' waits).
FREE_PLACES: Final = 2


def long_polls(client: object) -> int:
    """How many pulls a member holds in flight at once (``pollers``): MAX_POLLERS, but
    FREE_PLACES fewer than the broker's max_in_flight (the welcome's, on ``client``'s
    connection) and one at least. A client that shows no welcome (a wrapper): MAX_POLLERS."""
    limit = welcome_limit(client, "max_in_flight")
    if limit is None:
        return MAX_POLLERS
    return max(1, min(MAX_POLLERS, limit - FREE_PLACES))


def welcome_limit(client: object, name: str) -> int | None:
    """The broker's limit ``name`` from the welcome on ``client``'s connection; None when
    the client shows none (a wrapper, or a broker that does not send it)."""
    limits = getattr(getattr(client, "welcome", None), "limits", None)
    limit = limits.get(name) if isinstance(limits, dict) else None
    return limit if type(limit) is int else None


def poll_wait_ms(queues: int, pollers: int = MAX_POLLERS) -> int:
    """The wait of each pull of a member holding ``queues`` queues. Up to ``pollers``
    each is long-polled; past it they take turns, ``pollers`` at a time, each waiting
    its share of POLL_WAIT_MS: a round of every queue still takes about POLL_WAIT_MS and
    an idle member sends about ``queues`` pulls a second (none waiting: thousands)."""
    if queues <= pollers:
        return POLL_WAIT_MS
    return max(MIN_POLL_WAIT_MS, POLL_WAIT_MS * pollers // queues)


class Asked(NamedTuple):
    """What the caller asked for and a join reads. In one attribute: a GroupState of more
    than 30 attributes no longer shares its dict's keys, and CPython 3.11 then does not
    specialize its attribute loads (2,000 instructions a message more in a poll loop)."""

    start: Start
    batch_size: int  # as given; GroupState.batch_size is a pull's (fit_pulls)
    prefetch: int
    max_retries: int | None


class GroupState:
    def __init__(
        self,
        where: str,
        group: str,
        topics: str | Iterable[str],
        *,
        tags: str | Iterable[str] | None,
        batch_size: int,
        prefetch: int = DEFAULT_PREFETCH,
        auto_commit: bool,
        auto_commit_interval: float,
        session_timeout: float,
        max_poll_interval: float,
        max_retries: int | None,
        consumer_id: str | None,
        start: Start = "committed",
    ) -> None:
        self.where = where
        # the store's checks (equeue/store/consumerargs.py): its classes and messages; the
        # broker's stricter group rule (retry.check_group_name) answers the join
        self.group = check_group(group)
        self.topics = check_topics(topics)
        self.tags = check_tags(tags)
        start = check_start(start)
        batch_size = check_count(batch_size, "batch_size")
        if not isinstance(prefetch, int) or isinstance(prefetch, bool):
            raise InvalidTypeError(f"prefetch must be an int, got {type(prefetch).__name__}")
        if not 1 <= prefetch <= MAX_PREFETCH:
            raise InvalidMessageError(f"prefetch={prefetch} must lie in [1, {MAX_PREFETCH}]")
        self.refill = False  # a queue's buffer fell to low_water: pull it again
        if not isinstance(auto_commit, bool):
            raise InvalidTypeError(f"auto_commit must be a bool, got {type(auto_commit).__name__}")
        self.auto_commit = auto_commit
        self.auto_commit_interval = _seconds(auto_commit_interval, "auto_commit_interval")
        self.session_timeout_ms = int(_seconds(session_timeout, "session_timeout") * 1000)
        self.max_poll_interval = _seconds(max_poll_interval, "max_poll_interval")
        if self.max_poll_interval <= 0:  # not "no limit": a member always late (review19 R19-3)
            raise InvalidMessageError(
                f"max_poll_interval={max_poll_interval!r} seconds must be > 0: it is how long "
                "the caller may take between two messages before the member stops "
                "heartbeating (default 300 s; raise it for slow handlers, there is no 'no limit')"
            )
        self.last_poll = time.monotonic()  # when the caller last asked for a message
        if max_retries is not None:  # before joining: as the broker's join would refuse it
            check_max_retries(max_retries)
        self.asked = Asked(start, batch_size, prefetch, max_retries)
        self.batch_size = self.low_water = 0  # (fit_pulls)
        self.fit_pulls(None)
        if consumer_id is None:
            consumer_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        elif not isinstance(consumer_id, str) or not consumer_id:
            raise InvalidTypeError(f"consumer_id must be a non-empty str: {consumer_id!r}")
        self.consumer = consumer_id
        self.lock = threading.Lock()  # the answer, between the heartbeat thread and the loop
        self.answer: dict[str, Any] | None = None
        self.lost = True  # not a member (yet, or any more): join first
        # raised by the loop from now on: the broker's nonsense (ProtocolError), or this
        # member fenced by another join of its consumer id (FencedMemberError)
        self.failure: EQueueError | None = None
        self.join_id: int | None = None  # the join's answer, carried by every request
        self.epoch = 0  # memberships so far: a pull sent in an earlier one is ignored
        self.applied: int | None = None
        self.news = False  # an answer not applied yet: the loop applies it at the next poll
        self.positions: dict[Queue, int] = {}
        # where each queue's processed messages end: an offset, or the Batch of the last
        # one (its offset worked out when asked: processed() and to_commit)
        self.processed: dict[Queue, int | Batch] = {}
        self.committed: dict[Queue, int] = {}
        self.buffer: deque[Batch] = deque()  # pulls' answers, each until handed out whole
        # the batch of the message handed out last, not processed yet (its ``next``)
        self.handed: Batch | None = None
        # the batches a poll_batch handed out from, in order, not processed yet (``handed``
        # is None then): the loop's next call marks them (done_with_pending). None, not an
        # empty list, when there are none: poll tests it at every message, and ``is not
        # None`` is a compare where a list's truth is a call (perfconsume: ~40 instructions)
        self.handed_before: list[Batch] | None = None
        self.closed = False
        self.closed_why = "is closed"  # (the ClosedError's words; forks.py: a forked child)

    def fit_pulls(self, max_pull_count: int | None) -> None:
        """Pull at most the broker's max_pull_count (its welcome's; None: not known) a
        time: it cuts each pull to that anyway, and a pull of that many is a whole batch
        (more are likely there: pulled again without a wait)."""
        wanted = self.asked.batch_size
        self.batch_size = wanted if max_pull_count is None else min(wanted, max_pull_count)
        # a queue is pulled again once no more than this many of its messages wait here
        self.low_water = (self.asked.prefetch - 1) * self.batch_size

    # --- the broker's answers ----------------------------------------------------------

    def member_args(self) -> dict[str, Any]:
        join_id = self.join_id
        if join_id is None:  # (not joined yet, or a broker that answers no join_id)
            return {"group": self.group, "consumer": self.consumer}
        return {"group": self.group, "consumer": self.consumer, "join_id": join_id}

    def join_args(self) -> dict[str, Any]:
        args: dict[str, Any] = {
            **self.member_args(), "topics": self.topics,
            "session_timeout_ms": self.session_timeout_ms,
        }  # fmt: skip
        if self.asked.max_retries is not None:
            args["max_retries"] = self.asked.max_retries
        return args

    def heartbeat_args(self) -> dict[str, Any]:
        args = self.member_args()
        if self.applied is not None:
            args["generation"] = self.applied
        return args

    def stalled(self) -> bool:
        """The caller has not asked for a message for max_poll_interval: no heartbeat."""
        return time.monotonic() - self.last_poll > self.max_poll_interval

    def joined(self, answer: object) -> None:
        """Keep a join's answer: its join_id goes with every later request."""
        join_id = answer.get("join_id") if isinstance(answer, dict) else None
        if join_id is not None and (type(join_id) is not int or join_id < 0):
            raise ProtocolError(f"{self.where}: a join_id must be a uint, got {join_id!r}")
        with self.lock:
            self.join_id = join_id
        self.take(answer)

    def take(self, answer: object) -> bool:
        """Keep an assignment answered by join or heartbeat; True if it is news. An
        answer of an earlier membership (a heartbeat of the heartbeat thread answered
        after the loop joined again) is ignored."""
        if (
            not isinstance(answer, dict)
            or type(answer.get("generation")) is not int
            or not isinstance(answer.get("assignment"), list)
        ):
            raise ProtocolError(f"{self.where}: an assignment must be a map with a generation")
        with self.lock:
            if self.join_id is not None and answer.get("join_id") != self.join_id:
                return False
            before = self.answer
            self.answer = answer
        news = before is None or before != answer
        if news:
            self.news = True
        return news

    def interval(self) -> float:
        """Seconds to the next heartbeat: the broker's interval, AWAITING_BEATS times
        as often while the member holds no queue and awaits some another member still
        holds (the broker hands them over at the heartbeat after their release: review19
        R19-5)."""
        with self.lock:
            answer = self.answer
        ms = answer.get("heartbeat_interval_ms") if answer else None
        seconds = ms / 1000 if isinstance(ms, int) and ms > 0 else self.session_timeout_ms / 3000
        if answer and not answer["assignment"] and self.awaiting():
            return max(AWAITING_BEAT_S, seconds / AWAITING_BEATS)
        return seconds

    def awaiting(self) -> int:
        """How many queues of its share the broker's latest answer says another member
        still holds (a broker from before the count: none)."""
        answer = self.answer  # (replaced whole by take(): one read)
        count = answer.get("awaiting") if answer else None
        return count if type(count) is int and count > 0 else 0

    def hold_idle_clock(
        self, start: float, timeout: float | None, deadline: float | None
    ) -> float | None:
        """A poll's deadline, ``timeout`` after ``start`` as given: while the member
        awaits queues of its share, the idle clock starts again (nothing *could* come from
        them yet), for at most a session timeout after ``start`` (a holder whose handler
        is slower than that: the timeout runs as before)."""
        if timeout is None or deadline is None or not self.awaiting():
            return deadline
        now = min(time.monotonic(), start + self.session_timeout_ms / 1000)
        return max(deadline, now + timeout)

    def plan(self) -> tuple[int, list[Queue], list[Queue]] | None:
        """(generation, queues to drop, queues to add) to apply the latest answer, or
        None when it is applied."""
        with self.lock:
            answer = self.answer
            self.news = False
        if answer is None:
            return None
        wanted: set[Queue] = set()
        for item in answer["assignment"]:
            if (
                type(item) is not list
                or len(item) != 2
                or type(item[0]) is not str
                or type(item[1]) is not int
            ):
                raise ProtocolError(f"{self.where}: an assignment lists [topic, queue_id]")
            wanted.add((item[0], item[1]))
        generation: int = answer["generation"]
        held = set(self.positions)
        if generation == self.applied and wanted == held:
            return None
        return generation, sorted(held - wanted), sorted(wanted - held)

    def reset(self) -> None:
        """Membership lost: every queue dropped uncommitted (its messages come again)."""
        self.drop(list(self.positions))
        self.epoch += 1
        self.applied = None
        with self.lock:
            self.answer = None
            self.join_id = None
        self.lost = True

    def lose(self, error: EQueueError) -> None:
        """A request of the loop's refused (GroupError) or its connection lost: join
        again before another message is handed out. Fenced: raise it, now and at every
        later poll (the loop's requests are of its current membership; joining again
        would fence the member that replaced this one)."""
        if isinstance(error, FencedMemberError):
            self.failure = error
            raise error
        self.lost = True
        # what was fetched for the lost membership is not handed out: its queues may be
        # another member's by now, which has read those messages (review19 R19-8)
        self.buffer.clear()

    def raise_if_fenced(self) -> None:
        """A fenced member's commit raises, also with nothing to commit (a queue never
        moved past its start sends no request that the broker could refuse)."""
        if isinstance(self.failure, FencedMemberError):
            raise self.failure

    def fenced(self, error: FencedMemberError, args: dict[str, Any]) -> bool:
        """The heartbeat thread's request of ``args`` was fenced: True if that is this
        membership (the loop raises the error from now on), False if the loop joined
        again since (the request was of the membership it replaced: nothing to do)."""
        with self.lock:
            if args.get("join_id") != self.join_id:
                return False
        self.failure = error
        return True

    # --- queues ------------------------------------------------------------------------

    def drop(self, queues: list[Queue]) -> None:
        gone = set(queues)
        for key in gone:
            for table in (self.positions, self.processed, self.committed):
                table.pop(key, None)
        if gone:
            self.buffer = deque(batch for batch in self.buffer if batch.key not in gone)
            if self.handed is not None and self.handed.key in gone:
                self.handed = None
            if self.handed_before is not None:
                kept = [b for b in self.handed_before if b.key not in gone]
                self.handed_before = kept or None

    def add(self, key: Queue, committed: object, queue_range: object) -> None:
        """Start ``key`` at the group's committed offset (the broker's answers to
        committed_offset and queue_range), else at its first offset."""
        if committed is not None and type(committed) is not int:
            raise ProtocolError(f"{self.where}: a committed offset must be a uint or nil")
        if (
            type(queue_range) is not list
            or len(queue_range) != 2
            or not all(type(v) is int for v in queue_range)
        ):
            raise ProtocolError(f"{self.where}: a queue range must be [first, next]")
        first, following = queue_range
        if committed is not None:
            at = min(max(committed, first), following)
        elif self.asked.start == "latest" and not key[0].startswith(RETRY_PREFIX):
            at = following  # (the retry queue holds only this group's own copies: all read)
        else:
            at = first
        self.positions[key] = self.processed[key] = at
        # Where the group committed none, its start is left due: committed at the next
        # commit (in windows, within a poll's timeout), it is what tells retention with
        # retention_respects_consumers that the group reads this queue; a start taken as
        # committed left a joined member's unread messages unprotected (review 36-2 H2).
        if committed is not None:
            self.committed[key] = committed

    def commit_args(self, key: Queue, offset: int) -> dict[str, Any]:
        return {**self.member_args(), "topic": key[0], "queue_id": key[1], "offset": offset}

    def pull_args(self, key: Queue, wait_ms: int) -> dict[str, Any]:
        args: dict[str, Any] = {
            "topic": key[0], "queue_id": key[1], "offset": self.positions[key],
            "max_count": self.batch_size, **self.member_args(),
        }  # fmt: skip
        if wait_ms:
            args["wait_ms"] = wait_ms
        if self.tags is not None:
            args["tags"] = self.tags
        return args

    def wants_pull(self, key: Queue) -> bool:
        return key in self.positions and self.buffered(key) <= self.low_water

    def buffered(self, key: Queue) -> int:
        """Messages of ``key`` fetched and not handed out yet."""
        return sum(b.count - b.next for b in self.buffer if b.key == key)

    def held(self) -> int:
        """Messages fetched and not handed out yet."""
        return sum(b.count - b.next for b in self.buffer)

    def pulled(self, key: Queue, at: int, answer: object) -> int:
        """A pull of ``key`` from ``at`` answered: its messages to the buffer (dropped if
        the queue was dropped or moved on meanwhile); how many."""
        if self.positions.get(key) != at:
            return 0
        result = unpack_any(answer, self.where)
        following = result.next_offset
        if following <= at:
            return 0
        self.positions[key] = following
        messages = result.messages
        if not messages:  # a tag filter passed over them: nothing of it is in hand
            handed = self.handed
            if not (handed is not None and handed.key == key) and not self.buffered(key):
                self.processed[key] = following  # (else: once what is at hand is)
            return 0
        if key[0].startswith(RETRY_PREFIX):
            # retry copies are handed out at their original places, but the retry queue
            # is committed at its own offsets: the copies' are kept for Batch.after
            offsets = [m.queue_offset for m in messages]
            self.buffer.append(Batch(list(map(restore, messages)), key, following, offsets))
        else:
            self.buffer.append(Batch(messages, key, following))
        return len(messages)

    def next_message(self) -> Message:
        """The next message (the buffer holds one). GroupConsumer.poll has it inline."""
        batch = self.buffer[0]
        i = batch.next
        message = batch.messages[i]
        batch.next = i = i + 1
        if i == batch.count:  # handed out whole: its queue may want its next pull
            self.buffer.popleft()
            self.refill = True
        self.handed = batch
        return message

    def done_with_pending(self) -> None:
        """The message handed out last is processed (the caller came back, commits or
        closes), and every message of the last poll_batch, in order."""
        batch = self.handed
        if batch is not None:  # (the common case, once a message: _done inline)
            # handed_before is None while a message is in hand (more_messages empties
            # handed into it, and what hands one out marks those first): not looked at
            self.handed = None
            if not batch.done and batch.key in self.processed:
                self.processed[batch.key] = batch
            batch.done = batch.next
            return
        before = self.handed_before
        if before is not None:
            self.handed_before = None
            for earlier in before:
                self._done(earlier)

    def _done(self, batch: Batch) -> None:
        # the batch works its offset out (after()): put in once, at its first message
        if not batch.done and batch.key in self.processed:
            self.processed[batch.key] = batch
        batch.done = batch.next

    def more_messages(self, messages: list[Message], limit: int) -> None:
        """poll_batch: after its first message (poll's), those at hand without I/O, up to
        ``limit`` in all, none past an assignment not applied yet. They count as processed
        together, once the caller comes back, as the store's poll has it: so ``handed`` is
        emptied into ``handed_before``, which poll, iteration, commit and close mark."""
        before: list[Batch] = []
        while len(messages) < limit and self.buffer and not (self.news or self.lost):
            batch = self.buffer[0]
            if self.handed is not None and self.handed is not batch:
                before.append(self.handed)
                self.handed = None
            messages.append(self.next_message())
        if before:
            if self.handed is not None:
                before.append(self.handed)
                self.handed = None
            self.handed_before = before
            # the blocking loop's iteration marks ``handed`` inline: refill sends its next
            # message the long way, through _poll, which marks these first
            self.refill = True

    def processed_offset(self, key: Queue) -> int:
        found = self.processed[key]
        return found if type(found) is int else found.after()  # type: ignore[union-attr]

    def to_commit(self, queues: Iterable[Queue] | None = None) -> dict[Queue, int]:
        if self.lost:  # e.g. a nack failed: its queues are read again from their commits
            return {}
        keys = list(self.processed if queues is None else queues)
        offsets = {key: self.processed_offset(key) for key in keys if key in self.processed}
        return {key: at for key, at in offsets.items() if at != self.committed.get(key)}


class Batch:
    """One pull's messages in the buffer, handed out in turn from ``next``."""

    __slots__ = ("count", "done", "following", "key", "messages", "next", "offsets")

    def __init__(
        self,
        messages: list[Message],
        key: Queue,
        following: int,
        offsets: list[int] | None = None,
    ) -> None:
        self.messages = messages
        # the messages' offsets in ``key`` where they differ from their queue_offset (retry
        # copies, restored to their original topic's place): None, they are the same
        self.offsets = offsets
        self.count = len(messages)
        self.key = key
        self.following = following  # where the queue's next pull starts
        self.next = 0  # the next to hand out
        self.done = 0  # how many are processed

    def after(self) -> int:
        """Where the processed ones end: after the last (past entries a tag filter
        skipped, for the last of the batch)."""
        done = self.done
        if done == self.count:
            return self.following
        offsets = self.offsets
        if offsets is not None:
            return offsets[done - 1] + 1 if done else offsets[0]
        return self.messages[done - 1].queue_offset + 1 if done else self.messages[0].queue_offset


def _seconds(value: object, what: str) -> float:
    """A duration that has no "None: no bound" (check_seconds' None is a wrong type here)."""
    seconds = check_seconds(value, what)
    if seconds is None:
        raise InvalidTypeError(f"{what} must be seconds (an int or a float)")
    return seconds


def closed_in_child(state: GroupState, parent: int, remedy: str) -> None:
    """A member made before a fork, in the child: closed there, its membership left to
    the parent (forks.py): no call commits, nacks or leaves on the parent's behalf."""
    state.closed = True
    state.closed_why = f"{forks.made_before_fork(parent)}; {remedy}"


def handled_normally() -> bool:
    """At a close() without ``processed=``: whether the message in hand counts as
    processed, i.e. no exception is being handled at the call. ``try: for m in consumer:
    handle(m)`` then ``finally: consumer.close()`` with handle raising committed the
    failed message before (reviewk F3): at least once held only inside ``with``."""
    return sys.exc_info()[0] is None


class Timeout(enum.Enum):
    """run()'s default timeout: the member's own (``timeout=`` where it was made). A
    default of None let a member made with timeout=1.0 block in run() for ever while
    ``for message in consumer`` ended after 1 s (reviewk F5)."""

    MEMBER = "the member's timeout"


MEMBER_TIMEOUT: Final = Timeout.MEMBER
