"""Who holds retention back under ``retention_respects_consumers``: the reader (a consumer
group, or the broker's retry mover) whose position is lowest in the log when retention
would remove a chunk but may not. Logged by ``apply_retention`` at most once per
checkpoint (said again when the holder moves, else every ``REPEAT_S``), and kept for
the broker's ``stats`` (``retention_held``; docs/broker.md, "Retention")."""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from equeue.store.store import MessageStore

log = logging.getLogger("equeue.retention")

# A hold that lasts (an idle group) is said again this often, not at every checkpoint
# (every 10 s under the default flush_thorough_interval_ms).
REPEAT_S: Final = 600.0


@dataclass(frozen=True)
class Reader:
    """Where a reader still has to read: ``offset`` of ``topic``/``queue_id``, whose
    message is at log ``position``. ``committed`` False: the reader never committed on
    this queue (an internal queue, read from its first offset)."""

    group: str
    topic: str
    queue_id: int
    offset: int
    position: int
    committed: bool = True
    # a group file no offsets of which are known (unreadable, never read whole): its
    # error; the reader then holds the whole log (reviewf F9)
    damaged: str | None = None


@dataclass(frozen=True)
class Hold:
    """Retention was held back at its last run: ``reader`` is the lowest; the log was
    ``log_bytes`` (counted as retention counts it) against ``max_store_bytes``, and/or
    its oldest chunk was past ``retention`` (``expired``)."""

    reader: Reader
    log_bytes: int
    max_store_bytes: int | None
    expired: bool
    since: float  # time.time() when retention was first held by this reader

    def describe(self) -> str:
        reader = self.reader
        if reader.damaged is not None:
            return (
                f"retention held: {reader.damaged}; what that group has consumed is unknown, "
                "so retention_respects_consumers (--retention-respects-consumers) removes "
                "nothing meanwhile"
            )
        where = f"{reader.topic}/{reader.queue_id} offset {reader.offset}"
        if not reader.committed:
            where += " (not committed yet: counted from the queue's first offset)"
        why = []
        if self.max_store_bytes is not None and self.log_bytes > self.max_store_bytes:
            why.append(
                f"the log is {self.log_bytes} bytes, over max_store_bytes (--max-store-bytes) "
                f"{self.max_store_bytes}"
            )
        if self.expired:
            why.append("its oldest chunk is past retention (--retention)")
        return (
            f"retention held by group {reader.group!r} at {where}: {'; '.join(why)}; "
            "retention_respects_consumers (--retention-respects-consumers) keeps what a group "
            "has not consumed (docs/broker.md, 'Retention', says how to release a group)"
        )

    def as_stats(self) -> dict[str, Any]:
        reader = self.reader
        return {
            "group": reader.group,
            "queue": f"{reader.topic}/{reader.queue_id}",
            "offset": reader.offset,
            "committed": reader.committed,
            "damaged": reader.damaged,
            "log_bytes": self.log_bytes,
            "max_store_bytes": self.max_store_bytes,
            "expired": self.expired,
            "since_s": round(max(time.time() - self.since, 0.0), 1),
        }


# Per store: the hold of retention's last run (None: not held), and when it was last
# logged. Kept beside the store, as retention's floors are, not on it.
_holds: weakref.WeakKeyDictionary[MessageStore, tuple[Hold | None, float]] = (
    weakref.WeakKeyDictionary()
)


def note_hold(store: MessageStore, reader: Reader | None, log_bytes: int, expired: bool) -> None:
    """Retention's run ended: held back by ``reader`` (None: not held)."""
    before, said = _holds.get(store, (None, 0.0))
    if reader is None:
        if before is not None:
            log.info("retention is no longer held (it was by group %r)", before.reader.group)
        _holds[store] = (None, 0.0)
        return
    now = time.time()
    # the same reader on the same queue: its offset moving a little is no news
    same = before is not None and _where(before.reader) == _where(reader)
    hold = Hold(
        reader, log_bytes, store.config.max_store_bytes, expired,
        before.since if before is not None and same else now,
    )  # fmt: skip
    if not same or now - said >= REPEAT_S:
        log.warning("%s", hold.describe())
        said = now
    _holds[store] = (hold, said)


def _where(reader: Reader) -> tuple[str, str, int]:
    return reader.group, reader.topic, reader.queue_id


def retention_hold(store: MessageStore) -> Hold | None:
    """The hold of retention's last run on ``store`` (in this process), or None."""
    return _holds.get(store, (None, 0.0))[0]
