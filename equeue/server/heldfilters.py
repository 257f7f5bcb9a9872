"""The tag filters a connection's held pulls keep, counted against ``max_held_filter_bytes``.

A held pull keeps its filter for its ``wait_ms`` (up to a day). A filter may name 1,024
tags of up to 255 bytes (``equeue.store.reads.MAX_FILTER_TAGS``), ~350 KB, and one
connection may hold ``max_in_flight`` pulls: review4 R4 held 1,000 of them, +346 MB of
broker memory, for a day. So one connection's distinct filters are kept once each (the
library's consumer sends the same filter with each of its up to 64 long polls: one copy
for all of them), and their weight is bounded per connection: a pull whose new filter
would pass the bound is not held (holds.py answers it empty, ``later``).
"""

from __future__ import annotations

from collections.abc import Iterable

# A tag's weight beyond its UTF-8 bytes: the str object's header (49 bytes for an ASCII
# str) and its slot in the frozenset's table (16 bytes, at most 2/3 full): so 1,024
# one-byte tags weigh what they take, ~80 KB, not 1 KB.
TAG_OVERHEAD = 80


def filter_weight(tags: frozenset[str]) -> int:
    return sum(len(tag.encode()) for tag in tags) + TAG_OVERHEAD * len(tags)


class _Kept:
    __slots__ = ("pulls", "tags", "weight")

    def __init__(self, tags: frozenset[str], weight: int) -> None:
        self.tags = tags
        self.weight = weight
        self.pulls = 1


class Filters:
    """One connection's held filters, each kept once however many of its pulls wait with
    it, and their weight (``weight``)."""

    __slots__ = ("_kept", "weight")

    def __init__(self) -> None:
        self.weight = 0
        self._kept: dict[frozenset[str], _Kept] = {}

    def keep(self, tags: str | Iterable[str], limit: int) -> frozenset[str] | None:
        """The filter ``tags`` (a str or the tags, as the store's tag filter checked them)
        as held pulls keep it, shared with this connection's other held pulls of the same
        tags; None (nothing kept) when it is new and would take ``weight`` past ``limit``."""
        wanted = frozenset([tags] if type(tags) is str else tags)
        kept = self._kept.get(wanted)
        if kept is not None:
            kept.pulls += 1
            return kept.tags
        weight = filter_weight(wanted)
        if self.weight + weight > limit:
            return None
        self._kept[wanted] = _Kept(wanted, weight)
        self.weight += weight
        return wanted

    def release(self, tags: frozenset[str]) -> int:
        """A held pull with ``tags`` (as ``keep`` gave them) is answered: the weight that
        frees (its filter's, when it was the last pull to keep it; else 0)."""
        kept = self._kept[tags]
        kept.pulls -= 1
        if kept.pulls:
            return 0
        del self._kept[tags]
        self.weight -= kept.weight
        return kept.weight
