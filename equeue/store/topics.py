"""Per-topic cleanup policy: what the compaction batch may remove, persisted in topics.json.

``cleanup="delete"`` removes messages stored before now - ``retention``;
``cleanup="compact"`` keeps the newest message per key (Kafka semantics): a
keyed message with an empty body is a tombstone, which removes the key's older
messages and is itself removed once older than ``delete_retention``. Keyless
messages of a compacted topic follow ``retention``. ``retention=None`` keeps
messages forever (as far as this policy goes; the store-wide
``StoreConfig.retention`` still deletes whole chunks).
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

from equeue.errors import ConfigError, CorruptionError, EQueueError
from equeue.store import validate
from equeue.store.meta import TOPICS_FILE
from equeue.store.validate import MAX_SPAN, check_span

if TYPE_CHECKING:
    from equeue.store.store import MessageStore

log = logging.getLogger("equeue.recovery")

Cleanup = Literal["delete", "compact"]
CLEANUPS: Final = ("delete", "compact")
DEFAULT_DELETE_RETENTION: Final = dt.timedelta(hours=24)
# topics.json: the log position of a topic's latest deletion; its records before it
# belong to the deleted topic (a deleted topic not created again keeps only this field).
DELETED_BEFORE: Final = "deleted_before"


class _Unset:
    def __repr__(self) -> str:
        return "UNSET"


UNSET: Final = _Unset()  # "leave this setting as it is" in create_topic


@dataclass(frozen=True, slots=True)
class TopicPolicy:
    cleanup: Cleanup = "delete"
    retention: dt.timedelta | None = None
    delete_retention: dt.timedelta = DEFAULT_DELETE_RETENTION

    def __post_init__(self) -> None:
        if self.cleanup not in CLEANUPS:
            raise ConfigError(f"cleanup={self.cleanup!r}; it must be 'delete' or 'compact'")
        if self.retention is not None:
            check_span("retention", self.retention)
        check_span("delete_retention", self.delete_retention, allow_zero=True)

    @property
    def compact(self) -> bool:
        return self.cleanup == "compact"

    def changed(
        self,
        cleanup: Cleanup | _Unset = UNSET,
        retention: dt.timedelta | _Unset | None = UNSET,
        delete_retention: dt.timedelta | _Unset = UNSET,
    ) -> TopicPolicy:
        policy = self
        if not isinstance(cleanup, _Unset):
            policy = replace(policy, cleanup=cleanup)
        if not isinstance(retention, _Unset):
            policy = replace(policy, retention=retention)
        if not isinstance(delete_retention, _Unset):
            policy = replace(policy, delete_retention=delete_retention)
        return policy

    def to_json(self) -> dict[str, Any]:
        return {
            "cleanup": self.cleanup,
            "retention_seconds": None if self.retention is None else self.retention.total_seconds(),
            "delete_retention_seconds": self.delete_retention.total_seconds(),
        }

    @classmethod
    def from_json(
        cls, info: dict[str, Any], where: str, problems: list[str] | None = None
    ) -> TopicPolicy:
        """The policy of a topics.json entry; entries written before policies existed
        (no "cleanup" field) get the defaults. A span longer than MAX_SPAN (older versions
        accepted up to timedelta.max) is read as MAX_SPAN, and that is added to ``problems``."""
        try:
            retention = info.get("retention_seconds")
            delete_retention = info.get(
                "delete_retention_seconds", DEFAULT_DELETE_RETENTION.total_seconds()
            )
            return cls(
                cleanup=info.get("cleanup", "delete"),
                retention=None
                if retention is None
                else _span("retention", retention, info, where, problems),
                delete_retention=_span("delete_retention", delete_retention, info, where, problems),
            )
        except (TypeError, ValueError, OverflowError) as exc:
            raise ConfigError(f"unreadable topic policy in {where}: {info!r} ({exc})") from exc


# What an operator can do about a checksummed topics.json holding an entry no equeue
# wrote (review17 R17-8: nothing said it; `equeue rebuild-topics` reads only the journal).
BAD_ENTRY_REMEDY = (
    "move topics.json out of the store (into recovered/, say): a writable open then "
    "rebuilds it from the queue directories and the journal, each topic's cleanup "
    "policy reset to the defaults (set them again with create_topic())"
)


def topic_entries(
    body: Any, store: Path, problems: list[str] | None = None
) -> list[tuple[str, int, TopicPolicy]]:
    """(topic, queue count, policy) of each topics.json entry of ``store`` (its ``body``
    as read), every one checked as
    create_topic() checks its arguments before any is used: a name there becomes a
    directory, a count that many queues. A checksummed file with a bad entry was written
    by something else than equeue, so the open is refused, naming the entry."""
    path = str(store / TOPICS_FILE)
    if not isinstance(body, dict):
        raise CorruptionError(f"holds {type(body).__name__}, not topics", file=path, offset=0)
    entries = []
    for topic, info in body.items():
        try:
            validate.check_topic(topic)
            if not isinstance(info, dict):
                raise ConfigError(f"its entry is {info!r}, not an object")
            _deleted_before(info)
            if "queue_count" not in info and DELETED_BEFORE in info:
                continue  # deleted, not created again
            count = validate.check_queue_count(info.get("queue_count"))
            policy = TopicPolicy.from_json(info, path, problems)
        except EQueueError as exc:
            raise CorruptionError(
                f"bad topic entry {str(topic)[:80]!r} ({exc})",
                file=path,
                offset=0,
                remedy=BAD_ENTRY_REMEDY,
            ) from None
        entries.append((topic, count, policy))
    return sorted(entries)


def _span(
    name: str, seconds: object, info: dict[str, Any], where: str, problems: list[str] | None
) -> dt.timedelta:
    value = float(seconds)  # type: ignore[arg-type]
    if not value > MAX_SPAN.total_seconds():  # (NaN is refused by timedelta below)
        return dt.timedelta(seconds=value)
    problem = (
        f"topic policy {info!r} in {where}: {name} of {value:g} seconds is longer than the "
        f"longest accepted ({MAX_SPAN.days} days); it is read as {MAX_SPAN.days} days "
        "(create_topic() with a new value rewrites it)"
    )
    if problems is None or problem not in problems:  # (a read-only handle rereads the file)
        log.warning("%s", problem)
        if problems is not None:
            problems.append(problem)
    return MAX_SPAN


def _deleted_before(info: dict[str, Any]) -> int | None:
    value = info.get(DELETED_BEFORE)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ConfigError(f"{DELETED_BEFORE}={value!r} is not a log position")
    return value


def deletions(body: Any) -> dict[str, int]:
    """{topic: log position of its deletion} of topics.json's body (checked by
    ``topic_entries``, which the store calls first)."""
    if not isinstance(body, dict):
        return {}
    found = {}
    for topic, info in body.items():
        if isinstance(info, dict) and isinstance(info.get(DELETED_BEFORE), int):
            found[topic] = info[DELETED_BEFORE]
    return found


def topics_body(
    counts: dict[str, int], policies: dict[str, TopicPolicy], deleted: dict[str, int]
) -> dict[str, Any]:
    """topics.json's body: each topic's queue count and policy, and the deletions."""
    body: dict[str, Any] = {
        topic: {"queue_count": count, **policies.get(topic, TopicPolicy()).to_json()}
        for topic, count in counts.items()
    }
    for topic, position in deleted.items():
        body.setdefault(topic, {})[DELETED_BEFORE] = position
    return body


def create_or_change(
    store: MessageStore,
    topic: str,
    queue_count: int | None,
    cleanup: Cleanup | _Unset,
    retention: dt.timedelta | _Unset | None,
    delete_retention: dt.timedelta | _Unset,
) -> None:
    """``MessageStore.create_topic`` under the write lock: the queue count grows (never
    shrinks), each cleanup setting given replaces the topic's; a failure (disk full)
    leaves the topic as it was."""
    current = len(store._queues.get(topic, ()))
    if queue_count is None:
        queue_count = current or store.config.default_queue_count
    count = validate.check_queue_count(queue_count, topic)
    old_policy = store._policies.get(topic, TopicPolicy())
    policy = old_policy.changed(cleanup, retention, delete_retention)
    if count < current:
        raise ConfigError(
            f"topic {topic!r} has {current} queues; a queue count can grow, not shrink to {count}"
        )
    if count == current and policy == old_policy:
        return
    previous = list(store._queues.get(topic, ()))
    try:
        store._open_queues(topic, count)
        store._policies[topic] = policy
        store._save_topics(topic)
    except BaseException:  # e.g. disk full: the topic stays as it was
        for queue in store._queues.get(topic, [])[len(previous) :]:
            queue.close()
        if previous:
            store._queues[topic] = previous
            store._policies[topic] = old_policy
        else:
            store._queues.pop(topic, None)
            store._topic_bytes.pop(topic, None)
            store._round_robin.pop(topic, None)
            store._policies.pop(topic, None)
        raise
