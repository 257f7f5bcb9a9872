"""``--flush sync`` across clients: one fdatasync covers the sends of every connection.

Sends are appended on the event loop thread (the broker is the store's only writer)
and their answers kept back. One flusher thread fdatasyncs the message log; the batch
it releases is exactly the answers appended before that fdatasync was started, since
the loop hands them over when it starts it. Sends arriving meanwhile wait for the
next one, so the more clients send, the more each fdatasync covers (RocketMQ's
GroupCommitService, across processes instead of threads).

A waiting answer is a (peer, request id, result) tuple, not a closure per send: at tens
of thousands of durable sends a second the broker's CPU per send is the limit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from typing import Protocol

from equeue.errors import StoreWriteError

log = logging.getLogger("equeue.server")


class Waiter(Protocol):
    """The connection a durable answer goes to (equeue/server/connection.py)."""

    def finish(self, request_id: int, outcome: object) -> None: ...


Entry = tuple[Waiter, int, object]  # the peer, the request id, the answer once durable


class CrossClientCommit:
    """Runs on the loop; ``flush_log`` runs on its one thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, flush_log: Callable[[], None]) -> None:
        self._loop = loop
        self._flush_log = flush_log
        self._waiting: list[Entry] = []
        self._running: asyncio.Future[None] | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "equeue-broker-flush")
        self.flushes = 0
        self.sends_flushed = 0

    @property
    def pending(self) -> int:
        return len(self._waiting)

    def add(self, peer: Waiter, request_id: int, result: object) -> None:
        """``peer.finish(request_id, result)`` once what was appended so far is durable
        (or with the flush's error instead of ``result``)."""
        self._waiting.append((peer, request_id, result))
        if self._running is None:
            self._start()

    def _start(self) -> None:
        batch, self._waiting = self._waiting, []
        future = self._loop.run_in_executor(self._executor, self._flush_log)
        self._running = future
        future.add_done_callback(lambda done: self._finished(batch, done))

    def _finished(self, batch: list[Entry], done: asyncio.Future[None]) -> None:
        self._running = None
        error: BaseException | None = None
        if done.cancelled():
            error = StoreWriteError(0, "the broker stopped before this send's flush ran")
        elif (exc := done.exception()) is not None:
            log.error(
                "flushing the message log failed; %d sends answered with it: %s", len(batch), exc
            )
            if isinstance(exc, StoreWriteError):
                error = type(exc)(
                    exc.errno, f"the flush of this send failed, it may be lost: {exc}"
                )
            else:
                error = exc
        else:
            self.flushes += 1
            self.sends_flushed += len(batch)
        for peer, request_id, result in batch:
            try:
                peer.finish(request_id, result if error is None else error)
            except Exception:  # one connection's failure must not keep the others' answers
                log.exception("releasing a durable send's answer failed")
        if self._waiting:
            self._start()

    async def drain(self) -> None:
        """Until every send handed over so far is released."""
        while self._running is not None:
            await asyncio.wait([self._running])
            await asyncio.sleep(0)  # _finished runs as the future's callback

    def close(self) -> None:
        self._executor.shutdown(wait=True)
