"""The ``equeue`` command: look inside a store without writing code; also compact it,
serve it, and (``rebuild-topics``, equeue/store/topicsrebuild.py) repair a damaged
topics.journal.

Exit status: 0 success (verify: no problems), 1 problems found or damage met while
reading, 2 usage errors (bad options, a path that is not a store or chunk file).
Errors are one line on stderr, never a traceback.

A subcommand is a ``Command`` in ``COMMANDS``: its name, help, a function adding its
options and a function running it. Add one by appending to that list.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from equeue import __version__, groupcli
from equeue.errors import (
    CorruptionError,
    EQueueError,
    NotAStoreError,
    StoreLockedError,
    UsageError,
)
from equeue.inspect.follow import POLL_SECONDS, Follower
from equeue.inspect.layout import open_store
from equeue.inspect.records import (
    Filters,
    Record,
    RecordSource,
    check_queue,
    parse_position,
    parse_time,
)
from equeue.inspect.render import (
    ProgressBar,
    fill,
    human_size,
    is_terminal,
    render_file,
    render_problems,
    render_record,
    render_store,
)
from equeue.inspect.summary import summarize_file, summarize_store
from equeue.inspect.verify import Verifier
from equeue.server import cli as server_cli  # argparse only: no asyncio until run
from equeue.store.meta import IDENTITY_FILE
from equeue.store.topicsrebuild import rebuild_topics

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_USAGE = 2
# A progress line on stderr (a terminal only) once a run has taken this long, in seconds:
# a quick run stays one screen of output.
PROGRESS_DELAY = 1.0


@dataclass(frozen=True)
class Command:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def _print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, sort_keys=False))


def _plural(n: int, noun: str, nouns: str | None = None, *, none: str | None = None) -> str:
    if n == 0 and none is not None:
        return none
    return f"{n} {noun}" if n == 1 else f"{n} {nouns or noun + 's'}"


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


# --- inspect -------------------------------------------------------------------------


def _configure_inspect(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", type=Path, metavar="STORE|FILE", help="a store or a chunk file")


def _run_inspect(args: argparse.Namespace) -> int:
    path: Path = args.path
    if path.is_dir():
        bar = ProgressBar(sys.stderr, "inspecting", noun="queues", delay=PROGRESS_DELAY)
        try:
            summary = summarize_store(path, bar)
        finally:
            bar.close()
        if args.json:
            _print_json(summary.to_json())
        else:
            print(render_store(summary, wrap=is_terminal(sys.stdout)))
        return EXIT_OK
    if not path.exists():
        raise UsageError(f"{path}: no such file or directory")
    file_summary = summarize_file(path)
    if args.json:
        _print_json(file_summary.to_json())
    else:
        print(render_file(file_summary, wrap=is_terminal(sys.stdout)))
    return EXIT_OK


# --- records -------------------------------------------------------------------------


def _configure_records(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", type=Path, metavar="STORE")
    start = parser.add_argument_group("where to start (default: the start of the log)")
    start.add_argument(
        "--from",
        dest="start",
        metavar="POSITION",
        help="a log position (decimal or 0x hex) or a message id",
    )
    start.add_argument("--topic", metavar="T", help="only this topic (alone: a filter)")
    start.add_argument("--queue", type=_count, metavar="Q", help="read queue Q of --topic")
    start.add_argument("--offset", type=_count, metavar="N", help="from queue offset N")
    filters = parser.add_argument_group("filters")
    filters.add_argument("--limit", type=_count, metavar="N", help="at most N records")
    filters.add_argument("--key", metavar="K", help="only messages with key K")
    filters.add_argument(
        "--since",
        metavar="TIME",
        help="stored at or after TIME (ISO-8601 with a zone, or unix seconds)",
    )
    filters.add_argument(
        "--tag",
        action="append",
        metavar="TAG",
        help="only messages with tag TAG (repeat for any of several; '' for untagged)",
    )
    parser.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="then keep printing new messages as they are written, until Ctrl-C "
        f"(polls every {POLL_SECONDS:g} s)",
    )


def _run_records(args: argparse.Namespace) -> int:
    if args.queue is None and args.offset is not None:
        raise UsageError("--offset needs --topic T --queue Q")
    if args.queue is not None and args.topic is None:
        raise UsageError("--queue needs --topic")
    if args.start is not None and args.queue is not None:
        raise UsageError("--from and --queue/--offset are two ways to start; give one")
    store = open_store(args.store)
    since = parse_time(args.since) if args.since is not None else None
    tags = frozenset(args.tag) if args.tag is not None else None
    start = parse_position(args.start, store) if args.start is not None else 0
    if args.queue is not None:
        check_queue(store, args.topic, args.queue)
    # A topic the store never had is a misspelling, not an empty topic. (A deleted topic's
    # records stay in the log until retention: shown. --follow may wait for a topic yet to
    # be made.)
    elif (
        args.topic is not None
        and not args.follow
        and args.topic not in store.topics
        and args.topic not in store.deleted
    ):
        check_queue(store, args.topic, 0)  # "no topic 'x' in STORE (topics: ...)"
    # The follower first: it takes each queue's end now, and the walk below then reaches
    # at least as far (see Follower).
    follower = None
    if args.follow:
        follower = Follower(
            args.store, args.topic, args.queue, args.offset or 0, skipped=_report_skipped
        )
    source = RecordSource(store)
    shown = 0

    def show(records: Iterator[Record]) -> bool:
        """Print ``records``; False as soon as --limit is reached (a follower would
        otherwise wait for one more message before noticing)."""
        nonlocal shown
        if args.limit is not None and shown >= args.limit:
            return False
        for record in records:
            if args.json:
                print(json.dumps(record.to_json()), flush=True)
            else:
                print(("\n" if shown else "") + render_record(record), flush=True)
            shown += 1
            if args.limit is not None and shown >= args.limit:
                return False
        return True

    try:
        if args.queue is not None:
            filters = Filters(key=args.key, since_ns=since, tags=tags)
            more = show(source.from_queue(args.topic, args.queue, args.offset or 0, filters))
        else:
            filters = Filters(args.topic, args.key, since, tags)
            more = show(source.from_position(start, filters))
        if follower is not None and more:
            show(follower.records(max(source.walked, start - 1), filters))
    except KeyboardInterrupt:
        if follower is None:
            raise
        return EXIT_OK  # how --follow is meant to end
    finally:
        source.close()
        if follower is not None:
            follower.close()
    if not shown and not args.json:
        print("no records", file=sys.stderr)
    return EXIT_OK


def _report_skipped(topic: str, queue_id: int, first: int, end: int) -> None:
    """A follower's gap, on stderr beside the records (stdout stays records only)."""
    span = f"offset {first} was" if end == first + 1 else f"offsets {first}..{end - 1} were"
    print(
        f"equeue: {topic}/{queue_id} {span} removed (retention or compaction) before being printed",
        file=sys.stderr,
        flush=True,
    )


# --- verify --------------------------------------------------------------------------


def _configure_verify(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", type=Path, metavar="STORE")


def _run_rebuild_topics(args: argparse.Namespace) -> int:
    report = rebuild_topics(args.store)
    if args.json:
        _print_json(report.to_json())
        return EXIT_OK
    if report.damage is None:
        print(f"{report.journal} is sound: nothing changed")
        return EXIT_OK
    print(f"{report.journal}: {report.damage}")
    print(f"  copied whole ({report.journal_bytes} bytes) to {report.side_file}")
    print(f"  records read from offset {report.records_from}: {len(report.replayed)} replayed")
    for r in report.replayed:
        print(f"    at {r.offset}: {r.topic!r} {r.effect}")
    for s in report.skipped:
        print(f"  not replayed: {s.length} bytes at offset {s.offset} (0x{s.offset:x}): {s.reason}")
    print(
        f"topics.json and a fresh journal written (generation {report.generation}, "
        f"{_plural(report.topics, 'topic')}); the next writable open adds, with default "
        "policies, any topic whose queue directories hold chunks and that has no entry"
    )
    return EXIT_OK


def _run_verify(args: argparse.Namespace) -> int:
    bar = ProgressBar(sys.stderr, "verifying", delay=PROGRESS_DELAY)
    verifier = Verifier(args.store, bar)
    try:
        problems = verifier.run()
    finally:
        bar.close()
    if args.json:
        _print_json(
            {
                "store": str(args.store),
                "clean": not problems,
                "message_chunks": verifier.message_chunks,
                "records": verifier.records,
                "queue_chunks": verifier.queue_chunks,
                "queue_entries": verifier.queue_entries,
                "bytes": verifier.bytes_read,
                "problems": [p.to_json() for p in problems],
            }
        )
    else:
        wrap = is_terminal(sys.stdout)
        for line in render_problems(problems, wrap=wrap):
            print(line)
        if problems:
            print()
        checked = (
            f"Checked {_plural(verifier.records, 'record')} in "
            f"{_plural(verifier.message_chunks, 'message chunk')} and "
            f"{_plural(verifier.queue_entries, 'queue entry', 'queue entries')} in "
            f"{_plural(verifier.queue_chunks, 'queue chunk')} "
            f"({human_size(verifier.bytes_read)})."
        )
        print(fill(checked, wrap=wrap))
        found = _plural(len(problems), "problem", none="No problems")
        print(f"{found} found.")
    return EXIT_PROBLEMS if problems else EXIT_OK


# --- compact -------------------------------------------------------------------------


def _configure_compact(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", type=Path, metavar="STORE")
    parser.add_argument(
        "--master",
        metavar="URL",
        help="Spark master (default: what spark-submit set, else local[*])",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="decide and print the plan; change nothing"
    )
    parser.add_argument(
        "--now",
        metavar="TIME",
        help="measure retention and tombstone expiry from TIME (ISO-8601 with a zone, or "
        "unix seconds)",
    )
    parser.add_argument(
        "--no-merge", action="store_true", help="one replacement per chunk, never merged"
    )
    parser.add_argument(
        "--verbose", action="store_true", help="show Spark's own log and the JVM's warnings"
    )
    parser.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Spark setting for the job's session, as spark-submit's --conf (repeatable)",
    )
    parser.add_argument(
        "--py-files",
        action="append",
        default=[],
        metavar="FILES",
        help="comma-separated .py, .zip or .egg files added to the executors' Python path "
        "(repeatable)",
    )
    parser.add_argument(
        "--ship-equeue",
        action="store_true",
        help="zip this equeue package and add it to the executors' Python path, for nodes "
        "without equeue installed. The C accelerator cannot load from a zip: executors then "
        "run the pure-Python paths, and the zip hides an equeue installed on the nodes",
    )


def _spark_conf(pairs: list[str]) -> dict[str, str]:
    config = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"--conf {pair!r}: expected KEY=VALUE, e.g. spark.executor.memory=4g")
        config[key.strip()] = value
    return config


def _run_compact(args: argparse.Namespace) -> int:
    from equeue.compaction.job import compact
    from equeue.spark.java import require_spark

    if not (args.store / IDENTITY_FILE).exists():
        raise NotAStoreError(f"{args.store} is not an equeue store (no store.json)")
    now = parse_time(args.now) / 1e9 if args.now is not None else None
    config = _spark_conf(args.conf)
    py_files = [f for files in args.py_files for f in files.split(",") if f]
    for file in py_files:
        if not os.path.isfile(file):
            raise UsageError(f"--py-files: {file} is not a file")
    require_spark()  # before any work: without Java, one line and nothing done

    def progress(line: str) -> None:
        print(f"[compact] {line}", file=sys.stderr, flush=True)

    report = compact(
        args.store,
        master=args.master,
        now=now,
        dry_run=args.dry_run,
        merge=not args.no_merge,
        progress=progress,
        quiet=not args.verbose,
        config=config,
        py_files=py_files,
        ship_equeue=args.ship_equeue,
    )
    if args.json:
        _print_json(report.as_dict())
        return EXIT_OK
    verb = "would rewrite" if report.dry_run else "rewrote"
    for group in report.groups:
        chunks = (
            f"chunk {group.start_number}"
            if group.start_number == group.end_number
            else f"chunks {group.start_number}..{group.end_number}"
        )
        print(
            f"{group.file_name}  {chunks:<16} {human_size(group.bytes_before):>10} -> "
            f"{human_size(group.bytes_after):>10}  kept {group.records_kept}, "
            f"removed {group.records_removed}"
        )
    if report.retention_removed:
        from equeue.compaction.commit import file_names

        names = [r.file_name for r in report.dropped]
        print(
            f"Retention removed {file_names(report.retention_removed)} while the job ran"
            + (f": {file_names(names, 'replacement')} not installed." if names else ".")
        )
    if not report.groups:
        if not report.dropped:
            print(f"Nothing to compact ({report.chunks_eligible} eligible chunks).")
        return EXIT_OK
    summary = (
        f"{'Dry run: ' if report.dry_run else ''}{verb} "
        f"{_plural(report.chunks_rewritten, 'chunk')} into "
        f"{_plural(len(report.groups), 'file')}: {human_size(report.bytes_before)} -> "
        f"{human_size(report.bytes_after)}, {report.records_kept} messages kept, "
        f"{report.records_removed} removed, in {report.seconds:.1f} s."
    )
    print(fill(summary, wrap=is_terminal(sys.stdout)))
    return EXIT_OK


COMMANDS: list[Command] = [
    Command(
        "inspect",
        "summarise a store, or show every field of one chunk file",
        _configure_inspect,
        _run_inspect,
    ),
    Command(
        "records",
        "print decoded messages (JSON lines with --json)",
        _configure_records,
        _run_records,
    ),
    Command(
        "verify",
        "check every checksum, record and queue entry; exit 1 if anything is wrong",
        _configure_verify,
        _run_verify,
    ),
    Command(
        "rebuild-topics",
        "rebuild topics.json and a damaged topics.journal from the records that check out "
        "(no writer may run; the old journal is kept in recovered/)",
        _configure_verify,
        _run_rebuild_topics,
    ),
    Command(
        "compact",
        "rewrite completed chunks without the messages the topics' cleanup policy removes (Spark)",
        _configure_compact,
        _run_compact,
    ),
    Command(
        "delete-group",
        "delete a consumer group: its committed offsets and retry topic (no writer may run: "
        "a broker deletes it with the op delete_group)",
        groupcli.configure,
        groupcli.run,
    ),
    Command(
        "serve",
        "run the broker: clients in other processes send and pull over a socket",
        server_cli.configure,
        server_cli.run,
    ),
]


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but its usage errors come to main() (as _ArgumentError), which
    prints them as it prints every error: JSON with --json."""

    def error(self, message: str) -> NoReturn:
        raise _ArgumentError(self, message)


class _ArgumentError(Exception):
    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser


def build_parser(commands: Sequence[Command] = COMMANDS) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="equeue",
        description="Look inside an equeue store (read-only: safe beside a running writer), "
        "and compact it.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    # --json on every subcommand, so it may follow the command like its other options.
    common = _Parser(add_help=False)
    common.add_argument(
        "--json", action="store_true", help="machine-readable output (errors too, on stderr)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in commands:
        child = sub.add_parser(
            command.name, help=command.help, description=command.help, parents=[common]
        )
        command.configure(child)
        child.set_defaults(run=command.run, parser=child)
    return parser


def _error(message: str, path: str | None, as_json: bool) -> None:
    """One line on stderr; with --json a JSON object, so that stdout holds only results."""
    if as_json:
        print(json.dumps({"error": message, "path": path}), file=sys.stderr)
    else:
        print(f"equeue: error: {message}", file=sys.stderr)


def _path_of(exc: BaseException, args: argparse.Namespace) -> str | None:
    """The file an error names, else the store or file the command was given."""
    found = getattr(exc, "file", None)  # CorruptionError, CompactionError
    if found is None and isinstance(exc, OSError):
        found = exc.filename
    if found is None:
        found = getattr(args, "store", None) or getattr(args, "path", None)
    return None if found is None else os.fsdecode(found)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra:  # reported with the subcommand's usage, not the top-level one
            (args.parser if args.command else parser).error(
                "unrecognized arguments: " + " ".join(extra)
            )
    except SystemExit as exc:  # --help or --version has been printed
        return exc.code if isinstance(exc.code, int) else EXIT_OK
    except _ArgumentError as exc:
        if not as_json:
            exc.parser.print_usage(sys.stderr)
        _error(str(exc), None, as_json)
        return EXIT_USAGE
    if args.command is None:
        if not as_json:
            parser.print_usage(sys.stderr)
        _error("a command is required: " + ", ".join(c.name for c in COMMANDS), None, as_json)
        return EXIT_USAGE
    try:
        code: int = args.run(args)
        return code
    except (UsageError, NotAStoreError) as exc:
        _error(str(exc), _path_of(exc, args), as_json)
        return EXIT_USAGE
    except CorruptionError as exc:
        message = str(exc)
        if args.command != "verify":
            message += " (run 'equeue verify STORE' to list every problem)"
        _error(message, _path_of(exc, args), as_json)
        return EXIT_PROBLEMS
    except StoreLockedError as exc:
        _error(exc.command_line_advice(args.command), _path_of(exc, args), as_json)
        return EXIT_PROBLEMS
    except BrokenPipeError:
        # The reader went away (`equeue records STORE | head`): stop quietly, and keep
        # Python from complaining again when it flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_PROBLEMS
    except (EQueueError, OSError) as exc:
        _error(str(exc), _path_of(exc, args), as_json)
        return EXIT_PROBLEMS
    except KeyboardInterrupt:
        _error("interrupted", None, as_json)
        return 130


if __name__ == "__main__":
    sys.exit(main())
