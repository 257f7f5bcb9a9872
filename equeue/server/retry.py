"""Retries and the dead-letter topic (RocketMQ's design; docs/groups.md).

A nacked message is copied to the internal topic ``equeue.delay``, whose queue i holds
the copies waiting ``delays[i]`` seconds: each queue is FIFO by due time, so the mover
(``move_due``, from the coordinator's tick) reads each from its cursor and stops at the
first copy not yet due. A due copy is appended to the group's retry topic
``equeue.retry.GROUP``, whose queues every member of the group consumes with the group's
own topics. After ``max_retries`` redeliveries the next nack sends the message to
``equeue.dlq.GROUP``, an ordinary topic.

A copy keeps body, tag, key, code and the sender's properties, and carries these:

* ``equeue.group``: the group; ``equeue.attempt``: how many times it was nacked;
* ``equeue.origin.topic``, ``equeue.origin.queue_id``, ``equeue.origin.offset``,
  ``equeue.origin.id``: where the message first was;
* ``equeue.due_ms``: when it is due (ms since the epoch; copies in ``equeue.delay``).

The mover's cursor in each delay queue is the committed offset of the internal group
``equeue.mover``, committed after the copies it moved were appended and the message log
fdatasynced (``store.flush_log``, once per tick for every delay queue; recovery rebuilds
queues from the log): a crash between the two moves them again (at least once), and
nothing is lost. The appends run on the broker's loop; the fdatasync and the cursor
write run off it (``background``: the broker's offset committer thread), and no copy is
moved until they ended; a failed write is tried again, never the move.

Short of a crash no copy is moved twice: a level's copies are sent a run of one group
at a time, in offset order, and the cursor passes each run once it is appended, so a
failure anywhere leaves it right after what was appended. A copy the store refuses (a
limit lowered since it was delayed) is dead-lettered and passed; any other failure (a
full disk) stops the tick and is tried again at the next.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final, Protocol

from equeue.digits import ascii_number
from equeue.errors import (
    EQueueError,
    InvalidMessageError,
    InvalidTypeError,
    MessageTooLargeError,
    StoreWriteError,
    TopicNotFoundError,
)
from equeue.format.message import MAX_NAME_BYTES, decode_message_id
from equeue.protocol.retries import (
    ATTEMPT,
    DELAY_TOPIC,
    DLQ_BODY_SIZE,
    DLQ_FROM,
    DLQ_PREFIX,
    DLQ_REASON,
    DUE_MS,
    GROUP,
    MOVER_GROUP,
    ORIGIN_ID,
    ORIGIN_OFFSET,
    ORIGIN_QUEUE,
    ORIGIN_TOPIC,
    RESERVED_PREFIX,
    RETRY_PREFIX,
    attempt_number,
    dead_letter_topic,
    origin_numbers,
    restore,
    retry_topic,
)
from equeue.store import offsets as group_offsets
from equeue.store import validate
from equeue.store.meta import MESSAGES_DIR
from equeue.store.types import Message, OutgoingMessage, SendResult

if TYPE_CHECKING:
    from equeue.store.store import MessageStore

__all__ = [  # the names of equeue/protocol/retries.py, for the broker's side
    "ATTEMPT", "DELAY_TOPIC", "DLQ_BODY_SIZE", "DLQ_PREFIX", "DLQ_REASON", "DUE_MS", "GROUP",
    "MOVER_GROUP", "ORIGIN_ID", "ORIGIN_OFFSET", "ORIGIN_QUEUE", "ORIGIN_TOPIC", "RESERVED_PREFIX",
    "RETRY_PREFIX", "Retries", "check_group_name", "dead_letter_topic", "restore", "retry_topic",
]  # fmt: skip

log = logging.getLogger("equeue.retry")


class Job(Protocol):
    """A future of the work run off the loop (asyncio's or concurrent.futures')."""

    def done(self) -> bool: ...
    def cancelled(self) -> bool: ...
    def exception(self) -> BaseException | None: ...


# Seconds a copy waits at each level (RocketMQ's levels from 1 s on, shortened).
DEFAULT_DELAYS: Final = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
DEFAULT_MAX_RETRIES: Final = 16
MAX_LEVELS: Final = 64
MAX_DELAY_S: Final = 86400 * 7  # a level's longest delay (retry_delays)
MOVE_BATCH: Final = 256  # copies moved per delay queue per tick: a tick stays short
FAILURE_REPEAT_S: Final = 60.0  # a mover failing every tick is logged again this often
# Repeat nacks recognised (RetryMover._nacked): 16,384 (group, message id) pairs, ~3 MB.
NACKS_REMEMBERED: Final = 16_384
# A message the store refuses for what it is (past max_message_size or
# max_properties_size, lowered since it was stored); anything else it raises is the
# store's state (a full disk, a failed write, closing) and passes.
_REFUSALS: Final = (InvalidMessageError, InvalidTypeError)

_OURS: Final = (GROUP, ATTEMPT, ORIGIN_TOPIC, ORIGIN_QUEUE, ORIGIN_OFFSET, ORIGIN_ID, DUE_MS)


def check_group_name(group: object) -> str:
    """A group of the broker names topics after itself, so it follows the topic rule."""
    if not isinstance(group, str):
        raise InvalidTypeError(f"group must be a str, got {type(group).__name__}")
    if len(group.encode(errors="replace")) > MAX_NAME_BYTES - len(RETRY_PREFIX):
        raise InvalidMessageError(
            f"group {group[:40]!r}... is too long: a broker's group name is at most "
            f"{MAX_NAME_BYTES - len(RETRY_PREFIX)} bytes (it names {RETRY_PREFIX}GROUP)"
        )
    if group.startswith(RESERVED_PREFIX):
        raise InvalidMessageError(
            f"group {group!r}: names starting {RESERVED_PREFIX!r} are the broker's own"
        )
    try:
        validate.check_topic(group)
    except InvalidMessageError as exc:
        raise InvalidMessageError(
            f"group {group!r}: a broker's group name follows the topic rule, as it names "
            f"the topics {RETRY_PREFIX}GROUP and {DLQ_PREFIX}GROUP ({exc})"
        ) from None
    return group


def origin(message: Message, group: str) -> tuple[dict[str, str], int]:
    """The properties naming where ``message`` first was, and its attempts so far: a
    copy in the group's retry topic carries them, any other message is its own origin."""
    props = message.properties
    if message.topic == retry_topic(group):
        attempt = attempt_number(props)
        names = (ORIGIN_TOPIC, ORIGIN_QUEUE, ORIGIN_OFFSET, ORIGIN_ID)
        if (
            attempt is not None
            and origin_numbers(props) is not None
            and all(k in props for k in names)
        ):
            return {k: props[k] for k in names}, attempt
        log.warning(
            "message %s in %s lacks its retry properties (or they are out of range): it is "
            "its own origin",
            message.message_id,
            group,
        )
    return {
        ORIGIN_TOPIC: message.topic,
        ORIGIN_QUEUE: str(message.queue_id),
        ORIGIN_OFFSET: str(message.queue_offset),
        ORIGIN_ID: message.message_id,
    }, 0


class Retries:
    """Delay queues, the mover, dead letters."""

    def __init__(
        self,
        store: MessageStore,
        *,
        wall_clock: Callable[[], float] = time.time,
        delays: Sequence[float] = DEFAULT_DELAYS,
    ) -> None:
        self.store = store
        self.wall_clock = wall_clock
        self.delays = _check_delays(delays)
        # The mover's committed cursors, read once: only this mover commits them, and a
        # committed_offset per queue per tick would merge every group's offsets each time.
        self._cursors: dict[int, int] = {}
        self._head_due: dict[int, float] = {}  # the due time of a queue's first copy waiting
        # The delay topic's latest deletion (a log position) when the cursors were taken:
        # a new one means its queues started again at offset 0 (_follow_deletion).
        self._delay_deleted = store.deleted_topics().get(DELAY_TOPIC)
        # Runs the mover's fdatasync and cursor write off the broker's loop (the broker
        # sets it: OffsetCommitter.run); None: in the caller, before move_due returns.
        self.background: Callable[[Callable[[], None]], Job] | None = None
        self._persisting: Job | None = None
        # Told of each copy appended (topic, queue id, offset, tag): the broker's held
        # pulls waiting on that queue are pulled again (holds.py ``noted``) at once, not
        # found by a look at every queue held each tick (reviewg F13).
        self.appended: Callable[[str, int, int, str], None] | None = None
        # Cursors moved past whose write failed (or has not run): written before any
        # further move, so what they cover is never moved again.
        self._unsaved: dict[tuple[str, int], int] = {}
        self._failure: str | None = None  # what fails, while the mover fails
        self._failure_said = 0.0  # time.monotonic() when it was last logged
        self._failed_ticks = 0
        self.moved = 0  # copies moved to retry topics (stats)
        self.dead = 0  # messages sent to dead-letter topics
        self.lost_to_retention = 0  # copies retention removed before they were moved
        # nacks of a message compaction or retention removed after it was handed out:
        # nothing left to retry (reviewf F8)
        self.nacked_removed = 0
        # The messages each group nacked lately (group, message id), oldest forgotten
        # first: a repeat nack of one (a handler that nacks twice, a member's own retry
        # loop, a redelivery after a member died before committing) is answered as done
        # without a second copy. A copy is a new message with its own id, so a message id
        # nacked again is always a repeat (reviewg F14: 200 nacks made 200 copies).
        self._nacked: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.nacked_again = 0
        # due copies of a group nacked before its retry topic was deleted (delete_group):
        # a group made again under the name gets none of them
        self.dropped_deleted = 0
        # due copies of a message whose topic was deleted after it was stored: shown with
        # its origin's coordinates, a topic made again under the name would have them
        # mean another message (review19 R19-6)
        self.dropped_deleted_topic = 0
        # second dead letters not made: a message read from a dead-letter topic that was
        # dead-lettered once from one already (R19-9)
        self.dead_letter_cycles = 0
        # groups whose deletion runs (the coordinator's set): their due copies wait, as
        # a move now would make the retry topic again under the deletion
        self.deleting: set[str] = set()
        # The cursors were set aside (below): a queue's first look may find copies it
        # had moved removed by retention, not lost; which queues it has not looked at.
        self._cursors_guessed: set[int] = set()
        self._cursors_set_aside = any(
            f"{MOVER_GROUP}.json" in problem for problem in store.recovery.problems
        )
        if self._cursors_set_aside:
            # Its cursors are gone with the file: the mover starts each delay queue at its
            # first retained copy, so copies it had moved already are moved again.
            log.warning(
                "the retry mover's cursors (consumers/%s.json) were lost (the file damaged "
                "and set aside, or missing: the open's problems say which): delayed retries "
                "already moved are delivered again (at least once)",
                MOVER_GROUP,
            )

    def nack(self, group: str, message: Message, delay_ms: int | None, max_retries: int) -> None:
        """Schedule ``message`` (of ``group``) for a retry, or dead-letter it. A message
        whose properties leave no room for the retry's (the store's max_properties_size)
        is dead-lettered with the retry's properties alone and ``equeue.dlq.reason``; if
        even that does not fit, with what fits (``_dead_letter_cut``)."""
        key = (group, message.message_id)
        if key in self._nacked:
            self.nacked_again += 1
            return
        try:
            self._nack(group, message, delay_ms, max_retries)
        except MessageTooLargeError as exc:
            found, attempts = origin(message, group)
            props = {**found, GROUP: group, ATTEMPT: str(attempts + 1)}
            props[DLQ_REASON] = f"no retry: {exc}"[:1024]
            how = self._dead_letter(group, message, props)
            self.dead += 1
            log.warning(
                "message %s of group %r: dead-lettered without its properties, %s (%s)",
                found[ORIGIN_ID], group, how, exc,
            )  # fmt: skip
        self._nacked[key] = None  # (not for a nack that failed: it may be made again)
        if len(self._nacked) > NACKS_REMEMBERED:
            self._nacked.popitem(last=False)

    def forget(self, group: str) -> None:
        """The group moved an offset back (to reprocess): its nacks are not repeats any
        more (review5 F3: a reprocessed message failing again got no retry)."""
        for key in [key for key in self._nacked if key[0] == group]:
            del self._nacked[key]

    def _dead_letter(self, group: str, message: Message, props: dict[str, str]) -> str:
        """Append the dead letter whole if the store takes it, else cut; says which."""
        try:
            self._append(dead_letter_topic(group), message, props, None)
        except InvalidMessageError as again:  # MessageTooLargeError among them
            return self._dead_letter_cut(group, message, props, again)
        return "whole"

    def _dead_letter_cut(
        self, group: str, message: Message, props: dict[str, str], error: Exception
    ) -> str:
        """The dead letter of a message that cannot be copied whole under the store's
        limits now (a store reopened with a smaller max_message_size or
        max_properties_size than it was written with): its body cut to max_message_size,
        ``equeue.dlq.body_size`` saying by how much, and of the properties (the origin
        first) those that fit in max_properties_size; what was cut, for the caller's log.
        It terminates: a nack that failed here would bring the message back, and fail
        again, for ever (and a due copy would block its delay level)."""
        config = self.store.config
        body = message.body
        cut = len(body) > config.max_message_size
        wanted = {DLQ_BODY_SIZE: str(len(body))} if cut else {}
        wanted[ORIGIN_ID] = props[ORIGIN_ID]
        wanted[DLQ_REASON] = f"cut to the store's limits: {error}"[:256]
        for name, value in props.items():  # the rest in order: topic, queue, offset, ...
            wanted.setdefault(name, value)
        kept: dict[str, str] = {}
        for name, value in wanted.items():
            trial = {**kept, name: value}
            try:
                validate.check_properties(trial, config.max_properties_size)
            except MessageTooLargeError:
                continue
            kept = trial
        if cut:
            body = body[: config.max_message_size]
        self.ensure(dead_letter_topic(group), 1)
        sent = self.store.send(
            dead_letter_topic(group), body, tag=message.tag, key=message.key, properties=kept,
            code=message.code,
        )  # fmt: skip
        self._sent(sent, message.tag)
        return (
            f"cut to the store's limits (body {len(body)} of {len(message.body)} bytes, "
            f"{len(kept)} of {len(wanted)} properties; equeue.dlq.reason says why)"
        )

    def _nack(self, group: str, message: Message, delay_ms: int | None, max_retries: int) -> None:
        found, attempts = origin(message, group)
        attempt = attempts + 1
        props = {k: v for k, v in message.properties.items() if k not in _OURS}
        props.update(found)
        props[GROUP] = group
        props[ATTEMPT] = str(attempt)
        if attempt > max_retries:
            source = found[ORIGIN_TOPIC]
            if not source.startswith(DLQ_PREFIX):
                # One a producer or a replay carried in from an ordinary topic says nothing
                # of this message's dead letters (review20 R20-5).
                props.pop(DLQ_FROM, None)
            elif DLQ_FROM in message.properties:
                self.dead_letter_cycles += 1
                log.warning(
                    "message %s of group %r, read from the dead-letter topic %s, failed %d "
                    "times and was dead-lettered from %s before: not dead-lettered again "
                    "(groups consuming each other's dead letters would pass it round for "
                    "ever); it stays in %s",
                    found[ORIGIN_ID], group, source, attempts, message.properties[DLQ_FROM],
                    source,
                )  # fmt: skip
                return
            else:
                props[DLQ_FROM] = source
            self._append(dead_letter_topic(group), message, props, None)
            self.dead += 1
            log.info("message %s of group %r: dead-lettered", found[ORIGIN_ID], group)
            return
        if delay_ms == 0:  # no wait: straight to the retry topic
            self._append(retry_topic(group), message, props, None)
            return
        level = self.level(attempt, delay_ms)
        props[DUE_MS] = str(int(self.wall_clock() * 1000 + self.delays[level] * 1000))
        self.ensure(DELAY_TOPIC, len(self.delays))
        sent = self.store.send(
            DELAY_TOPIC, message.body, tag=message.tag, key=message.key, properties=props,
            code=message.code, queue_id=level,
        )  # fmt: skip
        self._sent(sent, message.tag)

    def level(self, attempt: int, delay_ms: int | None) -> int:
        """The delay queue of a retry: the shortest level of at least ``delay_ms``, else
        (None) the attempt's own level, the last for every attempt past it."""
        if delay_ms is None:
            return min(attempt - 1, len(self.delays) - 1)
        for index, seconds in enumerate(self.delays):
            if seconds * 1000 >= delay_ms:
                return index
        return len(self.delays) - 1

    def move_due(self) -> int:
        """Append every due copy to its group's retry topic; how many were moved. A copy
        the store refuses for what it is goes to the dead-letter topic; any other failure
        (a full disk, a failed write) stops the move where it failed, keeps what was
        moved, and is tried again at the next tick: no copy is appended twice."""
        self._follow_deletion()
        if not self._durable():
            return 0  # the last move is not durable yet: nothing more until it is
        before = self.moved
        cursors: dict[tuple[str, int], int] = {}
        try:
            self._move(cursors)
        except EQueueError as exc:  # the store's state, not a copy's: the next tick retries
            self._failing("could not append a due copy", exc)
        else:
            self._working()
        finally:  # the cursors of what was appended before any failure, too
            if cursors or self._unsaved:  # (or passed past copies lost to retention)
                self._unsaved.update(cursors)
                self._save()
        return self.moved - before

    def _move(self, cursors: dict[tuple[str, int], int]) -> None:
        try:
            delay_queues = self.store.queue_ids(DELAY_TOPIC)
        except TopicNotFoundError:
            return
        now_ms = self.wall_clock() * 1000
        for queue_id in delay_queues:
            due = self._due(queue_id, now_ms)
            if due:
                self._move_level(queue_id, due, cursors)

    def _follow_deletion(self) -> None:
        """The delay topic deleted (a caller's handle can, under an embedded broker) since
        the last look: its queues start again at offset 0, so the cursors and head due
        times kept for the copies that went with it no longer apply. A cursor kept would
        skip the new copies below it; a head due time kept would hold them back until
        then, which after a wall-clock step back is later than theirs. (The deletion
        dropped the cursors' file entries; the ones not yet written are dropped here.)"""
        deleted = self.store.deleted_topics().get(DELAY_TOPIC)
        if deleted == self._delay_deleted:
            return
        self._delay_deleted = deleted
        self._head_due.clear()
        self._cursors = dict.fromkeys(self._cursors, 0)
        self._unsaved = {key: at for key, at in self._unsaved.items() if key[0] != DELAY_TOPIC}

    def _due(self, queue_id: int, now_ms: float) -> list[Message]:
        first, following = self.store.queue_range(DELAY_TOPIC, queue_id)
        at = self._start(queue_id, first)
        if at > following:  # the topic was deleted and made again: start over
            at = self._cursors[queue_id] = first
        if at >= following or self._head_due.get(queue_id, 0) > now_ms:
            return []
        due: list[Message] = []
        for message in self.store.pull(DELAY_TOPIC, queue_id, at, MOVE_BATCH):
            due_ms = self._due_ms(message, now_ms)
            if due_ms > now_ms:
                # FIFO by due time: the rest of the queue waits too, and until then the
                # queue is not read again
                self._head_due[queue_id] = due_ms
                break
            due.append(message)
        return due

    def _due_ms(self, message: Message, now_ms: float) -> int:
        """When a delay copy is due, ms since the epoch: its ``equeue.due_ms`` as _nack
        writes it, ASCII digits at most MAX_DELAY_S past now. Anything else is not the
        mover's (float() took "inf", "1e400" and 20-digit values, due never: the level's
        FIFO waited behind the copy for ever; "nan" and "-5" moved it out of order): the
        damage logged, and the copy due now, as one without a due time (a copy is read
        from the log like any message: its properties are bytes a file holds)."""
        text = message.properties.get(DUE_MS)
        due = None if text is None else ascii_number(text)
        if due is not None and due <= now_ms + MAX_DELAY_S * 1000:
            return due
        log.warning(
            "the copy at %s queue %d offset %d (message %s, log position %d in %s): %s %s "
            "is not a due time the retry mover writes (ASCII digits, ms since the epoch, "
            "at most %d s ahead); moved now",
            DELAY_TOPIC, message.queue_id, message.queue_offset, message.message_id,
            message.position, self.store.path / MESSAGES_DIR, DUE_MS,
            "absent" if text is None else repr(text[:40]), MAX_DELAY_S,
        )  # fmt: skip
        return 0

    def _move_level(
        self, queue_id: int, due: list[Message], cursors: dict[tuple[str, int], int]
    ) -> None:
        """One send per run of consecutive copies of one group, in offset order, the
        cursor passing each run as soon as it is appended: whatever fails, the cursor
        stands right after what was appended (a batch per group would append copies past
        one that failed, and move them again)."""
        deleted = self.store.deleted_topics()
        for group, run in _runs(due):
            if group is None:
                for message in run:
                    log.warning("%s in %s names no group; dropped", message.message_id, DELAY_TOPIC)
                self._pass(queue_id, run[-1], cursors)
                continue
            if group in self.deleting:  # moved or dropped once the deletion ended
                return
            target = retry_topic(group)
            gone = deleted.get(target, -1)
            if run[0].position < gone:  # nacked before the group (its retry topic) was deleted
                stale = [message for message in run if message.position < gone]
                self.dropped_deleted += len(stale)
                log.info(
                    "%d delayed retries of group %r dropped: nacked before %s was deleted "
                    "(delete_group)", len(stale), group, target,
                )  # fmt: skip
                self._pass(queue_id, stale[-1], cursors)
                run = run[len(stale) :]
                if not run:
                    continue
            # The cursor passes the whole run once its kept copies are in: a dropped copy
            # after the last kept one is not met (and counted) again (review20 R20-8).
            whole, run = run, self._live_origins(queue_id, group, run, deleted, cursors)
            if not run:
                continue
            self.ensure(target, 1)
            try:
                sent = self.store.send_batch(target, [_copy(message) for message in run])
            except _REFUSALS:  # nothing written: find the copy (or copies) refused
                self._move_one_by_one(queue_id, group, run, cursors)
                self._pass(queue_id, whole[-1], cursors)
                continue
            except StoreWriteError as exc:  # a batch cut short: what it stored is moved
                if exc.sent:
                    self.moved += len(exc.sent)
                    self._pass(queue_id, run[len(exc.sent) - 1], cursors)
                raise
            self.moved += len(run)
            for result, message in zip(sent, run, strict=True):
                self._sent(result, message.tag)
            self._pass(queue_id, whole[-1], cursors)

    def _live_origins(
        self,
        queue_id: int,
        group: str,
        run: list[Message],
        deleted: dict[str, int],
        cursors: dict[tuple[str, int], int],
    ) -> list[Message]:
        """``run`` without the copies of messages whose topic was deleted after them (a
        topic made again under the name would show them at its own messages'
        coordinates); the cursor passes a run left empty."""
        kept = [m for m in run if not _origin_deleted(m, deleted)]
        if len(kept) < len(run):
            self.dropped_deleted_topic += len(run) - len(kept)
            log.info(
                "%d delayed retries of group %r dropped: their messages' topic was deleted "
                "after they were stored", len(run) - len(kept), group,
            )  # fmt: skip
            if not kept:
                self._pass(queue_id, run[-1], cursors)
        return kept

    def _move_one_by_one(
        self, queue_id: int, group: str, run: list[Message], cursors: dict[tuple[str, int], int]
    ) -> None:
        target = retry_topic(group)
        for message in run:
            try:
                (sent,) = self.store.send_batch(target, [_copy(message)])
                self.moved += 1
                self._sent(sent, message.tag)
            except _REFUSALS as exc:
                self._dead_letter_refused(group, message, exc)
            self._pass(queue_id, message, cursors)

    def _dead_letter_refused(self, group: str, message: Message, error: Exception) -> None:
        """A due copy the store refuses (past a limit lowered since it was delayed): it
        would block its level for every group, so it is dead-lettered as a nack that
        cannot be retried is (whole, else cut to the store's limits)."""
        props = {k: v for k, v in message.properties.items() if k != DUE_MS}
        props.setdefault(ORIGIN_ID, message.message_id)
        props[DLQ_REASON] = f"not moved to {retry_topic(group)}: {error}"[:1024]
        how = self._dead_letter(group, message, props)
        self.dead += 1
        log.warning(
            "a due retry of group %r (message %s, first at %s/%s offset %s) was refused by "
            "the store: %s; dead-lettered to %s %s. The limits are StoreConfig."
            "max_message_size and max_properties_size (equeue serve --max-frame-bytes)",
            group, props[ORIGIN_ID], props.get(ORIGIN_TOPIC, "?"), props.get(ORIGIN_QUEUE, "?"),
            props.get(ORIGIN_OFFSET, "?"), error, dead_letter_topic(group), how,
        )  # fmt: skip

    def _pass(self, queue_id: int, message: Message, cursors: dict[tuple[str, int], int]) -> None:
        """The cursor past ``message``, appended (or dead-lettered, or dropped): in memory
        at once, so no later tick moves it again; on disk once the log is flushed."""
        offset = message.queue_offset + 1
        cursors[(DELAY_TOPIC, queue_id)] = self._cursors[queue_id] = offset

    def _durable(self) -> bool:
        """Whether every move so far is durable (its cursors written after the log's
        fdatasync); if the last attempt failed, it is tried again now."""
        job = self._persisting
        if job is not None:
            if not job.done():
                return False
            self._persisting = None
            error = BaseException("cancelled") if job.cancelled() else job.exception()
            if error is None:
                self._unsaved = {}
            else:
                self._failing("could not make its move durable", error)
        if self._unsaved:
            self._save()
        return not self._unsaved and self._persisting is None

    def _save(self) -> None:
        cursors = dict(self._unsaved)
        # The delay topic's deletion marker the cursors belong to: a job still running
        # when the topic is deleted and made again must not write them for the new topic
        # (commit_group_file leaves out a topic deleted since; review 37-2 F1).
        marker = self._delay_deleted
        if self.background is not None:  # off the loop; a later tick sees how it ended
            self._persisting = self.background(lambda: self._persist(cursors, marker))
            return
        try:
            self._persist(cursors, marker)
        except (EQueueError, OSError) as exc:
            self._failing("could not make its move durable", exc)
        else:
            self._unsaved = {}

    def _persist(self, cursors: dict[tuple[str, int], int], marker: int | None) -> None:
        # The copies (and the delay entries they came from) durable in the message log
        # before the cursors say they were moved: recovery rebuilds the retry topics'
        # queues from the log, so the log's fdatasync suffices (no checkpoint of every
        # queue file); one for every delay queue of the tick, then one write of the
        # mover's offsets file. A failed fdatasync fails every later one (chunk.py), so a
        # retry never writes cursors past copies that may be lost.
        self.store.flush_log()
        self.commit_cursors(cursors, marker)

    def _failing(self, what: str, error: BaseException) -> None:
        """Logged once when the mover starts failing, then once a minute while it keeps
        failing (it is tried again every tick), and once when it works again."""
        self._failed_ticks += 1
        now = time.monotonic()
        if self._failure is not None and now - self._failure_said < FAILURE_REPEAT_S:
            return
        log.error(
            "the retry mover %s (%s)%s: it keeps what it moved, moves nothing twice and tries "
            "again every tick (said again once a minute while it fails, and when it works)",
            what, error,
            f", failing for {self._failed_ticks} ticks" if self._failure is not None else "",
        )  # fmt: skip
        self._failure, self._failure_said = what, now

    def _working(self) -> None:
        if self._failure is not None and not self._unsaved:
            log.warning(
                "the retry mover works again after %d failed ticks (%s)",
                self._failed_ticks, self._failure,
            )  # fmt: skip
            self._failure, self._failed_ticks = None, 0

    def commit_cursors(self, cursors: dict[tuple[str, int], int], marker: int | None) -> None:
        group_offsets.commit_group(self.store, MOVER_GROUP, cursors, {DELAY_TOPIC: marker})

    def _cursor(self, queue_id: int) -> int:
        cursor = self._cursors.get(queue_id)
        if cursor is None:
            found = self.store.committed_offset(MOVER_GROUP, DELAY_TOPIC, queue_id)
            if found is None and self._cursors_set_aside:
                self._cursors_guessed.add(queue_id)
            cursor = self._cursors[queue_id] = found or 0
        return cursor

    def _start(self, queue_id: int, first: int) -> int:
        """Where the mover reads delay queue ``queue_id`` from: its cursor, or the queue's
        first retained offset past it. Copies between the two were removed by retention
        before they were moved (a delay longer than ``retention``, or a store over
        ``max_store_bytes``, without ``retention_respects_consumers``): their nacks end
        there, neither retried nor dead-lettered, so they are logged and counted
        (``stats`` -> ``retry`` -> ``lost_to_retention``), once: the cursor passes them,
        on disk too (with the next cursor write)."""
        cursor = self._cursor(queue_id)
        guessed = queue_id in self._cursors_guessed
        self._cursors_guessed.discard(queue_id)
        if cursor >= first:
            return cursor
        self._cursors[queue_id] = self._unsaved[(DELAY_TOPIC, queue_id)] = first
        if guessed:  # the cursors were set aside: those may be copies it had moved
            return first
        self.lost_to_retention += first - cursor
        log.warning(
            "retention removed %d delayed retries of %s/%d (offsets %d to %d) before they "
            "were due: those nacks are lost, neither retried nor dead-lettered (%d lost so "
            "far). A retry delayed longer than the store's retention (--retention), or "
            "waiting while the store is over max_store_bytes (--max-store-bytes), can be "
            "removed; --retention-respects-consumers keeps them until moved",
            first - cursor, DELAY_TOPIC, queue_id, cursor, first - 1, self.lost_to_retention,
        )  # fmt: skip
        return first

    def stats(self) -> dict[str, int]:
        """The mover's counts since the broker started (``stats`` -> ``retry``)."""
        return {
            "moved": self.moved,
            "dead_lettered": self.dead,
            "pending": self.pending(),
            "lost_to_retention": self.lost_to_retention,
            "nacked_removed": self.nacked_removed,
            "nacked_again": self.nacked_again,
            "dropped_deleted_group": self.dropped_deleted,
            "dropped_deleted_topic": self.dropped_deleted_topic,
            "dead_letter_cycles": self.dead_letter_cycles,
        }

    def pending(self) -> int:
        """Copies in the delay queues not moved yet."""
        self._follow_deletion()
        try:
            delay_queues = self.store.queue_ids(DELAY_TOPIC)
        except TopicNotFoundError:
            return 0
        total = 0
        for queue_id in delay_queues:
            first, following = self.store.queue_range(DELAY_TOPIC, queue_id)
            total += following - max(self._cursor(queue_id), first)
        return total

    def _append(
        self, topic: str, message: Message, props: dict[str, str], queue_id: int | None
    ) -> None:
        self.ensure(topic, 1)
        sent = self.store.send(
            topic, message.body, tag=message.tag, key=message.key, properties=props,
            code=message.code, queue_id=queue_id,
        )  # fmt: skip
        self._sent(sent, message.tag)

    def _sent(self, sent: SendResult, tag: str) -> None:
        if self.appended is not None:
            self.appended(sent.topic, sent.queue_id, sent.queue_offset, tag)

    def ensure(self, topic: str, queue_count: int) -> None:
        try:
            if len(self.store.queue_ids(topic)) >= queue_count:
                return
        except TopicNotFoundError:
            pass
        self.store.create_topic(topic, queue_count)


def _origin_deleted(message: Message, deleted: dict[str, int]) -> bool:
    """Whether the message a delayed copy was made of was stored before the latest
    deletion of its topic (its id names its log position)."""
    gone = deleted.get(message.properties.get(ORIGIN_TOPIC, ""))
    found = decode_message_id(message.properties.get(ORIGIN_ID, ""))
    return gone is not None and found is not None and found[1] < gone


def _runs(due: list[Message]) -> list[tuple[str | None, list[Message]]]:
    """``due`` cut into runs of consecutive copies of one group (None: a copy naming
    no valid group), in order."""
    runs: list[tuple[str | None, list[Message]]] = []
    valid: dict[str, str | None] = {}
    for message in due:
        name = message.properties.get(GROUP, "")
        if name not in valid:
            try:
                valid[name] = check_group_name(name)
            except InvalidMessageError:
                valid[name] = None
        group = valid[name]
        if runs and runs[-1][0] == group:
            runs[-1][1].append(message)
        else:
            runs.append((group, [message]))
    return runs


def _copy(message: Message) -> OutgoingMessage:
    props = {k: v for k, v in message.properties.items() if k != DUE_MS}
    return OutgoingMessage(message.body, message.tag, message.key, props, message.code)


def _check_delays(delays: Sequence[float]) -> tuple[float, ...]:
    try:
        values = tuple(float(d) for d in delays)
    except (TypeError, ValueError):
        raise InvalidTypeError("retry_delays must be a sequence of seconds") from None
    if not 1 <= len(values) <= MAX_LEVELS or not all(0 < d <= MAX_DELAY_S for d in values):
        raise InvalidMessageError(
            f"retry_delays must hold 1 to {MAX_LEVELS} delays in (0, {MAX_DELAY_S}] seconds: "
            f"{values}"
        )
    if list(values) != sorted(values):
        raise InvalidMessageError(f"retry_delays must be increasing: {values}")
    return values
