"""Human output: tables that fit 80 columns, sizes in KiB/MiB, times in ISO-8601 UTC.

Sentences (problems, summaries) are wrapped at 80 columns only for a terminal
(``wrap=True``): in a pipe or a file a line break inside a sentence ("43475" /
"removed") would split what grep and the reader look for. ``--json`` output does not
come through here: it carries the raw numbers.
"""

from __future__ import annotations

import datetime as dt
import textwrap
import time
from collections.abc import Sequence
from typing import TextIO

from equeue.inspect.layout import Problem
from equeue.inspect.records import Record, body_text
from equeue.inspect.summary import Checksum, FileSummary, StoreSummary

WIDTH = 80
_ELLIPSIS = "..."
_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")

# Rows of a store summary's queue and consumer group tables; past it, the largest
# (or most lagging) and totals, so 10,000 queues stay readable.
TOP_ROWS = 20


def human_size(n: int) -> str:
    if abs(n) < 1024:
        return f"{n} B"
    value = float(n)
    for unit in _UNITS:
        value /= 1024
        if abs(value) < 1024 or unit == _UNITS[-1]:
            break
    return f"{value:.1f} {unit}"


def human_time(ns: int | None, *, precise: bool = False) -> str:
    if ns is None:
        return "-"
    try:
        when = dt.datetime.fromtimestamp(ns / 1e9, dt.UTC)
    except (OverflowError, OSError, ValueError):
        return f"{ns} ns (out of range)"
    if precise:  # microseconds: records may be stored within the same millisecond
        return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def clip(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    return text[: max(0, width - len(_ELLIPSIS))] + _ELLIPSIS


def table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    right: Sequence[int] = (),
    shrink: int = 0,
    indent: int = 2,
) -> list[str]:
    """Aligned columns; the ``shrink`` column is clipped until the table fits WIDTH."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]
    used = indent + sum(widths) + 2 * (len(widths) - 1)
    if used > WIDTH:
        widths[shrink] = max(len(headers[shrink]), widths[shrink] - (used - WIDTH))

    def line(cells: Sequence[str]) -> str:
        parts = []
        for i, (cell, width) in enumerate(zip(cells, widths, strict=True)):
            cell = clip(cell, width)
            parts.append(cell.rjust(width) if i in right else cell.ljust(width))
        return (" " * indent + "  ".join(parts)).rstrip()

    return [line(headers)] + [line(row) for row in rows]


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except ValueError:  # a closed stream
        return False


def fill(text: str, *, wrap: bool) -> str:
    """``text`` wrapped at WIDTH when ``wrap`` (a terminal), else whole on one line."""
    return textwrap.fill(text, WIDTH, break_on_hyphens=False) if wrap else text


def _wrap(text: str, indent: str, wrap: bool) -> list[str]:
    if not wrap:
        return [indent + text]
    return textwrap.wrap(
        text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ", break_on_hyphens=False
    ) or [indent]


def _where(problem: Problem) -> str:
    if problem.offset is None:
        return problem.file
    return f"{problem.file} at offset {problem.offset} (0x{problem.offset:x})"


def render_problems(problems: Sequence[Problem], indent: str = "", *, wrap: bool) -> list[str]:
    lines: list[str] = []
    for problem in problems:
        lines.append(indent + _where(problem))  # whole, so it can be copied: a path is data
        lines += _wrap(f"{problem.kind}: {problem.reason}", indent + "  ", wrap)
    return lines


# --- inspect STORE ------------------------------------------------------------------


def render_store(s: StoreSummary, *, wrap: bool) -> str:
    store_id = f"{s.store_id:08x}" if s.store_id is not None else "unknown"
    sizes = (
        f"chunk data size {human_size(s.chunk_data_size)}"
        if s.chunk_data_size is not None
        else "chunk data size unknown"
    )
    if s.queue_chunk_records is not None:
        sizes += f", {s.queue_chunk_records} entries per queue chunk"
    checkpoint = "none" if s.checkpoint_position is None else str(s.checkpoint_position)
    if s.live_tail_position is not None:
        checkpoint += f", live tail {s.live_tail_position}"
    lines = [
        f"Store    {s.store}",
        f"Id       {store_id}, {sizes}",
        f"Log      positions {s.first_position} .. {s.end_position}, {s.records} records, "
        f"checkpoint {checkpoint}",
        f"On disk  {human_size(s.allocated_bytes)} allocated for {human_size(s.data_bytes)} of "
        f"data, {human_size(s.apparent_bytes)} apparent, {s.file_count} files",
    ]
    if s.journal_records:  # a writer killed (or running) since its last fold
        lines.append(
            f"Topics   {s.journal_records} changes in topics.journal, not yet folded into "
            "topics.json (a writable open folds them)"
        )
    lines += ["", f"Message chunks ({len(s.message_chunks)})"]
    if s.message_chunks:
        rows = [
            [
                c.file.rsplit("/", 1)[-1],
                c.state,
                str(c.records),
                human_size(c.physical_size),
                human_size(c.logical_size),
            ]
            for c in s.message_chunks
        ]
        header, *body = table(
            ["FILE", "STATE", "RECORDS", "USED", "LOGICAL"], rows, right=(2, 3, 4)
        )
        lines.append(header)
        for row, c in zip(body, s.message_chunks, strict=True):
            numbers = (
                f"chunk {c.start_number}"
                if c.start_number == c.end_number
                else f"chunks {c.start_number}-{c.end_number}"
            )
            if c.start_position is None:
                where = f"{numbers} (by its file name): the header is damaged"
            else:
                where = f"{numbers}, positions {c.start_position} .. {c.end_position}"
            lines += [row, *_wrap(where, "    ", wrap)]
            if c.first_stored_ns is not None:
                lines.append(
                    f"    stored {human_time(c.first_stored_ns)} .. {human_time(c.last_stored_ns)}"
                )
    else:
        lines.append("  none")
    queue_count = sum(len(t.queues) for t in s.topics)
    lines += ["", f"Topics ({len(s.topics)}, {queue_count} queues)"]
    if s.topics:
        queues = [(t.topic, q) for t in s.topics for q in t.queues]
        shown = queues
        if len(queues) > TOP_ROWS:  # the largest, then totals: a table stays readable
            shown = sorted(queues, key=lambda tq: (-tq[1].messages, tq[0], tq[1].queue_id))
            shown = shown[:TOP_ROWS]
            lines.append(f"  the {TOP_ROWS} largest by messages (--json lists every queue):")
        rows = [
            [
                f"{topic}/{q.queue_id}",
                str(q.first_offset),
                str(q.next_offset),
                str(q.messages),
                str(q.chunk_count),
            ]
            for topic, q in shown
        ]
        lines += table(
            ["TOPIC/QUEUE", "FIRST", "NEXT", "MESSAGES", "CHUNKS"], rows, right=(1, 2, 3, 4)
        )
        if len(queues) > TOP_ROWS:
            rest = [q for _, q in queues]
            lines.append(
                f"  all {len(queues)} queues: {sum(q.messages for q in rest)} messages, "
                f"{sum(q.chunk_count for q in rest)} queue chunks, "
                f"{sum(1 for q in rest if q.messages == 0)} empty"
            )
    else:
        lines.append("  none")
    groups = sorted({g.group for g in s.groups})
    lines += ["", f"Consumer groups ({len(groups)})"]
    if s.groups:
        lagging = s.groups
        if len(lagging) > TOP_ROWS:
            lagging = sorted(lagging, key=lambda g: -(g.lag or 0))[:TOP_ROWS]
            lines.append(f"  the {TOP_ROWS} most lagging (--json lists every commit):")
        rows = [
            [
                g.group,
                f"{g.topic}/{g.queue_id}",
                str(g.committed_offset),
                "-" if g.next_offset is None else str(g.next_offset),
                "-" if g.lag is None else str(g.lag),
            ]
            for g in lagging
        ]
        lines += table(["GROUP", "TOPIC/QUEUE", "COMMITTED", "NEXT", "LAG"], rows, right=(2, 3, 4))
        if len(s.groups) > TOP_ROWS:
            lines.append(
                f"  all {len(s.groups)} commits: total lag {sum(g.lag or 0 for g in s.groups)}"
            )
    else:
        lines.append("  none")
    if s.problems:
        lines += ["", f"Problems noticed ({len(s.problems)}); 'equeue verify' checks everything:"]
        lines += render_problems(s.problems, "  ", wrap=wrap)
    return "\n".join(lines)


# --- inspect FILE -----------------------------------------------------------------------


def _checksum(value: Checksum | None) -> str:
    if value is None:
        return "-"
    if value.ok:
        return f"ok (0x{value.stored:x})"
    return f"MISMATCH: stored 0x{value.stored:x}, computed 0x{value.computed:x}"


def _field_value(name: str, value: object) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return "-"
    if isinstance(value, int) and name.endswith("_ns"):
        return f"{human_time(value, precise=True)} ({value})"
    if isinstance(value, int) and name.endswith(("_size", "_position")) and value >= 1024:
        return f"{value} ({human_size(value)})"
    if isinstance(value, int) and name == "checksum":
        return f"0x{value:x}"
    return str(value)


def _fields(fields: dict[str, object]) -> list[str]:
    width = max(len(name) for name in fields)
    return [
        clip(f"  {name.ljust(width)}  {_field_value(name, value)}", WIDTH)
        for name, value in fields.items()
    ]


def render_file(f: FileSummary, *, wrap: bool) -> str:
    lines = [
        f"File     {f.file}",
        f"Kind     {f.kind}, {f.state}",
        f"Size     {f.file_size} bytes ({human_size(f.file_size)}), "
        f"{human_size(f.allocated_bytes)} allocated",
        "",
        f"Header   checksum {_checksum(f.header_checksum)}",
    ]
    if f.header is not None:
        lines += _fields(f.header)
    if f.footer is None and f.footer_blank:
        lines += ["", "Footer   blank: the chunk is ongoing (not completed)"]
    elif f.footer is None:
        lines += ["", "Footer   none that can be read (see Problems)"]
    else:
        lines += ["", f"Footer   checksum {_checksum(f.footer_checksum)}"]
        lines += _fields({**f.footer, "data checksum": _checksum(f.data_checksum)})
    if f.position_map_entries:
        lines.append(
            f"Position map  {f.position_map_entries} entries, {human_size(f.position_map_bytes)}"
        )
    lines += [
        "",
        f"Data     {f.data_used} bytes used ({human_size(f.data_used)}), {f.records} records",
    ]
    if f.first_timestamp_ns is not None:
        lines.append(
            f"Stored   {human_time(f.first_timestamp_ns)} .. {human_time(f.last_timestamp_ns)}"
        )
    if f.scan_problem:
        lines += _wrap(f"Scan     stopped early: {f.scan_problem}", "", wrap)
    if f.problems:
        lines += ["", f"Problems ({len(f.problems)})"]
        lines += render_problems(f.problems, "  ", wrap=wrap)
    return "\n".join(lines)


# --- records ------------------------------------------------------------------------


def body_preview(body: bytes, width: int) -> str:
    text = body_text(body)
    if text is not None:
        shown = text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
        return clip(shown.replace("\t", "\\t"), width)
    return clip("hex " + body[: width // 2].hex(), width)


def render_record(record: Record) -> str:
    m = record.message
    first = f"position {m.log_position} (0x{m.log_position:x})"
    if record.message_id is not None:
        first += f"  id {record.message_id}"
    second = f"  {m.topic}/{m.queue_id} offset {m.queue_offset}"
    if m.tag:
        second += f"  tag {m.tag}"
    if m.key is not None:
        second += f"  key {m.key}"
    if m.code:
        second += f"  code {m.code}"
    lines = [first, clip(second, WIDTH), f"  stored {human_time(m.stored_ns, precise=True)}"]
    if m.properties:
        props = ", ".join(f"{k}={v}" for k, v in m.properties.items())
        lines.append(clip(f"  properties {props}", WIDTH))
    head = f"  body {human_size(len(m.body))}: "
    lines.append(head + body_preview(m.body, WIDTH - len(head)))
    return "\n".join(lines)


# --- progress -----------------------------------------------------------------------


class ProgressBar:
    """A one-line bar on ``stream``, drawn only when it is a terminal (so logs and pipes
    stay clean), at most ten times a second, and only once ``delay`` seconds have passed
    (a run that ends sooner draws nothing). ``noun``: done and total count these (e.g.
    "queues"); without it they are bytes."""

    def __init__(
        self, stream: TextIO, label: str, *, noun: str | None = None, delay: float = 0.0
    ) -> None:
        self.stream = stream
        self.label = label
        self.noun = noun
        self.enabled = is_terminal(stream)
        self._drawn = 0.0
        self._from = time.monotonic() + delay

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if not self.enabled or now < self._from or (now - self._drawn < 0.1 and done < total):
            return
        self._drawn = now
        fraction = done / total if total else 1.0
        if self.noun is None:
            text = f" {fraction:4.0%}  {human_size(done)} of {human_size(total)}"
        else:
            text = f" {fraction:4.0%}  {done:,} of {total:,} {self.noun}"
        room = WIDTH - 1 - len(self.label) - len(text) - 3
        filled = int(room * fraction)
        bar = "#" * filled + "." * (room - filled)
        self.stream.write(f"\r{self.label} [{bar}]{text}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self._drawn:
            self.stream.write("\r" + " " * (WIDTH - 1) + "\r")
            self.stream.flush()
