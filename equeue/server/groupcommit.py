"""``--flush sync`` across clients: one fdatasync covers the sends of every connection.

Sends are appended on the event loop thread (the broker is the store's only writer)
and their answers kept back. One flusher thread fdatasyncs the message log; the batch
it releases is exactly the answers appended before that fdatasync was started, since
the loop hands them over when it starts it. Sends arriving meanwhile wait for the
next one, so the more clients send, the more each fdatasync covers (RocketMQ's
GroupCommitService, across processes instead of threads).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable

from equeue.errors import StoreWriteError

log = logging.getLogger("equeue.server")

Release = Callable[[BaseException | None], None]


class CrossClientCommit:
    """Runs on the loop; ``flush_log`` runs on its one thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, flush_log: Callable[[], None]) -> None:
        self._loop = loop
        self._flush_log = flush_log
        self._waiting: list[Release] = []
        self._running: asyncio.Future[None] | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "equeue-broker-flush")
        self.flushes = 0
        self.sends_flushed = 0

    @property
    def pending(self) -> int:
        return len(self._waiting)

    def add(self, release: Release) -> None:
        """Call ``release(None)`` once what was appended so far is durable (or with the
        flush's error)."""
        self._waiting.append(release)
        if self._running is None:
            self._start()

    def _start(self) -> None:
        batch, self._waiting = self._waiting, []
        future = self._loop.run_in_executor(self._executor, self._flush_log)
        self._running = future
        future.add_done_callback(lambda done: self._finished(batch, done))

    def _finished(self, batch: list[Release], done: asyncio.Future[None]) -> None:
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
        for release in batch:
            try:
                release(error)
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
