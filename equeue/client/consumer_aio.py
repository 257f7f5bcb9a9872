"""A member of a consumer group through the broker, asyncio: ``async with
AsyncGroupConsumer(client, group, topics) as consumer: async for message in consumer``.

The blocking loop's twin (equeue/client/consumer.py says what it does; the state is
equeue/client/groupstate.py): heartbeats are a task, so they go on while the caller's
code awaits; each assigned queue has one long-poll pull in flight, a task, and the
first answer wakes the loop. A handler of ``run`` may be a function or a coroutine
function; one that raises nacks its message.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from types import TracebackType
from typing import Any, Protocol

from equeue.client import forks
from equeue.client.aio import AsyncClient
from equeue.client.consumer import COMMIT_WINDOW, IDLE_COMMIT_SECONDS, NOW_SECONDS
from equeue.client.groupstate import (
    DEFAULT_AUTO_COMMIT_INTERVAL,
    DEFAULT_MAX_POLL_INTERVAL,
    DEFAULT_PREFETCH,
    DEFAULT_SESSION_TIMEOUT,
    MAX_POLLERS,
    MEMBER_TIMEOUT,
    POLL_WAIT_MS,
    GroupState,
    Queue,
    Timeout,
    closed_in_child,
    handled_normally,
    long_polls,
    poll_wait_ms,
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


class AsyncRequester(Protocol):
    url: str

    async def request(self, op: str, arguments: dict[str, Any]) -> Any: ...


class AsyncGroupConsumer:
    """One member of ``group`` consuming ``topics`` through an asyncio ``client``; it
    joins on ``start()`` (or entering ``async with``, or the first message)."""

    def __init__(
        self,
        client: AsyncRequester,
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
        self._inflight: dict[Queue, tuple[asyncio.Task[Any], int, int]] = {}
        self._started: dict[Queue, float] = {}  # when each queue's last pull was sent
        self._event: asyncio.Event | None = None
        self._beat_now: asyncio.Event | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._last_commit = time.monotonic()
        self._pollers = MAX_POLLERS  # pulls in flight at most: long_polls, once joined
        # the task that polled last (when it refilled or waited: close() asks how it ended)
        self._poller: asyncio.Task[Any] | None = None
        # the heartbeat task skipped a beat while the caller was away (max_poll_interval):
        # the loop asks whether the session is still there before it hands out more
        self._lapsed = False

    @property
    def consumer_id(self) -> str:
        return self.state.consumer

    def after_fork(self, parent: int) -> None:
        closed_in_child(self.state, parent, "make the consumer in this process, on its own client")

    def assignment(self) -> list[Queue]:
        return sorted(self.state.positions)

    async def start(self) -> AsyncGroupConsumer:
        """Join the group and take the first assignment (errors such as an unknown topic
        are raised here)."""
        if self._heartbeat is None:
            self._check_open()
            self._event = asyncio.Event()
            self._beat_now = asyncio.Event()
            await self._join()
            self._pollers = long_polls(self.client)  # (the welcome is known now)
            await self._maintain()
            self._heartbeat = asyncio.create_task(self._beat())
        return self

    # --- the loop ----------------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[Message]:
        return self

    async def __anext__(self) -> Message:
        message = await self.poll(self.timeout)
        if message is None:
            raise StopAsyncIteration
        return message

    async def poll(self, timeout: float | None = 0.0) -> Message | None:
        """The next message, waiting up to ``timeout`` seconds (None: until one comes; 0:
        what is there now, one round trip)."""
        if timeout is not self._timeout_ok:
            if type(timeout) is not float or not 0.0 <= timeout < math.inf:  # (no call)
                timeout = check_seconds(timeout, "timeout")
            self._timeout_ok = timeout
        if self._heartbeat is None:
            await self.start()
        state = self.state
        if state.closed:
            self._check_open()
        state.last_poll = now = time.monotonic()
        if state.handed is not None or state.handed_before is not None:
            state.done_with_pending()
        if state.news or state.lost or state.failure:  # revoked queues go at once
            await self._rejoin()
            try:
                await self._maintain()
            except (GroupError, ConnectionLostError) as exc:
                state.lose(exc)  # (fenced: raised)
                log.warning("consumer %s: %s; joining again", state.consumer, exc)
        # the commits a poll makes stop at its deadline (after one window at least)
        until = None if timeout is None else now + timeout

        if state.buffer:  # the common case: a message at hand
            if state.refill:  # a pull answered, or a queue run low: take it, pull again
                # (the task polling, for close(): F3; here, once a batch or so, not at
                # every message: current_task() was ~10% of the loop's CPU a message)
                self._poller = asyncio.current_task()
                self._refill()
            if state.auto_commit and now - self._last_commit >= state.auto_commit_interval:
                await self._commit_quietly(until)
            if state.buffer:  # (emptied by a refusal just now: GroupConsumer._poll)
                return state.next_message()
        if not state.buffer:
            self._poller = asyncio.current_task()
            if state.auto_commit and time.monotonic() - self._last_commit >= (
                state.auto_commit_interval
            ):
                await self._commit_quietly(until)
            if not await self._fetch(timeout):
                return None
        return state.next_message()

    async def poll_batch(
        self, max_count: int | None = None, timeout: float | None = 0.0
    ) -> list[Message]:
        """As GroupConsumer.poll_batch: the store Consumer's ``poll``, up to ``max_count``
        messages, waiting up to ``timeout`` for the first."""
        state = self.state
        limit = state.asked.batch_size if max_count is None else check_count(max_count, "max_count")
        first = await self.poll(timeout)
        if first is None:
            return []
        messages = [first]
        state.more_messages(messages, limit)
        return messages

    async def run(
        self,
        handler: Callable[[Message], object | Awaitable[object]],
        *,
        max_messages: int | None = None,
        timeout: float | Timeout | None = MEMBER_TIMEOUT,
    ) -> int:
        """Call (and await) ``handler`` on each message; one that raises is nacked."""
        timeout = self.timeout if timeout is MEMBER_TIMEOUT else check_seconds(timeout, "timeout")
        handled = 0
        while max_messages is None or handled < max_messages:
            message = await self.poll(timeout)
            if message is None:
                break
            try:
                result = handler(message)
                if inspect.isawaitable(result):
                    await result
            except Exception as exc:
                log.warning("handler failed on %s: %r; nacked", message.message_id, exc)
                await self.nack(message)
            handled += 1
        return handled

    async def nack(self, message: Message, delay: float | None = None) -> None:
        """As GroupConsumer.nack: to the retry topic, back after ``delay`` seconds."""
        self._check_open()
        args = nack_args(self.state, message, delay)
        try:
            await self.client.request("nack", args)
        except EQueueError as exc:
            nack_failed(self.state, exc, args["message_id"])

    async def commit(self) -> None:
        self._check_open()
        self.state.raise_if_fenced()
        self.state.done_with_pending()
        try:
            await self._commit(None)
        except FencedMemberError as exc:
            self.state.lose(exc)

    async def close(self, *, processed: bool | None = None) -> None:
        """Commit what was handed out (with auto_commit), leave the group, stop.
        ``processed``: whether the message in hand counts as processed; None: unless an
        exception is handled at the call, or the task the message was handed to was
        cancelled or ended by an exception (an application cancelling its consumer
        task, then closing: reviewk F3 committed the message its handler never finished)."""
        if processed is None:
            processed = handled_normally() and self._poller_went_on()
        await self._close(processed=processed)

    def _poller_went_on(self) -> bool:
        """Whether the task that took the message in hand is neither cancelled (or being
        cancelled) nor ended by an exception: it went on past the message."""
        task = self._poller
        if task is None or task is asyncio.current_task():
            return True
        if task.cancelled() or task.cancelling():
            return False
        return not task.done() or task.exception() is None

    async def _close(self, *, processed: bool) -> None:
        state = self.state
        if state.closed:
            return
        state.closed = True
        tasks = [entry[0] for entry in self._inflight.values()]
        if self._heartbeat is not None:
            tasks.append(self._heartbeat)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        self._inflight.clear()
        if self._heartbeat is None:
            return  # never joined
        try:
            if processed:
                state.done_with_pending()
            if isinstance(state.failure, FencedMemberError):
                return  # its commits are refused, and its leave would end the newer member
            if not state.lost and state.auto_commit:
                await self._commit(None)
            # also when lost (a nack failed): the broker may still count it a member, and
            # its queues go on at once, from their last commits, not a session later
            await self.client.request("leave", state.member_args())
        except EQueueError as exc:
            log.warning("consumer %s could not leave cleanly: %s", state.consumer, exc)

    async def __aenter__(self) -> AsyncGroupConsumer:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._close(processed=exc_type is None)

    def __repr__(self) -> str:
        s = self.state
        return f"<AsyncGroupConsumer {s.consumer} group={s.group!r} {len(s.positions)} queues>"

    # --- internals -----------------------------------------------------------------------

    def _check_open(self) -> None:
        state = self.state
        if state.closed:
            raise ClosedError(
                f"the consumer {state.consumer} of {state.group!r} {state.closed_why}"
            )

    async def _join(self) -> None:
        state = self.state
        state.reset()
        state.joined(await self.client.request("join", state.join_args()))
        state.fit_pulls(welcome_limit(self.client, "max_pull_count"))  # (connected now)
        state.lost = False

    async def _rejoin(self) -> None:
        """As GroupConsumer._rejoin: join again if the membership was lost; a
        ConnectionLostError (the broker unreachable for connect_timeout) or a refusal
        reaches the caller, and the next poll joins again."""
        state = self.state
        if state.lost and state.failure is None:  # (a failure: _maintain raises it)
            await self._join()

    async def _fetch(self, timeout: float | None) -> bool:
        if timeout == 0:
            return await self._fetch_now()
        state = self.state
        assert self._event is not None
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        while True:
            self._event.clear()
            state.last_poll = time.monotonic()  # waiting for messages is not stalling
            await self._rejoin()
            try:
                await self._maintain()
                self._harvest()
                self._start_pulls()  # (with messages at hand too: the next batches)
                if state.buffer:
                    return True
                if state.auto_commit and time.monotonic() - start >= IDLE_COMMIT_SECONDS:
                    await self._commit(None, deadline)  # (within the poll's timeout)
            except (GroupError, ConnectionLostError) as exc:
                state.lose(exc)  # (fenced: raised)
                log.warning("consumer %s: %s; joining again", state.consumer, exc)
                await asyncio.sleep(0.05)
                if deadline is not None and time.monotonic() >= deadline:
                    return False  # (the caller's time holds; its next poll joins again)
                continue  # _rejoin joins; its errors reach the caller
            deadline = state.hold_idle_clock(start, timeout, deadline)  # (GroupConsumer's)
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            wait = POLL_WAIT_MS / 1000 if remaining is None else min(remaining, 1.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), wait)

    async def _fetch_now(self) -> bool:
        """As GroupConsumer._fetch_now: a zero timeout pulls, without a wait, each held
        queue with no pull in flight and awaits those answers (NOW_SECONDS at most); a
        queue whose long poll is in flight counts as empty."""
        state = self.state
        state.last_poll = time.monotonic()
        await self._rejoin()
        try:
            await self._maintain()
            self._harvest()
            if not state.buffer:
                started = self._start_pulls(at_once=True)
                if started:
                    await asyncio.wait(started, timeout=NOW_SECONDS)
                self._harvest()
        except (GroupError, ConnectionLostError) as exc:
            state.lose(exc)  # (fenced: raised)
            log.warning("consumer %s: %s; joining again", state.consumer, exc)
            return False  # (its next poll joins again)
        return bool(state.buffer)

    def _answered(self, _: object) -> None:
        self.state.refill = True  # (a plain flag: poll looks at it at every message)
        if self._event is not None:
            self._event.set()

    def _refill(self) -> None:
        """Take the pulls answered and send the next of every queue run low, without
        waiting (the buffer still holds messages)."""
        state = self.state
        state.refill = False
        if self._event is not None:
            self._event.clear()
        try:
            self._harvest()
            self._start_pulls()
        except (GroupError, ConnectionLostError) as exc:
            state.lose(exc)  # (fenced: raised)
            log.warning("consumer %s: %s; joining again", state.consumer, exc)

    async def _maintain(self) -> None:
        state = self.state
        if state.failure is not None:
            raise state.failure
        if state.lost:
            self._lapsed = False
            await self._join()
        elif self._lapsed:  # is the session still there? (GroupConsumer._maintain)
            self._lapsed = False
            state.take(await self.client.request("heartbeat", state.heartbeat_args()))
        plan = state.plan()
        if plan is None:
            return
        generation, revoked, added = plan
        if revoked:
            if state.auto_commit:
                await self._commit(revoked)
            state.drop(revoked)
        for key in added:
            topic, queue_id = key
            committed = await self.client.request(
                "committed_offset", {"group": state.group, "topic": topic, "queue_id": queue_id}
            )
            queue_range = await self.client.request(
                "queue_range", {"topic": topic, "queue_id": queue_id}
            )
            state.add(key, committed, queue_range)
        state.applied = generation
        if self._beat_now is not None:
            self._beat_now.set()

    def _harvest(self) -> None:
        state = self.state
        for key, (task, at, epoch) in list(self._inflight.items()):
            if not task.done():
                continue
            del self._inflight[key]
            if task.cancelled():
                continue
            error = task.exception()
            if epoch != state.epoch:
                continue  # sent before the membership was lost: not ours to judge
            if error is None:
                state.pulled(key, at, task.result())
            elif key in state.positions:
                raise error

    def _start_pulls(self, *, at_once: bool = False) -> list[asyncio.Task[Any]]:
        """Pull the queues that want it, long-polled (``at_once``, a zero timeout: without a
        wait); the tasks started."""
        state = self.state
        event = self._event
        assert event is not None
        # At most ``pollers`` pulls in flight (the connection's max_in_flight is shared
        # with commits and heartbeats: long_polls), the queues pulled longest ago first.
        pollers = self._pollers
        wait_ms = 0 if at_once else poll_wait_ms(len(state.positions), pollers)
        inflight, epoch = self._inflight, state.epoch
        # (a pull sent before the membership was lost is ignored when answered: it does
        # not hold up the queue's pulls now)
        wanted = [
            k for k in state.positions
            if (k not in inflight or inflight[k][2] != epoch) and state.wants_pull(k)
        ]  # fmt: skip
        wanted.sort(key=lambda k: self._started.get(k, 0.0))
        started: list[asyncio.Task[Any]] = []
        for key in wanted[: max(0, pollers - len(self._inflight))]:
            old = inflight.get(key)
            if old is not None:  # of an earlier membership: its answer would be ignored
                old[0].cancel()
            self._started[key] = time.monotonic()
            args = state.pull_args(key, wait_ms)
            task = asyncio.create_task(self.client.request("pull_columns", args))
            task.add_done_callback(self._answered)
            self._inflight[key] = (task, args["offset"], state.epoch)
            started.append(task)
        return started

    async def _commit(self, queues: list[Queue] | None, until: float | None = None) -> None:
        """Commit what is processed of ``queues`` (None: all), up to COMMIT_WINDOW
        requests in flight at once (one at a time through a wrapper: the blocking
        loop's _commit says why); past ``until`` (a poll's deadline) no further window
        is sent: the rest stays due, for the next poll."""
        state = self.state
        due = list(state.to_commit(queues).items())
        window = COMMIT_WINDOW if isinstance(self.client, AsyncClient) else 1
        for first in range(0, len(due), window):
            if first and until is not None and time.monotonic() >= until:
                return  # (_last_commit unchanged: the rest is due at the next poll)
            part = due[first : first + window]
            outcomes = await asyncio.gather(
                *(self.client.request("commit_offset", state.commit_args(k, o)) for k, o in part),
                return_exceptions=True,
            )
            failure: BaseException | None = None
            for (key, offset), outcome in zip(part, outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    failure = failure or outcome
                else:
                    state.committed[key] = offset
            if failure is not None:
                raise failure
        self._last_commit = time.monotonic()

    async def _commit_quietly(self, until: float | None) -> None:
        try:
            await self._commit(None, until)
        except (GroupError, ConnectionLostError) as exc:
            self.state.lose(exc)  # (fenced: raised)
            log.warning("consumer %s: commit refused (%s)", self.state.consumer, exc)

    async def _beat(self) -> None:
        state = self.state
        beat_now, event = self._beat_now, self._event
        assert beat_now is not None and event is not None
        while not state.closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(beat_now.wait(), state.interval())
            beat_now.clear()
            if state.closed or state.lost:
                continue
            if state.stalled():  # the caller is away: its next poll asks (_maintain)
                self._lapsed = True
                state.news = True
                continue
            args = state.heartbeat_args()
            try:
                if state.take(await self.client.request("heartbeat", args)):
                    event.set()
            except FencedMemberError as exc:
                if state.fenced(exc, args):  # (else of a membership the loop replaced since)
                    log.error("consumer %s: %s", state.consumer, exc)
                    event.set()
                    return
            except GroupError as exc:
                log.warning("consumer %s: %s", state.consumer, exc)
                state.lost = True
                event.set()
            except ProtocolError as exc:  # the broker answered nonsense: the loop raises it
                state.failure = exc
                event.set()
                return
            except EQueueError as exc:
                log.info("consumer %s: heartbeat failed: %s", state.consumer, exc)
