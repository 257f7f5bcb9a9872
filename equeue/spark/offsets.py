"""The batch source's ``startingOffsets``/``endingOffsets``: offsets [start, end) of each
queue of some topics, as Spark's Kafka source reads a batch.

The options are parsed as the streaming source parses ``startingOffsets`` (stream.py,
imported when needed: stream.py imports the batch source). Planning turns them into
spans (topic, queue id, start, stop), read through the queues' index; ``in_ranges`` keeps
exactly those rows wherever a chunk is read whole (a compacted chunk, a scan).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

import pyarrow as pa
import pyarrow.compute as pc

from equeue.errors import DataLossError, SparkOptionError
from equeue.spark.columns import RowFilter

if TYPE_CHECKING:
    from equeue.spark.stream import StreamOptions
    from equeue.spark.viabroker import BrokerQueues
    from equeue.store.store import MessageStore

log = logging.getLogger(__name__)

QueueSpans = list[tuple[str, int, int, int]]  # (topic, queue id, start, stop): [start, stop)
_OFFSET_OPTIONS: Final = ("topics", "topicpattern", "startingoffsets", "endingoffsets")


class OffsetBounds:
    def __init__(
        self,
        stream: StreamOptions,
        starting: dict[str, dict[str, int]] | None,
        ending: dict[str, dict[str, int]] | None,
    ) -> None:
        self.options = stream  # topics / topicPattern, failOnDataLoss, path
        self.starting = starting  # None: earliest everywhere
        self.ending = ending  # None: latest everywhere

    @classmethod
    def of(cls, options: Mapping[str, str]) -> OffsetBounds | None:
        """The offsets options of a batch read, checked; None if none is given (the
        whole store is read)."""
        from equeue.spark.stream import EARLIEST, LATEST, StreamOptions, offsets_json

        given = {key.lower(): value for key, value in options.items()}
        if not any(name in given for name in _OFFSET_OPTIONS):
            if "failondataloss" in given:
                raise SparkOptionError(
                    "option failOnDataLoss goes with startingOffsets/endingOffsets and "
                    "topics or topicPattern (a read of queue offsets)"
                )
            return None
        for other in ("chunks", "fields"):
            if other in given:
                raise SparkOptionError(
                    f"option {other} does not go with topics/topicPattern/startingOffsets/"
                    "endingOffsets (a read of queue offsets)"
                )
        if ("topics" in given) == ("topicpattern" in given):
            raise SparkOptionError(
                "read.format('equeue') with startingOffsets/endingOffsets needs exactly one of "
                "the options 'topics' (names, comma-separated) and 'topicPattern' (a regular "
                "expression), got " + ("both" if "topics" in given else "neither")
            )
        kept = (
            "topics", "topicpattern", "failondataloss", "broker", "tokenfile", "cafile",
            "connecttimeout", "timeout",
        )  # fmt: skip
        # Through a broker there is no path (viabroker.py: the two are exclusive).
        where = {} if "broker" in given else {"path": given.get("path") or "(no path)"}
        stream = StreamOptions(where | {k: given[k] for k in kept if k in given})
        bounds: list[dict[str, dict[str, int]] | None] = []
        for name, default, refused in (
            ("startingOffsets", "earliest", "latest"),
            ("endingOffsets", "latest", "earliest"),
        ):
            text = given.get(name.lower(), default).strip()
            if text == refused:
                raise SparkOptionError(
                    f"option {name}={text!r} is not for a batch read (as in Spark's Kafka "
                    f"source): {name} takes {default!r} or JSON offsets"
                )
            parsed = None if text == default else offsets_json(text, name)
            for topic, queues in (parsed or {}).items():
                if not stream.matches(topic):
                    raise SparkOptionError(
                        f"option {name} names topic {topic!r}, which the option topics/"
                        "topicPattern does not select"
                    )
                for queue, offset in queues.items():
                    if offset == (LATEST if refused == "latest" else EARLIEST):
                        raise SparkOptionError(
                            f"option {name}: offset {offset} ({refused}) of {topic}/{queue} is "
                            "not for a batch read (as in Spark's Kafka source)"
                        )
            bounds.append(parsed)
        return cls(stream, bounds[0], bounds[1])

    def spans(self, opened: MessageStore | BrokerQueues) -> QueueSpans:
        """Each queue's [start, stop) now: start -2 / default its first offset, stop -1 /
        default its next offset. Offsets retention removed are data loss (failOnDataLoss)."""
        from equeue.spark.stream import EARLIEST, LATEST, lost_message

        opened.refresh()  # the writer's queues as they are now, if the handle is not new
        path = str(opened.path)
        existing = opened.topics()
        named = self.options.topics or []
        for topic in [*named, *(self.starting or {}), *(self.ending or {})]:
            if topic not in existing:
                raise SparkOptionError(
                    f"option topics/startingOffsets/endingOffsets names topic {topic!r}, "
                    f"which {path} does not hold"
                )
        out: QueueSpans = []
        for topic in sorted(t for t in existing if self.options.matches(t)):
            queues = {str(q) for q in opened.queue_ids(topic)}
            starting = (self.starting or {}).get(topic, {})
            ending = (self.ending or {}).get(topic, {})
            for queue in sorted({*starting, *ending} - queues, key=int):
                raise SparkOptionError(
                    f"option startingOffsets/endingOffsets names {topic}/{queue}: topic "
                    f"{topic!r} of {path} has queues 0 to {len(queues) - 1}"
                )
            for queue in sorted(queues, key=int):
                first, next_ = opened.queue_range(topic, int(queue))
                start = starting.get(queue, EARLIEST)
                stop = ending.get(queue, LATEST)
                start = first if start == EARLIEST else start
                stop = next_ if stop == LATEST else stop
                where = f"{topic}/{queue}"
                for name, offset in (("startingOffsets", start), ("endingOffsets", stop)):
                    if offset > next_:
                        raise SparkOptionError(
                            f"option {name}: offset {offset} of {where} is past the queue's "
                            f"end (next offset {next_}) in {path}"
                        )
                if start > stop:
                    raise SparkOptionError(
                        f"option startingOffsets {start} of {where} is past its endingOffsets "
                        f"{stop}"
                    )
                if start < first:
                    message = lost_message(path, topic, queue, start, first, min(first, stop))
                    if self.options.fail_on_data_loss:
                        raise DataLossError(
                            message + "; set failOnDataLoss=false to read what is left"
                        )
                    log.warning("%s; skipped (failOnDataLoss=false)", message)
                    start = min(first, stop)
                if start < stop:
                    out.append((topic, int(queue), start, stop))
        return out


def in_ranges(spans: QueueSpans, keep: RowFilter | None) -> RowFilter:
    """``keep`` and the rows whose queue offset lies in their queue's [start, stop) of
    ``spans``; rows of other queues are not kept."""
    keys = pa.array([f"{t}\0{q}" for t, q, _, _ in spans], pa.string())
    starts = pa.array([s for _, _, s, _ in spans], pa.int64())
    stops = pa.array([s for _, _, _, s in spans], pa.int64())

    def kept(heads: Mapping[str, pa.Array]) -> pa.Array:
        queue = pc.cast(heads["queue_id"], pa.string())
        key = pc.binary_join_element_wise(heads["topic"], queue, "\0")
        where = pc.index_in(key, value_set=keys)
        offset = heads["queue_offset"]
        lo, hi = pc.take(starts, where), pc.take(stops, where)
        mask = pc.fill_null(pc.and_(pc.greater_equal(offset, lo), pc.less(offset, hi)), False)
        return mask if keep is None else pc.and_kleene(mask, keep(heads))

    return kept
