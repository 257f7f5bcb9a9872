"""The options of a consumer loop, checked once for the store's Consumer
(equeue/store/consumer.py) and the clients' group members (equeue/client/groupstate.py,
consumer.py, consumer_aio.py): a bad value raises the same class and message from both."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

from equeue.errors import InvalidMessageError, InvalidTypeError
from equeue.store.reads import tag_filter
from equeue.store.validate import check_topic

Start = Literal["committed", "earliest", "latest"]
STARTS = ("committed", "earliest", "latest")
MAX_BATCH = 1 << 20  # batch_size and poll's max_count: the messages one fetch holds at most


def check_topics(topics: str | Iterable[str]) -> list[str]:
    """The topics, each once, in their order; each name checked (not looked up)."""
    names = [topics] if isinstance(topics, str) else _list(topics, "topics")
    if not names:
        raise InvalidMessageError("a consumer needs at least one topic")
    for topic in names:
        check_topic(topic)
    return list(dict.fromkeys(names))


def check_tags(tags: str | Iterable[str] | None) -> str | list[str] | None:
    """A tag filter as pull takes it; an empty one is refused here, not at the first pull."""
    if tags is not None and not isinstance(tags, str):
        tags = _list(tags, "tags")
    tag_filter(tags)
    return tags


def check_start(start: object) -> Start:
    if start == "committed" or start == "earliest" or start == "latest":
        return start
    raise InvalidMessageError(f"start must be one of {', '.join(STARTS)}; got {start!r}")


def check_count(value: object, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidTypeError(f"{what} must be an int, got {type(value).__name__}")
    if not 1 <= value <= MAX_BATCH:
        raise InvalidMessageError(f"{what}={value} must lie in [1, {MAX_BATCH}]")
    return value


def check_seconds(value: object, what: str) -> float | None:
    """A wait: None (no bound) or a finite number of seconds >= 0."""
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise InvalidTypeError(f"{what} must be seconds (an int or a float) or None")
    if not 0 <= value < math.inf:
        raise InvalidMessageError(f"{what}={value!r} must be a finite number of seconds >= 0")
    return float(value)


def _list(values: Iterable[str], what: str) -> list[str]:
    try:
        return list(values)
    except TypeError:
        raise InvalidTypeError(
            f"{what} must be a str or an iterable of str, got {type(values).__name__}"
        ) from None
