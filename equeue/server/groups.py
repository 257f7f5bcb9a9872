"""Consumer groups that share topics: membership, EQueue's average allocation, heartbeats,
session timeouts and generations (docs/groups.md).

The broker keeps one GroupCoordinator and calls it on its event-loop thread only (no
locks). Membership lives in memory: a broker restart forgets it, and every member's
next request answers GroupError, upon which the client joins again.

Allocation: the queues of the group's topics, sorted by (topic, queue id), are cut into
contiguous slices over the members sorted by consumer id, the first ``n % k`` members one
queue more (EQueue's average allocation). The queue(s) of its retry topic
``equeue.retry.GROUP`` are shared out apart, round-robin over the members with the fewest
topic queues first (ties by consumer id): a retry queue is mostly idle, so counted as a
topic queue it would leave some member one topic queue short. Each rebalance (a member
joins, leaves or expires; a topic gains queues) starts a new generation with a new
*target* allocation.

Per queue one consumer at a time: a queue has at most one *holder*. A queue whose
target is a member is handed to it only once nobody holds it: its previous holder
released it, or that holder's session expired. A holder releases a revoked queue by
a heartbeat whose ``generation`` is the generation of the last assignment it was given
(it has applied it: it committed what it processed of the queues not in it and stopped
pulling them). ``check_owner`` (every pull and commit_offset of a member) accepts only
the holder, so a revoked queue can still get its holder's last commit.

An assignment, as join and heartbeat answer it, lists the queues the member holds and
is to keep: its target queues that are free or already its own.

One member per consumer id (Kafka's static membership, FENCED_INSTANCE_ID): each join
is answered a ``join_id`` the member carries in every later group request; a join of an
id already in the group replaces that member, and a request carrying the replaced
member's join_id is refused with FencedMemberError (two processes with one consumer id
would otherwise both hold, pull and commit every queue of that id). A request without
a join_id (a client from before join ids) is taken as the current member's.

A broker stalled past a session timeout (SIGSTOP, a VM freeze, a long loop turn) reads
the heartbeats queued meanwhile only after its first tick: a tick that comes late pushes
the last heartbeat of every member whose session the stall could end (half its timeout or
more) forward by the stall, so the stall is not charged to them.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from equeue.errors import (
    ChunkRemovedError,
    CompactedAwayError,
    FencedMemberError,
    GroupError,
    InvalidMessageError,
    InvalidTypeError,
    LimitExceededError,
    TopicNotFoundError,
)
from equeue.protocol.retries import check_max_retries
from equeue.server import groupskips, retry
from equeue.server.groupskips import MAX_COUNTED_RANGES as MAX_COUNTED_RANGES
from equeue.server.groupskips import MAX_SKIP_GROUPS as MAX_SKIP_GROUPS
from equeue.server.groupskips import MAX_SKIP_RANGES as MAX_SKIP_RANGES
from equeue.server.groupskips import _Skipped as _Skipped
from equeue.store import validate

if TYPE_CHECKING:
    from equeue.store.store import MessageStore

log = logging.getLogger("equeue.groups")

Queue = tuple[str, int]  # (topic, queue id)

DEFAULT_SESSION_TIMEOUT_MS: Final = 10_000
MIN_SESSION_TIMEOUT_MS: Final = 200
MAX_SESSION_TIMEOUT_MS: Final = 600_000
# Heartbeats come this many times per session timeout: two may be lost in a row.
HEARTBEATS_PER_SESSION: Final = 3
MAX_TOPICS: Final = 64  # topics one group subscribes
MAX_CONSUMER_BYTES: Final = 255
# Per group: each join rebalances over every member and queue (~12 ms of CPU at 1,000
# members x 16,384 queues: docs/groups.md, "What a big group costs").
MAX_MEMBERS: Final = 1024
# How often the broker calls tick() (serve.py's TICK_S). A tick later than LATE_TICK_S
# after the previous one means the broker's loop stalled: the members' heartbeats of
# that time wait unread in their sockets, so the stall is not counted against them.
TICK_S: Final = 0.1
LATE_TICK_S: Final = 2 * TICK_S + 0.05
# A stall at least this long is logged (a warning: sessions were extended by it).
LOGGED_STALL_S: Final = 1.0
# join ids start at a random point in each run of the broker: a member of an earlier run
# (before a restart) carries a join_id that no member of this run has, with near certainty
JOIN_ID_BITS: Final = 48  # (its sums stay below 2**53, exact in any client's numbers)


MAX_REPLACED: Final = 8  # replaced join ids a member remembers (for its errors' wording)


@dataclass
class _Member:
    topics: tuple[str, ...]
    session_timeout_ms: int
    max_retries: int
    last_seen: float
    join_id: int  # carried by its requests: another join of its consumer id fences them
    # The last assignment answered to it: (generation, queues). A heartbeat reporting
    # that generation releases every queue it holds outside those queues.
    given: tuple[int, frozenset[Queue]] = (0, frozenset())
    # The join ids of the live members of its consumer id it replaced (the last
    # MAX_REPLACED): a request with one is a fenced member's; another stale join id is not
    # (the FencedMemberError says which)
    replaced: tuple[int, ...] = ()


@dataclass
class _Group:
    name: str
    topics: tuple[str, ...] = ()
    members: dict[str, _Member] = field(default_factory=dict)
    generation: int = 0
    queues: list[Queue] = field(default_factory=list)
    queue_counts: tuple[int, ...] = ()  # what queues was made of (_queue_counts)
    target: dict[Queue, str] = field(default_factory=dict)
    # target by member (made with it): a heartbeat's answer reads its member's share, not
    # the whole target (members heartbeat more often while they await queues: R19-5)
    shares: dict[str, list[Queue]] = field(default_factory=dict)
    holders: dict[Queue, str] = field(default_factory=dict)


def average_allocation(consumers: Sequence[str], queues: Sequence[Queue]) -> dict[Queue, str]:
    """EQueue's average allocation: sorted queues in contiguous slices over the sorted
    consumers, the first ``len(queues) % len(consumers)`` one queue more."""
    members = sorted(consumers)
    ordered = sorted(queues)
    if not members:
        return {}
    share, extra = divmod(len(ordered), len(members))
    target: dict[Queue, str] = {}
    start = 0
    for index, consumer in enumerate(members):
        size = share + (1 if index < extra else 0)
        for queue in ordered[start : start + size]:
            target[queue] = consumer
        start += size
    return target


def allocate(
    consumers: Sequence[str], queues: Sequence[Queue], retry_queues: Sequence[Queue]
) -> dict[Queue, str]:
    """The topic queues by average allocation, then the retry queues round-robin over the
    members holding fewest topic queues first (see the module docstring)."""
    target = average_allocation(consumers, queues)
    if not consumers:
        return target
    held = {c: 0 for c in consumers}
    for consumer in target.values():
        held[consumer] += 1
    order = sorted(consumers, key=lambda c: (held[c], c))
    for index, queue in enumerate(sorted(retry_queues)):
        target[queue] = order[index % len(order)]
    return target


class GroupCoordinator:
    """Every consumer group of one broker (see the module docstring)."""

    def __init__(
        self,
        store: MessageStore,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        retry_delays: Sequence[float] = retry.DEFAULT_DELAYS,
        max_retries: int = retry.DEFAULT_MAX_RETRIES,
        max_groups: int | None = None,
    ) -> None:
        self.store = store
        self.max_groups = max_groups  # None: no limit (the broker gives its setting)
        self._retry_topics: int | None = None  # in the store: counted at the first new group
        self.clock = clock
        self.max_retries = check_max_retries(max_retries)
        self.retries = retry.Retries(store, wall_clock=wall_clock, delays=retry_delays)
        self._groups: dict[str, _Group] = {}
        # Per group, per queue: offsets retention removed before the group consumed them
        # (its committed offset, or a member's position, below the queue's first).
        self.skipped: dict[str, dict[Queue, _Skipped]] = {}
        # One counter for every group: a group that lost its last member and is joined
        # again never repeats a generation its former members saw.
        self._generations = 0
        self._join_ids = secrets.randbits(JOIN_ID_BITS)
        self._last_tick: float | None = None
        # Groups whose deletion runs (groupdelete.py): their joins are refused meanwhile.
        self.deleting: set[str] = self.retries.deleting

    def persist_with(self, run: Callable[[Callable[[], None]], retry.Job]) -> None:
        """Run the retry mover's fdatasync and cursor write with ``run`` (off the loop)."""
        self.retries.background = run

    # --- the ops ---------------------------------------------------------------------

    def call(self, op: str, args: dict[str, Any]) -> Any:
        """The broker's dispatch of a group op (join, heartbeat, leave, nack), its
        arguments as ``equeue.protocol.ops.check_args`` let them through."""
        group, consumer = args["group"], args["consumer"]
        if op == "join":
            return self.join(
                group, consumer, args["topics"], args.get("session_timeout_ms"),
                max_retries=args.get("max_retries"),
            )  # fmt: skip
        join_id = args.get("join_id")
        if op == "heartbeat":
            return self.heartbeat(
                group, consumer, generation=args.get("generation"), join_id=join_id
            )
        if op == "leave":
            return self.leave(group, consumer, join_id=join_id)
        if op == "nack":
            return self.nack(
                group, consumer, args["message_id"], args.get("delay_ms"), join_id=join_id
            )
        raise InvalidMessageError(f"{op!r} is not a consumer-group op")

    def join(
        self,
        group: str,
        consumer: str,
        topics: Sequence[str],
        session_timeout_ms: int | None = None,
        *,
        max_retries: int | None = None,
    ) -> dict[str, Any]:
        """Add ``consumer`` to ``group`` (again: it starts afresh, holding nothing, and
        the member it replaces is fenced) and rebalance. Every member of a group
        subscribes the same topics."""
        retry.check_group_name(group)
        _check_consumer(consumer)
        names = _check_topics(topics, group)
        timeout = _check_timeout(session_timeout_ms)
        retries = self.max_retries if max_retries is None else check_max_retries(max_retries)
        for topic in names:
            self.store.queue_ids(topic)  # TopicNotFoundError before anything changes
        if group in self.deleting:
            raise GroupError(
                f"group {group!r} is being deleted (delete_group); join again once that "
                "deletion was answered: the group then starts with no committed offset"
            )
        state = self._groups.get(group)
        others = {} if state is None else {c: m for c, m in state.members.items() if c != consumer}
        if state is not None and others and state.topics != names:
            raise GroupError(
                f"group {group!r} consumes {list(state.topics)}; consumer {consumer!r} asked "
                f"for {list(names)}: every member of a group subscribes the same topics "
                "(use another group name for another subscription)"
            )
        if len(others) >= MAX_MEMBERS:
            raise LimitExceededError(
                f"group {group!r} has {len(others)} members, the most a group may have "
                f"(MAX_MEMBERS); consumer {consumer!r} was not added"
            )
        self._make_retry_topic(group)
        if state is None:
            state = self._groups[group] = _Group(group)
        replaced = state.members.get(consumer)
        now = self.clock()
        self._join_ids += 1
        if replaced is not None:
            log.warning(
                "consumer %r of group %r joined again while its session was live (join %d, "
                "last heartbeat %.1f s ago): that member is fenced, its requests are "
                "refused from now on (join %d); consumer ids must be unique among live members",
                consumer, group, replaced.join_id, now - replaced.last_seen, self._join_ids,
            )  # fmt: skip
        self._drop(state, consumer)
        state.topics = names
        member = _Member(names, timeout, retries, now, self._join_ids)
        if replaced is not None:
            member.replaced = (*replaced.replaced, replaced.join_id)[-MAX_REPLACED:]
        state.members[consumer] = member
        self._rebalance(state, f"{consumer!r} joined")
        return self._answer(state, consumer)

    def _make_retry_topic(self, group: str) -> None:
        """The group's retry topic, made at its first join (the group's allocation
        holds its queue from then on, and retention's holds and the mover's cursor find
        it); a group past max_groups is refused before anything is made."""
        topic = retry.retry_topic(group)
        try:
            self.store.queue_ids(topic)
            return  # a group joined before (this run or an earlier one)
        except TopicNotFoundError:
            pass
        limit = self.max_groups
        if limit is not None:
            if self._retry_topics is None:
                prefix = retry.RETRY_PREFIX
                self._retry_topics = sum(1 for t in self.store.topics() if t.startswith(prefix))
            if self._retry_topics >= limit:
                raise LimitExceededError(
                    f"{self.store.path} has {self._retry_topics} consumer groups (a retry topic "
                    f"each), the most max_groups={limit} allows (equeue serve --max-groups); "
                    f"group {group!r} was not created"
                )
        self.retries.ensure(topic, 1)
        if self._retry_topics is not None:
            self._retry_topics += 1

    def heartbeat(
        self,
        group: str,
        consumer: str,
        *,
        generation: int | None = None,
        join_id: int | None = None,
    ) -> dict[str, Any]:
        """Keep ``consumer``'s session; ``generation``: that of the last assignment it
        applied (releases the queues it was told to give up)."""
        state, member = self._member(group, consumer, join_id)
        member.last_seen = self.clock()
        if generation is not None and generation == member.given[0]:
            released = [
                q for q, holder in state.holders.items()
                if holder == consumer and q not in member.given[1]
            ]  # fmt: skip
            for queue in released:
                del state.holders[queue]
            if released:
                self._grant(state)
        return self._answer(state, consumer)

    def leave(self, group: str, consumer: str, *, join_id: int | None = None) -> None:
        """Remove ``consumer`` (it committed what it processed first) and rebalance."""
        state = self._groups.get(group)
        if state is None or consumer not in state.members:
            return  # gone already: leaving twice, or after its session expired
        self._member(group, consumer, join_id)  # a fenced member's leave would end another's
        self._drop(state, consumer)
        self._rebalance(state, f"{consumer!r} left")

    def check_owner(
        self, group: str, consumer: str, topic: str, queue_id: int, join_id: int | None = None
    ) -> None:
        """GroupError unless ``consumer`` (of ``join_id``, where given) holds the queue in
        ``group`` now."""
        state, _ = self._member(group, consumer, join_id)
        holder = state.holders.get((topic, queue_id))
        if holder != consumer:
            owner = "nobody" if holder is None else f"consumer {holder!r}"
            raise GroupError(
                f"consumer {consumer!r} of group {group!r} does not hold {topic}/{queue_id} "
                f"in generation {state.generation} ({owner} does); heartbeat for the "
                "current assignment"
            )

    def nack(
        self,
        group: str,
        consumer: str,
        message_id: str,
        delay_ms: int | None,
        *,
        join_id: int | None = None,
    ) -> None:
        """Send the message back for a retry after a delay, or to the dead-letter topic
        once it was retried ``max_retries`` times (equeue/server/retry.py)."""
        state, member = self._member(group, consumer, join_id)
        try:
            message = self.store.get(message_id)
        except (CompactedAwayError, ChunkRemovedError) as exc:
            # Removed since it was handed out: no copy can be made, and nothing else is
            # done. Answered as done, so the member goes on (an error reset its membership,
            # which the broker then logged as a fencing): reviewf F8.
            self.retries.nacked_removed += 1
            log.warning("group %r: nack of message %s not retried: %s", group, message_id, exc)
            return
        self.check_owner(group, consumer, message.topic, message.queue_id, join_id)
        if message.topic != retry.retry_topic(group) and message.topic not in state.topics:
            raise GroupError(f"message {message_id} of {message.topic} is not group {group!r}'s")
        self.retries.nack(group, message, delay_ms, member.max_retries)

    # retention's skips, counted: equeue/server/groupskips.py
    note_skip = groupskips.note_skip
    _check_retained = groupskips._check_retained
    skips = groupskips.skips
    skipped_counts = groupskips.skipped_counts

    def live_members(self, group: str) -> list[str]:
        """The consumer ids of ``group``'s members whose session has not ended."""
        state = self._groups.get(group)
        return [] if state is None else sorted(state.members)

    def forget_group(self, group: str) -> None:
        """``group`` was deleted: its skip counts and remembered nacks go, and the retry
        topics are counted again against max_groups."""
        self.skipped.pop(group, None)
        self.retries.forget(group)
        self._retry_topics = None

    def tick(self) -> None:
        """Expire members past their session timeout, pick up queues topics gained, move
        retries that are due. The broker calls it about every 100 ms (TICK_S)."""
        now = self.clock()
        self._forgive_stall(now)
        for state in list(self._groups.values()):
            expired = [c for c, m in state.members.items() if _expired(m, now)]
            for consumer in expired:
                log.warning(
                    "consumer %r of group %r missed its session timeout (%d ms); its queues "
                    "go to the others", consumer, state.name,
                    state.members[consumer].session_timeout_ms,
                )  # fmt: skip
                self._drop(state, consumer)
            if expired:
                self._rebalance(state, f"{', '.join(map(repr, expired))} expired")
            elif self._queue_counts(state) != state.queue_counts:
                self._rebalance(state, "its topics' queues changed")
        self.retries.move_due()

    def stats(self) -> dict[str, Any]:
        """Every group's ``detail`` (in-process callers and tests; the broker's ``stats``
        answers ``summary`` and one group's ``detail``: docs/protocol.md, "stats")."""
        offsets = self.store.consumer_groups() if self._groups else {}  # one read for all
        return {name: self._detail(name, offsets.get(name, {})) for name in self._groups}

    def live(self) -> list[str]:
        """The names of the groups with members now."""
        return list(self._groups)

    def summary(self, name: str) -> dict[str, Any]:
        """A live group in a few numbers: no per-member or per-queue item, so a ``stats``
        answer's size does not grow with the group (reviewg F11, F15)."""
        state = self._groups[name]
        return {
            "generation": state.generation,
            "topics": list(state.topics),
            "member_count": len(state.members),
            "queue_count": len(state.queues),
        }

    def detail(self, name: str) -> dict[str, Any] | None:
        """One live group, None if it has no member: generation, topics, members (their
        queues, how long since their last heartbeat), each queue's holder and target, and
        its lag (messages past the group's committed offset)."""
        if name not in self._groups:
            return None
        return self._detail(name, self.store.consumer_groups().get(name, {}))

    def _detail(self, name: str, committed: dict[str, dict[int, int]]) -> dict[str, Any]:
        state = self._groups[name]
        now = self.clock()
        lag: dict[str, int] = {}
        held: dict[str, list[list[Any]]] = {c: [] for c in state.members}
        for topic, queue_id in state.queues:
            holder = state.holders.get((topic, queue_id))
            if holder in held:  # one pass, not one per member (1,000 x 16,384: F15)
                held[holder].append([topic, queue_id])
            try:
                first, following = self.store.queue_range(topic, queue_id)
            except (TopicNotFoundError, InvalidMessageError):
                continue
            lag[f"{topic}/{queue_id}"] = following - max(
                first, committed.get(topic, {}).get(queue_id, 0)
            )
        return {
            "generation": state.generation,
            "topics": list(state.topics),
            "members": {
                c: {
                    "queues": held[c],
                    "since_heartbeat_ms": int((now - m.last_seen) * 1000),
                    "session_timeout_ms": m.session_timeout_ms,
                }
                for c, m in sorted(state.members.items())
            },
            "assignment": [
                [t, q, state.holders.get((t, q)), state.target.get((t, q))] for t, q in state.queues
            ],
            "lag": lag,
        }

    # --- internals -------------------------------------------------------------------

    def _forgive_stall(self, now: float) -> None:
        """After a late tick (the broker's loop stalled: this tick may run before the
        heartbeats queued meanwhile are read), push the last heartbeat of every member
        whose session the stall could end forward by the stall, not past now: each such
        session is extended by the stall, once. Only a stall of half a member's session
        timeout or more counts (a member heartbeats every third of it, so a shorter
        stall cannot expire a live one): ticks that are always a little late (a loaded
        broker) would otherwise extend every session at each tick, and a dead member
        expired only after several times its timeout (review 36-2 M1)."""
        last, self._last_tick = self._last_tick, now
        if last is None or now - last <= LATE_TICK_S:
            return
        stall = now - last - TICK_S
        for state in self._groups.values():
            for member in state.members.values():
                if stall * 2000 >= member.session_timeout_ms:
                    member.last_seen = min(now, member.last_seen + stall)
        if stall >= LOGGED_STALL_S and self._groups:
            log.warning(
                "the broker's tick came %.1f s late (its loop stalled); the members' "
                "sessions are extended by that much, not expired for it", stall,
            )  # fmt: skip

    def _member(
        self, group: str, consumer: str, join_id: int | None = None
    ) -> tuple[_Group, _Member]:
        state = self._groups.get(group)
        member = None if state is None else state.members.get(consumer)
        if state is None or member is None:
            raise GroupError(
                f"group {group!r} has no consumer {consumer!r} (never joined, left, or its "
                "session timed out, or the broker restarted): join again"
            )
        if join_id is not None and join_id != member.join_id:
            if join_id not in member.replaced:
                raise FencedMemberError(
                    f"join_id {join_id} is not consumer {consumer!r} of group {group!r}'s "
                    f"(its join is {member.join_id}) nor one of its replaced joins: a join id "
                    "of another consumer or group, or of a member that left or expired; the "
                    "request is refused (send the join_id your own join answered)"
                )
            raise FencedMemberError(
                f"consumer {consumer!r} of group {group!r} joined again from another "
                f"connection or process (join {member.join_id}); this member (join "
                f"{join_id}) is fenced: stop it, or give each process its own consumer_id "
                "(consumer ids must be unique among live members)"
            )
        return state, member

    def _drop(self, state: _Group, consumer: str) -> None:
        state.members.pop(consumer, None)
        for queue in [q for q, c in state.holders.items() if c == consumer]:
            del state.holders[queue]

    def _queues(self, state: _Group) -> list[Queue]:
        queues: list[Queue] = []
        for topic in (*state.topics, retry.retry_topic(state.name)):
            try:
                ids = self.store.queue_ids(topic)
            except TopicNotFoundError:  # deleted since: nothing to consume there
                continue
            queues += [(topic, q) for q in ids]
        return sorted(queues)

    def _queue_counts(self, state: _Group) -> tuple[int, ...]:
        """Each topic's queue count (-1: none such), the retry topic's last: all _queues
        depends on, which tick compares every 100 ms rather than the queues themselves
        (reviewg F15: 5.0 ms of CPU a tick at 16 topics x 1,024 queues, now 0.3 ms)."""
        counts = []
        for topic in (*state.topics, retry.retry_topic(state.name)):
            try:
                counts.append(len(self.store.queue_ids(topic)))
            except TopicNotFoundError:
                counts.append(-1)
        return tuple(counts)

    def _rebalance(self, state: _Group, why: str) -> None:
        self._generations += 1
        state.generation = self._generations
        if not state.members:
            del self._groups[state.name]
            log.info("group %r: no members left (%s)", state.name, why)
            return
        state.queues = self._queues(state)
        state.queue_counts = self._queue_counts(state)
        retry_topic = retry.retry_topic(state.name)
        state.target = allocate(
            list(state.members),
            [q for q in state.queues if q[0] != retry_topic],
            [q for q in state.queues if q[0] == retry_topic],
        )
        state.shares = {}
        for queue, consumer in state.target.items():
            state.shares.setdefault(consumer, []).append(queue)
        for queue in [q for q in state.holders if q not in state.target]:
            del state.holders[queue]  # a queue gone from the group (its topic deleted)
        self._grant(state)
        log.info(
            "group %r: generation %d (%s), %d members, %d queues",
            state.name, state.generation, why, len(state.members), len(state.queues),
        )  # fmt: skip

    def _grant(self, state: _Group) -> None:
        for queue, consumer in state.target.items():
            if queue not in state.holders:
                state.holders[queue] = consumer

    def _answer(self, state: _Group, consumer: str) -> dict[str, Any]:
        member = state.members[consumer]
        holders = state.holders
        mine = state.shares.get(consumer, ())
        queues = frozenset(q for q in mine if holders.get(q) == consumer)
        added = queues - member.given[1]
        member.given = (state.generation, queues)
        if added:
            self._check_retained(state, added)
        return {
            "generation": state.generation,
            "assignment": [list(q) for q in sorted(queues)],
            # its target queues another member still holds: handed over once released, so
            # the member asks again sooner meanwhile (review19 R19-5; older clients ignore it)
            "awaiting": len(mine) - len(queues),
            "heartbeat_interval_ms": member.session_timeout_ms // HEARTBEATS_PER_SESSION,
            "session_timeout_ms": member.session_timeout_ms,
            "retry_topic": retry.retry_topic(state.name),
            "dead_letter_topic": retry.dead_letter_topic(state.name),
            "join_id": member.join_id,
        }


def _expired(member: _Member, now: float) -> bool:
    return now - member.last_seen > member.session_timeout_ms / 1000


def _check_consumer(consumer: object) -> str:
    if not isinstance(consumer, str):
        raise InvalidTypeError(f"consumer must be a str, got {type(consumer).__name__}")
    size = len(validate.utf8(consumer, "consumer"))
    if not 1 <= size <= MAX_CONSUMER_BYTES:
        raise InvalidMessageError(
            f"consumer id must be 1 to {MAX_CONSUMER_BYTES} bytes UTF-8, got {size}"
        )
    return consumer


def _check_topics(topics: object, group: str) -> tuple[str, ...]:
    if not isinstance(topics, list | tuple) or not topics:
        raise InvalidMessageError("a consumer group member needs a non-empty list of topics")
    if len(topics) > MAX_TOPICS:
        raise InvalidMessageError(f"{len(topics)} topics; a group subscribes at most {MAX_TOPICS}")
    names = tuple(sorted({validate.check_topic(t) for t in topics}))
    for name in names:
        # the broker's own topics are read, not consumed by a group, but for dead letters
        if name.startswith(retry.RESERVED_PREFIX) and not name.startswith(retry.DLQ_PREFIX):
            raise InvalidMessageError(
                f"topic {name!r} is the broker's ({retry.RESERVED_PREFIX}*): a group may "
                f"consume dead letters ({retry.DLQ_PREFIX}GROUP) but not its retry or delay "
                "topics, which it gets by itself"
            )
    if retry.dead_letter_topic(group) in names:
        raise InvalidMessageError(
            f"group {group!r} cannot consume its own dead letters "
            f"({retry.dead_letter_topic(group)}): a message it fails on would come back to "
            "it for ever; consume them with another group"
        )
    return names


def _check_timeout(value: object) -> int:
    if value is None:
        return DEFAULT_SESSION_TIMEOUT_MS
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidTypeError(f"session_timeout_ms must be an int, got {type(value).__name__}")
    if not MIN_SESSION_TIMEOUT_MS <= value <= MAX_SESSION_TIMEOUT_MS:
        raise InvalidMessageError(
            f"session_timeout_ms={value} must lie in "
            f"[{MIN_SESSION_TIMEOUT_MS}, {MAX_SESSION_TIMEOUT_MS}]"
        )
    return value
