"""Filter pushdown of the batch source (``DataSourceReader.pushFilters``, Spark >= 4.1).

A pushed filter is applied twice: to plan (chunks skipped by their footer's stored-time
range; the key index or a queue's index naming the only records to read) and to every
row the reader builds (``Pushed.keep``), so the rows are exactly those Spark's own
filter would keep and the filter need not be returned to Spark. Planning only ever
narrows to a superset of those rows. Filters of other kinds, columns or value types are
returned, and Spark applies them.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import (
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    LessThan,
    LessThanOrEqual,
)

STRING_COLUMNS: Final = frozenset({"topic", "tag", "key"})
INT_COLUMNS: Final = frozenset({"queue_id", "queue_offset", "position"})
TIME_COLUMNS: Final = frozenset({"stored_at", "created_at"})
_COMPARISONS: Final = (EqualTo, GreaterThan, GreaterThanOrEqual, LessThan, LessThanOrEqual)
INT32: Final = (-(1 << 31), (1 << 31) - 1)
_INT64: Final = (-(1 << 63), (1 << 63) - 1)
_EPOCH: Final = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
_US: Final = dt.timedelta(microseconds=1)


def _micros(value: dt.datetime) -> int:
    """A Spark timestamp literal as µs since the epoch. Spark 4.3 hands a pushed filter's
    TimestampType value to Python as an aware datetime in UTC; a naive one (as
    ``collect()`` gives, in the session's local time zone) is read as local time."""
    if value.tzinfo is None:
        value = value.astimezone()  # local time, as Spark converted it
    return (value - _EPOCH) // _US


def _limits(kind: pa.DataType) -> tuple[int, int]:
    return INT32 if kind == pa.int32() else _INT64


def _value(column: str, value: Any) -> int | str | None:
    """The filter's value in the column's terms, or None if this reader does not take it."""
    if column in STRING_COLUMNS:
        return value if isinstance(value, str) else None
    if column in INT_COLUMNS:
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    if column in TIME_COLUMNS:
        return _micros(value) if isinstance(value, dt.datetime) else None
    return None


@dataclass
class Pushed:
    """The filters taken, ANDed: per column a set of allowed values (= and IN) and an
    inclusive range (<, <=, >, >=; µs for timestamps)."""

    values: dict[str, frozenset[Any]] = field(default_factory=dict)
    ranges: dict[str, tuple[int | None, int | None]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.values or self.ranges)

    def take(self, filters: Iterable[Filter]) -> Iterator[Filter]:
        """Keep what this reader handles; yield the others back (for Spark)."""
        for f in filters:
            if not self._take(f):
                yield f

    def _take(self, f: Filter) -> bool:
        attribute: tuple[str, ...] = getattr(f, "attribute", ())
        if len(attribute) != 1:
            return False
        column = attribute[0]
        if isinstance(f, In):
            if column not in STRING_COLUMNS | INT_COLUMNS:
                return False
            # A NULL in the list matches nothing (x IN (NULL, 'a') is not true for 'b').
            found = [_value(column, v) for v in f.value if v is not None]
            if any(v is None for v in found):
                return False
            self._allow(column, frozenset(found))
            return True
        if not isinstance(
            f, EqualTo | GreaterThan | GreaterThanOrEqual | LessThan | LessThanOrEqual
        ):
            return False
        value = _value(column, f.value)
        if value is None:
            return False
        if isinstance(f, EqualTo):
            if isinstance(value, int) and column in TIME_COLUMNS:
                self._bound(column, value, value)
            else:
                self._allow(column, frozenset([value]))
            return True
        if not isinstance(value, int):
            return False  # string ranges: Spark's collation, not ours
        if isinstance(f, GreaterThan):
            self._bound(column, value + 1, None)
        elif isinstance(f, GreaterThanOrEqual):
            self._bound(column, value, None)
        elif isinstance(f, LessThan):
            self._bound(column, None, value - 1)
        else:
            self._bound(column, None, value)
        return True

    def _allow(self, column: str, values: frozenset[Any]) -> None:
        if column == "queue_id":  # an int32 column: other values match nothing
            values = frozenset(v for v in values if INT32[0] <= v <= INT32[1])
        old = self.values.get(column)
        self.values[column] = values if old is None else old & values

    def _bound(self, column: str, lo: int | None, hi: int | None) -> None:
        old_lo, old_hi = self.ranges.get(column, (None, None))
        if old_lo is not None and (lo is None or old_lo > lo):
            lo = old_lo
        if old_hi is not None and (hi is None or old_hi < hi):
            hi = old_hi
        self.ranges[column] = (lo, hi)

    def range(self, column: str) -> tuple[int | None, int | None]:
        """The column's inclusive range (with its allowed values, for integers)."""
        lo, hi = self.ranges.get(column, (None, None))
        allowed = self.values.get(column)
        if allowed is not None and column in INT_COLUMNS and allowed:
            lo = min(allowed) if lo is None else max(lo, min(allowed))
            hi = max(allowed) if hi is None else min(hi, max(allowed))
        return lo, hi

    def nothing(self) -> bool:
        """The filters contradict each other: no row can match."""
        if any(not v for v in self.values.values()):
            return True
        for column in self.ranges:
            lo, hi = self.range(column)
            if lo is not None and hi is not None and lo > hi:
                return True
        return False

    def keep(self, heads: Mapping[str, pa.Array]) -> pa.Array:
        """The rows of a block that pass every filter taken (a boolean array; null, as
        for a keyless message under a key filter, counts as false)."""
        mask: pa.Array | None = None
        for column, allowed in self.values.items():
            values = heads[column]
            m = pc.is_in(values, value_set=pa.array(sorted(allowed), values.type))
            mask = m if mask is None else pc.and_kleene(mask, m)
        for column, (lo, hi) in self.ranges.items():
            values = heads[column]
            if column in TIME_COLUMNS:
                values = values.cast(pa.int64())
            least, most = _limits(values.type)
            for bound, compare in ((lo, pc.greater_equal), (hi, pc.less_equal)):
                if bound is None:
                    continue
                if not least <= bound <= most:  # a queue_id bound beyond int32: all or none
                    none = bound > most if compare is pc.greater_equal else bound < least
                    m = pa.array([not none] * len(values), pa.bool_())
                else:
                    m = compare(values, pa.scalar(bound, values.type))
                mask = m if mask is None else pc.and_kleene(mask, m)
        assert mask is not None  # only called when something was taken
        return pc.fill_null(mask, False)
