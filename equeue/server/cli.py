"""``equeue serve STORE``: run the broker in the foreground (docs/broker.md)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from equeue.protocol.frames import (
    DEFAULT_MAX_BATCH_MESSAGES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_FRAME_BYTES,
    DEFAULT_MAX_IN_FLIGHT,
    DEFAULT_MAX_PULL_COUNT,
)
from equeue.server.config import (
    DEFAULT_GROUP_COMMIT_WAIT_US,
    DEFAULT_MAX_GROUPS,
    DEFAULT_MAX_HELD_FILTER_BYTES,
    DEFAULT_MAX_HELD_PULLS,
    DEFAULT_MAX_TOPICS,
    DEFAULT_STATS_MAX_LISTED,
    EVENT_LOOPS,
    MAX_BUSY_POLL_US,
    SOCKET_NAME,
    ServerConfig,
    parse_duration,
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", help="the store directory (created if missing)")
    parser.add_argument(
        "--listen", action="append", default=[], metavar="URL",
        help=f"unix:PATH, tcp://HOST:PORT or tls://HOST:PORT; repeatable (default: "
        f"unix:STORE/{SOCKET_NAME})",
    )  # fmt: skip
    parser.add_argument(
        "--flush", choices=("sync", "async", "os"), default="async",
        help="sync: answer a send once an fdatasync covers it (shared by every client); "
        "async (default): at once, the store flushing in the background; os: at once, "
        "never flushing by itself",
    )  # fmt: skip
    parser.add_argument(
        "--group-commit-wait-us", type=int, default=None, metavar="US",
        help="--flush sync: the most an fdatasync waits for the sends the previous one's "
        "answers should bring back from several connections, so one covers more (0: never; "
        f"default {DEFAULT_GROUP_COMMIT_WAIT_US} under --flush sync); risks latency, never "
        "durability",
    )  # fmt: skip
    parser.add_argument(
        "--group-commit-overlap", type=int, default=0, metavar="N",
        help="--flush sync: where a round of sends takes more than N fdatasyncs, start the "
        "next one before the round's last sends are back (0, the default: never); risks "
        "latency for those sends, never durability",
    )  # fmt: skip
    parser.add_argument(
        "--busy-poll-us", type=int, default=0, metavar="US",
        help="--flush sync: after a flush's answers are written, keep the event loop polling "
        "(no sleep) until US µs pass with no request, and while a flush is in progress "
        f"(0, the default: never; at most {MAX_BUSY_POLL_US}); costs CPU while it polls, "
        "never durability",
    )  # fmt: skip
    parser.add_argument(
        "--shm", action="store_true",
        help="unix: clients that ask (equeue.aio.connect(url, shm=True)) get shared-memory "
        "rings instead of socket reads and writes (4 KiB + 2 x --shm-ring-bytes of memory "
        "a connection; docs/protocol.md)",
    )  # fmt: skip
    parser.add_argument(
        "--shm-ring-bytes", type=int, default=1 << 18, metavar="BYTES",
        help="--shm: each ring's size, a power of two >= 4096 (default 256 KiB)",
    )  # fmt: skip
    parser.add_argument("--token-file", help="clients must send the token in this file")
    parser.add_argument("--tls-cert", help="certificate (PEM) for tls:// listeners")
    parser.add_argument("--tls-key", help="private key (PEM) for tls:// listeners")
    parser.add_argument("--max-frame-bytes", type=int, default=DEFAULT_MAX_FRAME_BYTES)
    parser.add_argument("--max-in-flight", type=int, default=DEFAULT_MAX_IN_FLIGHT)
    parser.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS)
    parser.add_argument("--max-batch-messages", type=int, default=DEFAULT_MAX_BATCH_MESSAGES)
    parser.add_argument("--max-pull-count", type=int, default=DEFAULT_MAX_PULL_COUNT)
    parser.add_argument("--hello-timeout-ms", type=int, default=10_000)
    parser.add_argument(
        "--max-groups", type=int, default=DEFAULT_MAX_GROUPS,
        help="consumer groups ever joined (each keeps a retry topic); a join of another "
        "is refused",
    )  # fmt: skip
    parser.add_argument(
        "--max-topics", type=int, default=DEFAULT_MAX_TOPICS,
        help="topics clients may create (create_topic, a first send); the broker's own "
        "equeue.* topics are not counted",
    )  # fmt: skip
    parser.add_argument("--max-partial-frame-bytes", type=int, default=512 * 1024 * 1024)
    parser.add_argument(
        "--max-held-pulls", type=int, default=DEFAULT_MAX_HELD_PULLS, metavar="N",
        help="long-poll pulls held at once over every connection; past it a pull with a "
        "wait is answered empty at the next 100 ms tick, as one without (0: none held)",
    )  # fmt: skip
    parser.add_argument(
        "--max-held-filter-bytes", type=int, default=DEFAULT_MAX_HELD_FILTER_BYTES, metavar="N",
        help="tag filters one connection's held pulls keep (each distinct filter once: its "
        "tags' bytes + 80 a tag); past it a pull with a new filter is answered empty at "
        "the next tick",
    )  # fmt: skip
    parser.add_argument(
        "--stats-max-listed", type=int, default=DEFAULT_STATS_MAX_LISTED, metavar="N",
        help="groups (the most lag first), live groups and connections one stats answer "
        "lists; the others are counted",
    )  # fmt: skip
    parser.add_argument(
        "--retention", metavar="DURATION",
        help="remove whole log chunks whose newest message is older than this (90s, 15m, "
        "2h, 7d; no unit: seconds), after each of the store's checkpoints (every 10 s); "
        "default: keep every message",
    )  # fmt: skip
    parser.add_argument(
        "--max-store-bytes", type=int, default=None, metavar="N",
        help="remove the oldest log chunks while the store is over N bytes (each log chunk "
        "counted at its full size); default: no limit",
    )  # fmt: skip
    parser.add_argument(
        "--retention-respects-consumers", action="store_true",
        help="with --retention or --max-store-bytes: remove a chunk only once every "
        "consumer group committed past it",
    )  # fmt: skip
    parser.add_argument(
        "--insecure-token", action="store_true",
        help="allow a token over plain tcp:// off loopback (it crosses the network in "
        "clear: anyone on the path can read and replay it); prefer tls://",
    )  # fmt: skip
    parser.add_argument(
        "--status", action="store_true",
        help="print the stats of the broker serving STORE (or at the first --listen; "
        "--token-file, and --tls-cert as the certificate to trust) and exit",
    )  # fmt: skip
    parser.add_argument(
        "--status-group", metavar="GROUP",
        help="with --status: that consumer group's lag per queue, members and assignment",
    )  # fmt: skip
    parser.add_argument(
        "--event-loop", choices=EVENT_LOOPS, default="auto",
        help="uvloop (auto: where it is installed) or asyncio's own loop",
    )  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="log warnings and errors only")


def run(args: argparse.Namespace) -> int:
    if args.status:
        return status(args)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s equeue serve: %(message)s",
        stream=sys.stderr,
    )
    config = ServerConfig(
        listen=tuple(args.listen), flush=args.flush, token_file=args.token_file,
        tls_cert=args.tls_cert, tls_key=args.tls_key, max_frame_bytes=args.max_frame_bytes,
        max_in_flight=args.max_in_flight, max_connections=args.max_connections,
        max_batch_messages=args.max_batch_messages, max_pull_count=args.max_pull_count,
        hello_timeout_ms=args.hello_timeout_ms, max_groups=args.max_groups,
        max_topics=args.max_topics,
        max_partial_frame_bytes=args.max_partial_frame_bytes, insecure_token=args.insecure_token,
        max_held_pulls=args.max_held_pulls, max_held_filter_bytes=args.max_held_filter_bytes,
        stats_max_listed=args.stats_max_listed,
        event_loop=args.event_loop, group_commit_wait_us=args.group_commit_wait_us,
        group_commit_overlap=args.group_commit_overlap, busy_poll_us=args.busy_poll_us,
        shm=args.shm, shm_ring_bytes=args.shm_ring_bytes,
        retention=None if args.retention is None else parse_duration(args.retention, "--retention"),
        max_store_bytes=args.max_store_bytes,
        retention_respects_consumers=args.retention_respects_consumers,
    )  # fmt: skip
    from equeue.server.serve import serve

    def ready(urls: list[str]) -> None:
        # Process-wide malloc settings: here, in a process equeue owns, never in the
        # library; once listening, so that a refused start's one error line (JSON with
        # --json) is all it writes (review 38e E9: its log line came first)
        from equeue.server.heap import keep_heap

        keep_heap()
        for url in urls:
            print(f"listening on {url}", flush=True)

    serve(args.store, config, ready=ready)
    return 0


def status(args: argparse.Namespace) -> int:
    from equeue.server.status import fetch_stats, render_stats

    stats: dict[str, Any] = fetch_stats(
        args.store, args.listen, args.token_file, args.tls_cert, args.status_group
    )
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        print(render_stats(stats, args.status_group))
    return 0
