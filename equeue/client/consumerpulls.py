"""The pull bookkeeping of the blocking group consumer (equeue/client/consumer.py): the
per-queue pull state (a pull in flight per queue, the queues drained or idle), which
queues to pull and how (without a wait, long-polled, written by the loop's thread or a
pool thread's), the answers taken in, and the held long polls that close() cancels.

The functions take the GroupConsumer as ``self`` and are bound into its class (as
MessageStore binds equeue/store/storetopics.py's): its attributes are the state
(``_inflight``, ``_held``, ``_drained``, ``_idle``, ``_inline``, ``_pool``,
``_pollers``), set in its ``__init__``.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

from equeue.client import endings
from equeue.client.groupstate import Queue, poll_wait_ms

if TYPE_CHECKING:
    from equeue.client.consumer import GroupConsumer

# While messages are at hand and the member holds more than _pollers queues, a queue
# whose last pull found nothing is pulled again (without a wait) after this long at the
# earliest: what arrives there waits at most this much more. Up to _pollers queues it
# is long-polled instead.
IDLE_RECHECK_SECONDS = 0.05
# close() cancels its held pulls with cancel_pull frames, for which it waits this long at
# most for the client's write lock (another thread's send_many waiting for places)
CANCEL_LOCK_WAIT = 1.0


class InlinePull:
    """A pull written by the loop's own thread while messages are at hand (the blocking
    client's start_request): no pool thread to wake, no Future, no callback. Its answer
    is read by whichever thread reads the connection next, at the latest by the loop
    when its buffer runs empty (_fetch): there it reads the answer of a pull without a
    wait (given at once) for at most the caller's time, and hands a long poll (``waits``)
    to a pool thread to wait for, so that whichever answer comes first wakes it."""

    __slots__ = ("client", "started", "waits")

    def __init__(self, client: Any, started: Any, waits: bool) -> None:
        self.client = client
        self.started = started
        self.waits = waits

    def done(self) -> bool:
        return bool(self.started[1].done)

    def result(self) -> Any:
        return self.client.finish_request(self.started)

    def wait(self, until: float) -> bool:
        """Until answered or ``until`` (time.monotonic()) passed: whether answered; its
        error (if any) is raised by result(), in _harvest."""
        with contextlib.suppress(Exception):
            self.client.finish_request(self.started, until)
        return self.done()


def inline_capable(client: object) -> bool:
    """Whether ``client`` is the blocking Client with its own ``request`` (not a subclass
    or proxy overriding it): only then are pulls written by start_request."""
    from equeue.client.sync import Client  # (sync imports nothing of the consumer's)

    # (the bound method's function: a subclass's override and one set on the instance
    # both differ from Client.request)
    method = getattr(client, "request", None)
    return isinstance(client, Client) and getattr(method, "__func__", None) is Client.request


def unread(self: GroupConsumer, deadline: float | None) -> bool:
    """The buffer ran empty: read the answer of a pull of this thread's without a
    wait (True: harvest it, or go round again), for at most a second at a time (the
    loop's _maintain and commits) and not past ``deadline`` (poll's timeout: then the
    pull stays this thread's, read by the next poll); a pool thread waits for each
    long poll of its, so that any answer sets the event _fetch waits on. A quick pull
    is never handed to the pool: behind its long polls (past _pollers queues) it
    would wait a long poll's round with its answer read."""
    inflight = self._inflight
    unread = [(k, p) for k, (p, _, _) in inflight.items() if type(p) is InlinePull]
    for _, pull in unread:
        if pull.done():
            return True  # (answered meanwhile, read by another thread: harvest it)
    for _, pull in unread:
        if not pull.waits:
            until = time.monotonic() + 1.0
            if deadline is not None and deadline < until:
                until = deadline
            # answered at once as a rule: read it here, not a second later
            return pull.wait(until) or deadline is None or time.monotonic() < deadline
    self._pool_long_polls()
    return False


def pool_long_polls(self: GroupConsumer) -> None:
    """Hand each long poll this thread wrote to a pool thread, which waits for its
    answer (reading the connection), so that it sets the event whenever it comes."""
    inflight = self._inflight
    for key, (pull, at, epoch) in list(inflight.items()):
        if type(pull) is InlinePull and pull.waits:  # (a quick pull stays: _unread)
            future = self._pool.submit(pull.result)
            future.add_done_callback(self._answered)
            inflight[key] = (future, at, epoch)


def answered(self: GroupConsumer, _: object) -> None:
    self.state.refill = True  # (a plain flag: poll looks at it at every message)
    self._event.set()


def harvest(self: GroupConsumer) -> None:
    state = self.state
    idle, drained, whole = self._idle, self._drained, state.batch_size
    for key, (pull, at, epoch) in list(self._inflight.items()):
        if not pull.done():
            continue
        del self._inflight[key]
        try:
            answer = pull.result()
        except Exception:
            if epoch == state.epoch and key in state.positions:
                raise
            continue  # sent before the membership was lost, or for a queue dropped
        if epoch != state.epoch:
            continue  # sent before the membership was lost: not ours to judge
        count = state.pulled(key, at, answer)
        if count >= whole:
            drained.discard(key)
            idle.pop(key, None)
        else:
            drained.add(key)
            if not count:
                idle[key] = time.monotonic() + IDLE_RECHECK_SECONDS


def start_pulls(self: GroupConsumer, *, quick: bool = False, at_once: bool = False) -> list[Any]:
    """Pull the queues that want it, long-polled (a held pull costs the blocking
    client nothing while it waits: only the thread an answer is for wakes). But
    ``quick`` (messages are at hand): a queue whose last pull brought a whole batch
    without a wait (more are likely there); past _pollers queues, where a held pull
    would keep a pool thread from a queue with messages, every queue without a wait,
    and one whose last pull found nothing only once its IDLE_RECHECK_SECONDS passed.
    ``at_once`` (a zero timeout, _fetch_now): every queue that wants a pull, without a
    wait. Returns the pulls started (an InlinePull or a Future each)."""
    state = self.state
    inflight, epoch = self._inflight, state.epoch
    idle = self._idle
    recheck = quick and len(state.positions) > self._pollers
    wait_ms = 0 if recheck or at_once else poll_wait_ms(len(state.positions), self._pollers)
    drained = self._drained if quick and not recheck else None
    now = time.monotonic() if recheck else 0.0
    # (a pull sent before the membership was lost is ignored when answered: it does
    # not hold up the queue's pulls now)
    wanted = [
        k for k in state.positions
        if (k not in inflight or inflight[k][2] != epoch) and state.wants_pull(k)
        and not (recheck and idle.get(k, 0.0) > now)
    ]  # fmt: skip
    # past _pollers, the pool's queue takes them in turn (FIFO: a queue answered
    # goes after those waiting)
    inline = self._inline
    started: list[Any] = []
    for key in wanted:
        args = state.pull_args(key, wait_ms if drained is None or key in drained else 0)
        waits = "wait_ms" in args
        if inline is not None and (quick or not waits):  # (this thread's: InlinePull)
            pull = InlinePull(inline, inline.start_request("pull_columns", args), waits)
            if waits:
                self._held[key] = pull.started
            self._inflight[key] = (pull, args["offset"], epoch)
            started.append(pull)
            continue
        if inline is not None:
            future = self._pool.submit(self._long_poll, key, args)
        else:
            future = self._pool.submit(self.client.request, "pull_columns", args)
        future.add_done_callback(self._answered)
        self._inflight[key] = (future, args["offset"], epoch)
        started.append(future)
    return started


def long_poll(self: GroupConsumer, key: Queue, args: dict[str, Any]) -> Any:
    """A pool thread's long poll through the blocking client, known to close: written
    here, recorded, then waited for (a close meanwhile cancels it: it looks at the
    record after marking the consumer closed, and this looks at the mark after
    recording, so one of the two sees the other)."""
    inline = self._inline
    started = inline.start_request("pull_columns", args)
    self._held[key] = started
    if self.state.closed:
        endings.give_up(inline, *started, lock_wait=CANCEL_LOCK_WAIT)
    return inline.finish_request(started)


def cancel_held(self: GroupConsumer) -> None:
    """close(): ask the broker to answer this consumer's held long polls now
    (cancel_pull, protocol version 6), so that neither it nor this client's
    max_in_flight keeps them until their waits end (before: until the leave's
    rebalance answered them at the broker's next tick, ~0.1-0.2 s, or a fenced
    member's, which does not leave, at their wait's end). Best effort, as a
    KeyboardInterrupt's (endings.give_up): not under TLS nor to an older broker."""
    inline = self._inline
    if inline is None:
        return
    for conn, slot in list(self._held.values()):
        endings.give_up(inline, conn, slot, lock_wait=CANCEL_LOCK_WAIT)
