"""A member of a consumer group through the broker, blocking: ``GroupConsumer(client,
group, topics)`` (the asyncio twin is equeue/client/consumer_aio.py; docs/groups.md).

The broker divides the queues of the group's topics (and of its retry topic) among the
members; this loop pulls only the queues the broker assigned it, each pull carrying the
group and consumer id so the broker refuses a queue it does not hold. Messages come
in offset order per queue; ``for message in consumer`` blocks until one arrives
(``timeout``: the iteration ends once none came for that long).

Threads: a heartbeat thread keeps the session (every session_timeout / 3) on the same
client (the blocking client is thread-safe), also while the caller's code runs; the
assigned queues are long-polled at once, one pull each in flight, from a small pool of
threads, so a message in any of them wakes the loop (no busy wait); past ``pollers``
queues they take turns, each pull waiting its share of a second (``poll_wait_ms``).
``pollers`` is MAX_POLLERS, or the broker's max_in_flight less 2 where that is fewer
(``long_polls``): a held pull holds a place, and a heartbeat and a commit need one each.
Prefetch: a queue is pulled again once at most (prefetch - 1) x batch_size of its
messages wait in the buffer, so its next batch is on the way while this one is handled.
While messages are at hand, a queue whose last pull brought a whole batch is pulled
without a wait; one whose last pull brought less (it was drained) is long-polled: the
broker holds the pull until a message arrives there (about one pull a second while the
queue stays empty), so what arrives on an idle queue joins the buffer at once, behind
the batches already in it. Past ``pollers`` queues a held pull would keep a thread from
the others: there, while messages are at hand, pulls do not wait and an empty queue is
pulled again IDLE_RECHECK_SECONDS later at the earliest (see start_pulls).

The pull bookkeeping (the per-queue pull state, which queues to pull and how, the held
long polls that close cancels) is equeue/client/consumerpulls.py, bound into the class.

At least once: processed offsets are committed (``auto_commit``) when no message came
for 0.1 s, when ``auto_commit_interval`` passed since the last commit (also while the
buffer never runs empty), before a queue is given up, and by ``close()``. A member
that dies without committing leaves its queues at their last commit: the new holder
gets again what it processed since (at most ``auto_commit_interval`` seconds of work,
plus the message in hand). ``nack(message, delay=)`` (or an exception from the handler
of ``run``) sends the message to the group's retry topic for later.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from types import TracebackType
from typing import Any, Protocol

from equeue.client import consumerpulls, forks
from equeue.client.consumerpulls import InlinePull, inline_capable
from equeue.client.groupstate import (
    DEFAULT_AUTO_COMMIT_INTERVAL,
    DEFAULT_MAX_POLL_INTERVAL,
    DEFAULT_PREFETCH,
    DEFAULT_SESSION_TIMEOUT,
    MEMBER_TIMEOUT,
    POLL_WAIT_MS,
    GroupState,
    Queue,
    Timeout,
    closed_in_child,
    handled_normally,
    long_polls,
    welcome_limit,
)
from equeue.client.nacks import nack_args, nack_failed
from equeue.errors import (
    ClosedError,
    ConnectionLostError,
    EQueueError,
    FencedMemberError,
    GroupError,
    ProtocolError,
)
from equeue.store.consumerargs import Start, check_count, check_seconds
from equeue.store.types import Message

log = logging.getLogger("equeue.client.consumer")

IDLE_COMMIT_SECONDS = 0.1  # no message for this long: the processed offsets are committed
# commit_offset requests in flight at once: the broker's committer writes those that
# arrive while it writes in one file write and fsync per group (a request a queue, one
# after another, was an fsync each: ~9 ms a queue)
COMMIT_WINDOW = 64
# A zero timeout (poll(0), timeout=0) hands out what is there now: the answers of its pulls
# without a wait are read for at most this long (one round trip; a later answer is the
# next poll's)
NOW_SECONDS = 1.0


class Requester(Protocol):
    url: str

    def request(self, op: str, arguments: dict[str, Any]) -> Any: ...


_Inline = InlinePull  # (its name before the move to consumerpulls.py, which tests import)


class GroupConsumer:
    """One member of ``group`` consuming ``topics`` through ``client``."""

    def __init__(
        self,
        client: Requester,
        group: str,
        topics: str | Iterable[str],
        *,
        tags: str | Iterable[str] | None = None,
        batch_size: int = 32,
        prefetch: int = DEFAULT_PREFETCH,
        auto_commit: bool = True,
        auto_commit_interval: float = DEFAULT_AUTO_COMMIT_INTERVAL,
        session_timeout: float = DEFAULT_SESSION_TIMEOUT,
        max_retries: int | None = None,
        timeout: float | None = None,
        consumer_id: str | None = None,
        max_poll_interval: float = DEFAULT_MAX_POLL_INTERVAL,
        start: Start = "committed",
    ) -> None:
        self.client = client
        self.state = GroupState(
            client.url, group, topics, tags=tags, batch_size=batch_size, prefetch=prefetch,
            auto_commit=auto_commit, auto_commit_interval=auto_commit_interval,
            session_timeout=session_timeout, max_poll_interval=max_poll_interval,
            max_retries=max_retries, consumer_id=consumer_id, start=start,
        )  # fmt: skip
        forks.track(self)  # closed in a forked child (after_fork)
        self.timeout = check_seconds(timeout, "timeout")
        # the timeout the last poll was given, checked: the same object again (poll(1.0)
        # in a loop: a constant) is not checked again (perfconsume: ~15 bytecodes a poll)
        self._timeout_ok: float | None = self.timeout
        # per queue: its pull in flight, the offset and membership it was sent in
        self._inflight: dict[Queue, tuple[Future[Any] | InlinePull, int, int]] = {}
        # the blocking client writes a pull without a wait from this thread (InlinePull)
        # (only the exact Client, or one whose request is Client's: a wrapper's own
        # request, metrics or faults, sees every pull)
        self._inline: Any = client if inline_capable(client) else None
        # per queue: its last long poll written by the blocking client (connection and
        # slot), which close cancels if it is still held (_cancel_held)
        self._held: dict[Queue, Any] = {}
        # the queues whose last pull brought less than a batch: long-polled (_start_pulls)
        self._drained: set[Queue] = set()
        # the queues whose last pull found nothing, and when to pull them again at the
        # earliest while messages are at hand past ``_pollers`` queues
        self._idle: dict[Queue, float] = {}
        self._event = threading.Event()  # a pull answered, or the assignment changed
        self._stop = threading.Event()
        self._beat_now = threading.Event()
        self._last_commit = time.monotonic()
        # when the next commit is due with auto_commit (never without): poll compares once
        self._commit_due = self._last_commit + self._commit_every()
        self._settled: object = None  # the broker's answer last found applied (_maintain)
        # the heartbeat thread skipped a beat while the caller was away (max_poll_interval):
        # the session may have expired meanwhile, so the loop asks before it hands out more
        self._lapsed = False
        self._join()  # errors (unknown topic, bad arguments) here, not at the first message
        # pulls held at once, a pool thread each: the broker's max_in_flight (known once
        # connected) less places for a heartbeat and a commit (long_polls)
        self._pollers = long_polls(client)
        self._pool = ThreadPoolExecutor(self._pollers, thread_name_prefix="equeue-pull")
        self._maintain()
        self._heartbeat = threading.Thread(
            target=self._beat, name=f"equeue-heartbeat {self.state.consumer}", daemon=True
        )
        self._heartbeat.start()

    @property
    def consumer_id(self) -> str:
        return self.state.consumer

    def after_fork(self, parent: int) -> None:
        closed_in_child(self.state, parent, "make the consumer in this process")

    def assignment(self) -> list[Queue]:
        """The queues this member pulls now."""
        return sorted(self.state.positions)

    # --- the loop ----------------------------------------------------------------------

    def __iter__(self) -> Iterator[Message]:
        return self._messages(None, own=True)

    def __next__(self) -> Message:
        message = self.poll(self.timeout)
        if message is None:
            raise StopIteration
        return message

    def _messages(self, timeout: float | None, *, own: bool) -> Iterator[Message]:
        """poll(timeout) (own: poll(self.timeout)) until it gives None, as a generator
        with poll's common case inline: resuming it costs less than a call a message."""
        state = self.state
        monotonic = time.monotonic
        while True:
            if state.closed:
                self._check_open()
            state.last_poll = now = monotonic()
            batch = state.handed
            if batch is not None:  # processed (state.done_with_pending, inline)
                state.handed = None
                if not batch.done and batch.key in state.processed:
                    state.processed[batch.key] = batch  # (the batch works its offset out)
                batch.done = batch.next
            buffer = state.buffer
            if (
                buffer
                and now < self._commit_due
                and not (state.refill or state.news or state.lost or state.failure)
            ):  # a message at hand, nothing else to do (state.next_message, inline)
                batch = buffer[0]
                i = batch.next
                message = batch.messages[i]
                batch.next = i = i + 1
                if i == batch.count:  # handed out whole: its queue may want its next pull
                    buffer.popleft()
                    state.refill = True
                state.handed = batch
                yield message
                continue
            if state.handed_before is not None:  # a poll_batch's messages, processed now
                state.done_with_pending()
            found = self._poll(self.timeout if own else timeout, now)
            if found is None:
                return
            yield found

    def poll(self, timeout: float | None = 0.0) -> Message | None:
        """The next message, waiting up to ``timeout`` seconds (None: until one comes; 0:
        what is there now, one round trip)."""
        if timeout is not self._timeout_ok:
            if type(timeout) is not float or not 0.0 <= timeout < math.inf:  # (no call)
                timeout = check_seconds(timeout, "timeout")
            self._timeout_ok = timeout
        state = self.state
        if state.closed:
            self._check_open()
        state.last_poll = now = time.monotonic()
        # (and a poll_batch's messages, processed now, in order; one test while a message
        # is in hand: done_with_pending sees handed_before is None then)
        if state.handed is not None or state.handed_before is not None:
            state.done_with_pending()
        return self._poll(timeout, now)

    def poll_batch(
        self, max_count: int | None = None, timeout: float | None = 0.0
    ) -> list[Message]:
        """The store Consumer's ``poll``: up to ``max_count`` (default ``batch_size``)
        messages, waiting up to ``timeout`` seconds for the first (None: until one comes;
        0: what is there now); the rest are those already fetched. The messages of the
        previous poll_batch (or poll) count as processed."""
        state = self.state
        limit = state.asked.batch_size if max_count is None else check_count(max_count, "max_count")
        first = self.poll(timeout)
        if first is None:
            return []
        messages = [first]
        state.more_messages(messages, limit)
        return messages

    def _poll(self, timeout: float | None, now: float) -> Message | None:
        state = self.state
        if state.news or state.lost or state.failure:  # revoked queues go at once
            self._rejoin()
            try:
                self._maintain()
            except (GroupError, ConnectionLostError) as exc:
                state.lose(exc)  # (fenced: raised)
                log.warning("consumer %s: %s; joining again", state.consumer, exc)
        # the commits a poll makes stop at its deadline (one window of them at least:
        # each poll makes progress); the rest go at the next
        until = None if timeout is None else now + timeout

        if state.buffer:  # the common case: a message at hand
            if state.refill:  # a pull answered, or a queue run low: take it, pull again
                self._refill()
            if now >= self._commit_due:
                self._commit_quietly(None, until)
            # (a refusal just now emptied the buffer, state.lose: nothing of the lost
            # membership is handed out, _fetch joins again; review19 R19-8)
            if state.buffer:
                return state.next_message()
        if not state.buffer:
            if time.monotonic() >= self._commit_due:
                self._commit_quietly(None, until)
            if not self._fetch(timeout):
                return None
        return state.next_message()

    def run(
        self,
        handler: Callable[[Message], object],
        *,
        max_messages: int | None = None,
        timeout: float | Timeout | None = MEMBER_TIMEOUT,
    ) -> int:
        """Call ``handler`` on each message; one that raises is nacked (retried after
        the backoff of its attempt, at last dead-lettered). Ends after ``max_messages``,
        or once none came for ``timeout`` seconds (by default the member's ``timeout``: None
        blocks); returns how many were handled."""
        timeout = self.timeout if timeout is MEMBER_TIMEOUT else check_seconds(timeout, "timeout")
        handled = 0
        if max_messages is not None and max_messages <= 0:
            return 0
        for message in self._messages(timeout, own=False):
            try:
                handler(message)
            except Exception as exc:
                log.warning("handler failed on %s: %r; nacked", message.message_id, exc)
                self.nack(message)
            handled += 1
            if handled == max_messages:  # (the next is not polled: this one stays in hand)
                break
        return handled

    def nack(self, message: Message, delay: float | None = None) -> None:
        """Send ``message`` to the group's retry topic, back after ``delay`` seconds
        (rounded up to a delay level; None: the level of its attempt; 0: at once); it
        counts as processed. After max_retries it goes to the dead-letter topic."""
        self._check_open()
        args = nack_args(self.state, message, delay)
        try:
            self.client.request("nack", args)
        except EQueueError as exc:
            nack_failed(self.state, exc, args["message_id"])

    def commit(self) -> None:
        """Commit every message handed out so far (it counts as processed)."""
        self._check_open()
        self.state.raise_if_fenced()
        self.state.done_with_pending()
        try:
            self._commit(None)
        except FencedMemberError as exc:
            self.state.lose(exc)

    def close(self, *, processed: bool | None = None) -> None:
        """Commit what was handed out (with auto_commit), leave the group, stop.
        ``processed``: whether the message in hand counts as processed; None: unless
        close is called while an exception is handled (a ``finally:`` or ``except:``
        after the loop body raised), as leaving ``with`` by an exception does."""
        self._close(processed=handled_normally() if processed is None else processed)

    def _close(self, *, processed: bool) -> None:
        state = self.state
        if state.closed:
            return
        state.closed = True
        self._stop.set()
        self._beat_now.set()
        try:
            self._cancel_held()
            if processed:
                state.done_with_pending()
            if isinstance(state.failure, FencedMemberError):
                return  # its commits are refused, and its leave would end the newer member
            if not state.lost and state.auto_commit:
                self._commit_quietly(None)
            # also when lost (a nack failed): the broker may still count it a member, and
            # its queues go on at once, from their last commits, not a session later
            self.client.request("leave", state.member_args())
        except EQueueError as exc:  # the broker will expire it: nothing is lost
            log.warning("consumer %s could not leave cleanly: %s", state.consumer, exc)
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._heartbeat.join(timeout=5.0)

    def __enter__(self) -> GroupConsumer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close(processed=exc_type is None)

    def __repr__(self) -> str:
        s = self.state
        return f"<GroupConsumer {s.consumer} group={s.group!r} {len(s.positions)} queues>"

    # --- internals -----------------------------------------------------------------------

    def _check_open(self) -> None:
        state = self.state
        if state.closed:
            raise ClosedError(
                f"the consumer {state.consumer} of {state.group!r} {state.closed_why}"
            )

    def _join(self) -> None:
        state = self.state
        state.reset()
        state.joined(self.client.request("join", state.join_args()))
        state.fit_pulls(welcome_limit(self.client, "max_pull_count"))  # (connected now)
        state.lost = False

    def _rejoin(self) -> None:
        """Join again if the membership was lost. Its errors reach the caller: a
        ConnectionLostError (the broker unreachable for the client's connect_timeout) or
        a refusal. Caught and retried, a poll would never end while the broker is gone;
        the consumer stays usable, its next poll joins again."""
        state = self.state
        if state.lost and state.failure is None:  # (a failure: _maintain raises it)
            self._join()

    def _fetch(self, timeout: float | None) -> bool:
        """Fill the buffer; False once ``timeout`` passed without a message."""
        if timeout == 0:
            return self._fetch_now()
        state = self.state
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        while True:
            self._event.clear()
            state.last_poll = time.monotonic()  # waiting for messages is not stalling
            self._rejoin()
            try:
                self._maintain()
                self._harvest()
                # the next batches (_start_pulls): with messages at hand, long polls for
                # the drained queues only; past _pollers queues, none
                self._start_pulls(quick=bool(state.buffer))
                if state.buffer:
                    return True
                if self._unread(deadline):
                    continue
                if state.auto_commit and time.monotonic() - start >= IDLE_COMMIT_SECONDS:
                    # nothing came for a while: commit what is done, within the timeout
                    self._commit(None, deadline)
            except (GroupError, ConnectionLostError) as exc:
                state.lose(exc)  # (fenced: raised)
                log.warning("consumer %s: %s; joining again", state.consumer, exc)
                self._stop.wait(0.05)
                if deadline is not None and time.monotonic() >= deadline:
                    return False  # (the caller's time holds; its next poll joins again)
                continue  # _rejoin joins; its errors reach the caller
            # awaiting queues of its share (a rebalance's handover): the idle clock waits
            deadline = state.hold_idle_clock(start, timeout, deadline)
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self._event.wait(POLL_WAIT_MS / 1000 if remaining is None else min(remaining, 1.0))

    def _fetch_now(self) -> bool:
        """A zero timeout: the messages there now, as the store's Consumer hands them out.
        Each held queue with no pull in flight is pulled without a wait, and the answers
        of the pulls without a wait are read (one round trip, NOW_SECONDS at most). A
        queue whose long poll is in flight counts as empty: the broker holds that pull
        because nothing was there; a message since is its answer, read by a later poll."""
        state = self.state
        state.last_poll = time.monotonic()
        self._rejoin()
        try:
            self._maintain()
            self._harvest()
            if not state.buffer:
                started = self._start_pulls(at_once=True)
                until = time.monotonic() + NOW_SECONDS
                quick = [p for p, _, _ in self._inflight.values() if type(p) is InlinePull]
                for pull in quick:
                    if not pull.waits:
                        pull.wait(until)
                pooled = [p for p in started if type(p) is not InlinePull]
                if pooled:  # (a wrapper's pulls, through the pool)
                    wait_futures(pooled, max(0.0, until - time.monotonic()))
                self._harvest()
            if not state.buffer:  # (a long poll's answer is read as it comes, as _unread has it)
                self._pool_long_polls()
        except (GroupError, ConnectionLostError) as exc:
            state.lose(exc)  # (fenced: raised)
            log.warning("consumer %s: %s; joining again", state.consumer, exc)
            return False  # (its next poll joins again)
        return bool(state.buffer)

    # the pull bookkeeping (the per-queue pull state, held pulls, cancel):
    # equeue/client/consumerpulls.py
    _unread = consumerpulls.unread
    _pool_long_polls = consumerpulls.pool_long_polls
    _answered = consumerpulls.answered
    _harvest = consumerpulls.harvest
    _start_pulls = consumerpulls.start_pulls
    _long_poll = consumerpulls.long_poll
    _cancel_held = consumerpulls.cancel_held

    def _refill(self) -> None:
        """Take the pulls answered and send the next of every queue run low (the buffer
        still holds messages, so the caller does not wait): a queue whose last pull
        brought a whole batch is pulled without a wait, a drained one long-polled (held by
        the broker up to its wait); past _pollers queues every one without a wait, one
        whose last pull found nothing only once IDLE_RECHECK_SECONDS passed."""
        state = self.state
        state.refill = False
        self._event.clear()
        try:
            self._harvest()
            self._start_pulls(quick=True)
        except (GroupError, ConnectionLostError) as exc:
            state.lose(exc)  # (fenced: raised)
            log.warning("consumer %s: %s; joining again", state.consumer, exc)

    def _maintain(self) -> None:
        """Join again if the membership was lost; apply the latest assignment."""
        state = self.state
        if state.failure is not None:
            raise state.failure
        if state.lost:
            self._lapsed = False
            self._join()
        elif self._lapsed:  # is the session still there? (a GroupError: the caller's lose)
            self._lapsed = False
            state.take(self.client.request("heartbeat", state.heartbeat_args()))
        # news cleared before the answer is read, also for the short cut below: take()
        # stores its answer, then sets news (outside the lock), so a news set after this
        # stays set for an answer read here or later; left set, every message would come
        # here until the next heartbeat
        state.news = False
        answer = state.answer  # (replaced whole by take(), never changed in place)
        if answer is not None and answer is self._settled:
            return  # that answer is applied: plan() would say so, at a lock and two sets
        plan = state.plan()
        if plan is None:
            self._settled = answer
            return
        generation, revoked, added = plan
        if revoked:
            if state.auto_commit:
                self._commit(revoked)
            state.drop(revoked)
        for key in added:
            topic, queue_id = key
            committed = self.client.request(
                "committed_offset", {"group": state.group, "topic": topic, "queue_id": queue_id}
            )
            queue_range = self.client.request("queue_range", {"topic": topic, "queue_id": queue_id})
            state.add(key, committed, queue_range)
        state.applied = generation
        self._beat_now.set()  # release the dropped queues now, not a heartbeat later

    def _commit(self, queues: list[Queue] | None, until: float | None = None) -> None:
        """Commit what is processed of ``queues`` (None: all), a request a queue, up to
        COMMIT_WINDOW of them in flight at once (the broker writes the commits that
        arrive while it writes in one file write and fsync); past ``until`` (a poll's
        deadline, time.monotonic()) no further window is sent, so a poll is not held
        past its timeout: the rest stays due, for the next poll. A requester other than
        the blocking Client itself (a wrapper) gets them one at a time."""
        state = self.state
        due = list(state.to_commit(queues).items())
        window = COMMIT_WINDOW if self._inline is not None else 1
        for first in range(0, len(due), window):
            if first and until is not None and time.monotonic() >= until:
                self._commit_due = time.monotonic()  # (the rest: at the next poll)
                return
            self._commit_window(due[first : first + window])
        self._last_commit = time.monotonic()
        self._commit_due = self._last_commit + self._commit_every()

    def _commit_window(self, part: list[tuple[Queue, int]]) -> None:
        state = self.state
        inline = self._inline
        if inline is None or len(part) == 1:
            for key, offset in part:
                self.client.request("commit_offset", state.commit_args(key, offset))
                state.committed[key] = offset
            return
        started: list[tuple[Queue, int, Any]] = []
        failure: EQueueError | None = None
        for key, offset in part:
            args = state.commit_args(key, offset)
            try:
                started.append((key, offset, inline.start_request("commit_offset", args)))
            except EQueueError as exc:  # not written: those started are still answered
                failure = exc
                break
        for key, offset, request in started:
            try:
                inline.finish_request(request)
            except EQueueError as exc:
                failure = failure or exc
                continue
            state.committed[key] = offset
        if failure is not None:
            raise failure

    def _commit_every(self) -> float:
        state = self.state
        return state.auto_commit_interval if state.auto_commit else math.inf

    def _commit_quietly(self, queues: list[Queue] | None, until: float | None = None) -> None:
        try:
            self._commit(queues, until)
        except (GroupError, ConnectionLostError) as exc:
            self.state.lose(exc)  # (fenced: raised)
            log.warning("consumer %s: commit refused (%s)", self.state.consumer, exc)

    def _beat(self) -> None:
        state = self.state
        while not self._stop.is_set():
            self._beat_now.wait(state.interval())
            self._beat_now.clear()
            if self._stop.is_set():
                return
            if state.lost:
                continue
            if state.stalled():  # the caller is away: its next poll asks (_maintain)
                self._lapsed = True
                state.news = True  # (so that poll looks: the fast path tests it)
                continue
            args = state.heartbeat_args()
            try:
                if state.take(self.client.request("heartbeat", args)):
                    self._event.set()
            except FencedMemberError as exc:
                if state.fenced(exc, args):  # (else of a membership the loop replaced since)
                    log.error("consumer %s: %s", state.consumer, exc)
                    self._event.set()
                    return
            except GroupError as exc:
                log.warning("consumer %s: %s", state.consumer, exc)
                state.lost = True
                self._event.set()
            except ProtocolError as exc:  # the broker answered nonsense: the loop raises it
                state.failure = exc
                self._event.set()
                return
            except EQueueError as exc:  # the connection: the client reconnects next time
                log.info("consumer %s: heartbeat failed: %s", state.consumer, exc)
