"""``commit_offset`` off the event loop: each commit is answered once it is on disk
(fsynced), but the fsyncs run on one committer thread, and the commits that arrive while
it writes are written together, one file per group.

A commit that moves a group's offset forward (the usual one) goes to the group's file
``consumers/<group>.json`` (the store's ``commit_group``: under that directory's flock,
not the store's write lock, so sends never wait for it; a damaged file is moved aside
and written again from the offsets the broker last read of it); every handle reads the
larger of that file and ``offsets.json``. A commit below the committed offset is a
reset, which only ``MessageStore.commit_offset`` can do (it rewrites ``offsets.json``
under the write lock): the rare case, run on the same thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from typing import Any

from equeue.store import offsets as group_offsets
from equeue.store.store import MessageStore

log = logging.getLogger("equeue.server")

Release = Callable[[BaseException | None], None]
Key = tuple[str, str, int]  # group, topic, queue id


class OffsetCommitter:
    """Runs on the loop; the writes run on its one thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, store: MessageStore) -> None:
        self._loop = loop
        self._store = store
        self._waiting: list[tuple[Key, int, Release]] = []
        self._running: asyncio.Future[dict[Key, BaseException]] | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "equeue-broker-commit")
        self._jobs: set[asyncio.Future[None]] = set()  # run(): the retry mover's persisting
        self._last_job: asyncio.Future[None] | None = None
        self.writes = 0
        # Told (on the loop, before the commit is answered) of each group that committed an
        # offset below its committed one (a reset to reprocess): the retry mover forgets the
        # group's remembered nacks, so a message failing again is retried again.
        self.on_reset: Callable[[str], None] | None = None
        self._resets: list[str] = []  # (appended on the thread, read after it finished)
        # Work to run after the commits handed over before it (after_commits)
        self._after: list[tuple[Callable[[], Any], asyncio.Future[Any]]] = []

    def run(self, work: Callable[[], None]) -> asyncio.Future[None]:
        """``work`` on the committer thread (the retry mover's fdatasync and cursor
        write, off the loop); ``drain`` waits for it too."""
        job = self._loop.run_in_executor(self._executor, work)
        self._jobs.add(job)
        job.add_done_callback(self._job_done)
        self._last_job = job
        return job

    def after_commits(self, work: Callable[[], Any]) -> asyncio.Future[Any]:
        """``work`` on the committer thread once every commit handed over before it is
        written (a group's deletion: a commit of the group made before it must not
        re-create the group after it); its result or exception, on the loop."""
        outcome: asyncio.Future[Any] = self._loop.create_future()
        if self._running is None:  # (then nothing waits either: add() starts at once)
            self._chain(work, outcome)
        else:
            self._after.append((work, outcome))
        return outcome

    def _chain(self, work: Callable[[], Any], outcome: asyncio.Future[Any]) -> None:
        job = self._loop.run_in_executor(self._executor, work)
        self._jobs.add(job)

        def done(finished: asyncio.Future[Any]) -> None:
            self._jobs.discard(finished)
            if outcome.cancelled():
                return
            if finished.cancelled():
                outcome.cancel()
            elif (error := finished.exception()) is not None:
                outcome.set_exception(error)
            else:
                outcome.set_result(finished.result())

        job.add_done_callback(done)

    def _job_done(self, job: asyncio.Future[None]) -> None:
        self._jobs.discard(job)
        if not job.cancelled():
            # Retrieved here: the mover reads it again at its next tick, and drain() says
            # the last job's, which no tick reads (no "exception was never retrieved").
            job.exception()

    def add(self, key: Key, offset: int, release: Release) -> None:
        """Call ``release(None)`` once ``offset`` is committed durably (or with the error)."""
        self._waiting.append((key, offset, release))
        if self._running is None:
            self._start()

    def _start(self) -> None:
        batch, self._waiting = self._waiting, []
        final = {key: offset for key, offset, _ in batch}  # in arrival order: the last wins
        future = self._loop.run_in_executor(self._executor, self._write, final)
        self._running = future
        future.add_done_callback(lambda done: self._finished(batch, done))

    def _write(self, final: dict[Key, int]) -> dict[Key, BaseException]:
        """On the committer thread: the errors, by key."""
        store = self._store
        errors: dict[Key, BaseException] = {}
        forward: dict[str, dict[tuple[str, int], int]] = {}
        # Each group's committed offsets read once per batch (offsets.json's entry and the
        # group's file), not once per key.
        committed: dict[str, dict[str, dict[str, int]]] = {}
        for key, offset in final.items():
            group, topic, queue_id = key
            try:
                if group not in committed:
                    committed[group] = group_offsets.committed_group(store, group)
                current = committed[group].get(topic, {}).get(str(queue_id))
                if current is not None and offset < current:
                    store.commit_offset(group, topic, queue_id, offset)  # a reset
                    self.writes += 1
                    self._resets.append(group)
                else:
                    forward.setdefault(group, {})[(topic, queue_id)] = offset
            except Exception as exc:
                errors[key] = exc
        for group, positions in forward.items():
            try:
                group_offsets.commit_group(store, group, positions)
                self.writes += 1
            except Exception as exc:
                log.error("committing offsets of group %r failed: %s", group, exc)
                for topic, queue_id in positions:
                    errors[(group, topic, queue_id)] = exc
        return errors

    def _finished(
        self,
        batch: list[tuple[Key, int, Release]],
        done: asyncio.Future[dict[Key, BaseException]],
    ) -> None:
        self._running = None
        failed: BaseException | None = None
        errors: dict[Key, BaseException] = {}
        if done.cancelled():
            failed = RuntimeError("the broker stopped before this commit was written")
        elif (exc := done.exception()) is not None:
            failed = exc
        else:
            errors = done.result()
        resets, self._resets = self._resets, []
        if self.on_reset is not None:
            for group in dict.fromkeys(resets):
                self.on_reset(group)
        for key, _, release in batch:
            try:
                release(failed or errors.get(key))
            except Exception:  # one connection's failure must not keep the others' answers
                log.exception("releasing a commit's answer failed")
        if self._waiting:
            self._start()
        after, self._after = self._after, []
        for work, outcome in after:  # behind the commits that came before them
            self._chain(work, outcome)

    async def drain(self) -> None:
        """Until every commit handed over so far is written and answered."""
        while self._running is not None or self._jobs:
            waiting: list[asyncio.Future[Any]] = [*self._jobs]
            if self._running is not None:
                waiting.append(self._running)
            await asyncio.wait(waiting)
            await asyncio.sleep(0)
        self._say_last_job()

    def _say_last_job(self) -> None:
        """At the broker's stop: the mover has seen every job's outcome but the last one's
        (after a failure it starts another at once), so a failed last one is said here."""
        job, self._last_job = self._last_job, None
        if job is None or job.cancelled() or (error := job.exception()) is None:
            return
        log.error(
            "the retry mover's last cursor write failed as the broker stopped (%s): the "
            "delayed retries it moved since its last written cursors are moved again at the "
            "next start (delivered at least once)",
            error,
        )

    def close(self) -> None:
        self._executor.shutdown(wait=True)
