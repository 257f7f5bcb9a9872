"""``equeue serve STORE --status``: ask a running broker for its stats (with the sync
client) and print them."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import Any

from equeue.errors import AuthenticationError, BrokerError, NotAStoreError
from equeue.server.config import SOCKET_NAME, STATUS_SOCKET_NAME, read_token
from equeue.server.stats import render_retention
from equeue.store.meta import LOCK_FILE


def fetch_stats(
    store: str,
    listen: list[str],
    token_file: str | None,
    cafile: str | None = None,
    group: str | None = None,
) -> dict[str, Any]:
    """The ``stats`` answer of the broker at ``listen[0]``, else at STORE/broker.sock."""
    from equeue.client.sync import connect

    if not listen:  # the default socket: say what is there if it is no socket at all
        if not os.path.lexists(store):  # (else taken for a socket path: "cannot connect")
            raise NotAStoreError(
                f"no store or broker socket at {store}: --status takes the store directory "
                f"a broker serves (or its {SOCKET_NAME}), or --listen URL"
            )
        default = Path(store) / SOCKET_NAME
        if (default.exists() or default.is_symlink()) and not stat.S_ISSOCK(
            default.lstat().st_mode
        ):
            raise BrokerError(f"{default} is not a socket: no broker of this store listens there")
        if _lock_free(Path(store) / LOCK_FILE):
            raise BrokerError(
                f"no broker is serving {store}: its writer lock {Path(store) / LOCK_FILE} is "
                f"not held (a {SOCKET_NAME} there was left by a broker that stopped or was "
                "killed); start one with: equeue serve STORE"
            )
    token = read_token(token_file) if token_file else None
    options: dict[str, Any] = {"client_name": "equeue serve --status", "timeout": 10.0}
    options["connect_timeout"] = 1.0  # a broker that is not running: say so soon
    if cafile:
        options["cafile"] = cafile
    try:
        with connect(listen[0] if listen else _socket_of(store), token=token, **options) as client:
            stats = client.stats(group)
    except AuthenticationError as exc:  # the broker's words are a client's: add the option
        given = "the token in --token-file" if token_file else "no token"
        raise AuthenticationError(
            f"{exc} (--status gave {given}: give --token-file FILE, the broker's token file)"
        ) from None
    if not isinstance(stats, dict):
        raise BrokerError(f"the broker answered stats with a {type(stats).__name__}, not a map")
    return stats


def _socket_of(store: str) -> str:
    """STORE/status.sock where a broker listens there (since 2026-11-27: admitted past
    max_connections, statussock.py), else the store's default socket."""
    status = Path(store) / STATUS_SOCKET_NAME
    with contextlib.suppress(OSError):
        if stat.S_ISSOCK(status.lstat().st_mode):
            return f"unix:{status}"
    return store


def _lock_free(lock: Path) -> bool:
    """True only if the store's LOCK exists and no process holds a flock on it, as
    /proc/locks (Linux) lists them. Read, not tried: taking the lock, even shared and for
    a moment, could make a broker starting just then refuse the store. Anything unknown
    (no LOCK, no /proc/locks) is False: the connect then says what it finds."""
    try:
        inode = os.stat(lock).st_ino
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            table = f.read()
    except OSError:
        return False
    for line in table.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 4242 fd:01:1234567 0 EOF" ("->" marks a waiter)
        if "FLOCK" in fields:
            device_inode = fields[fields.index("FLOCK") + 4].rsplit(":", 1)
            if len(device_inode) == 2 and device_inode[1] == str(inode):
                return False
    return True


def render_stats(stats: dict[str, Any], group: str | None = None) -> str:
    """``group``: the one ``--status-group`` asked for, named even with nothing to show."""
    lines = [
        f"{key}: {stats[key]}" for key in sorted(stats) if not isinstance(stats[key], dict | list)
    ]
    lines.append(f"listen: {' '.join(stats.get('listen', []))}")
    if isinstance(stats.get("retention"), dict):  # (a broker before 2026-11-26 has none)
        lines.append(render_retention(stats["retention"]))
    for name, rate in sorted(stats.get("rates", {}).items()):
        lines.append(f"{name}: {rate}")
    for client in stats.get("clients", []):
        lines.append(
            f"{client['where']}: {client['in_flight']} in flight, "
            f"{client['buffered_bytes']} bytes buffered"
        )
    lines += _retry_and_retention(stats)
    lines += _groups(stats)
    listed = {*stats.get("groups", {}), *stats.get("coordinator", {})}
    if group is not None and group not in listed:
        lines.append(
            f"group {group}: no committed offset, no member, no skipped offset (deleted, or "
            "never committed)"
        )
    return "\n".join(lines)


def _groups(stats: dict[str, Any]) -> list[str]:
    """The groups of a summary (per group its totals) or of one group's detail (per queue,
    per member); a broker before protocol version 5 answers every group's detail."""
    lines = []
    live = stats.get("coordinator", {})
    for group, info in sorted(stats.get("groups", {}).items(), key=lambda g: (-g[1]["lag"], g[0])):
        if "queues" in info:
            lines.append(f"group {group}: lag {info['lag']}")
        else:
            skipped = info.get("skipped_count", 0)
            lines.append(
                f"group {group}: lag {info['lag']} over {info.get('queue_count')} queues"
                + (f", {skipped} removed by retention before consumed" if skipped else "")
            )
        lines += _members(live.get(group))
        for queue, lag in sorted(info.get("queues", {}).items()):
            lines.append(
                f"  {queue}: committed {lag['committed']} end {lag['end']} lag {lag['lag']}"
            )
        for queue, skipped in sorted(info.get("skipped", {}).items()):
            ranges = ", ".join(f"{start}..{end - 1}" for start, end in skipped["ranges"])
            lines.append(
                f"  {queue}: {skipped['count']} removed by retention before consumed "
                f"(offsets {ranges})"
            )
    for group in sorted(set(live) - set(stats.get("groups", {}))):  # members, no commit yet
        lines.append(f"group {group}: no committed offset")
        lines += _members(live[group])
    left = stats.get("groups_omitted", 0), stats.get("coordinator_omitted", 0)
    if any(left):
        lines.append(
            f"{left[0]} more groups and {left[1]} more groups with members not listed "
            "(those with the least lag; --stats-max-listed); one group's detail: "
            "--status-group GROUP"
        )
    return lines


def _members(live: dict[str, Any] | None) -> list[str]:
    if not live:
        return []
    lines = [f"  generation {live['generation']}, topics {', '.join(live['topics'])}"]
    if "members" not in live:  # a summary's
        lines[0] += f", {live.get('member_count')} members, {live.get('queue_count')} queues"
        return lines
    for member, detail in sorted(live["members"].items()):
        queues = " ".join(f"{t}/{q}" for t, q in detail["queues"]) or "-"
        lines.append(f"  member {member}: {queues}")
    return lines


def _retry_and_retention(stats: dict[str, Any]) -> list[str]:
    lines = []
    retry = stats.get("retry")
    if isinstance(retry, dict):
        lines.append(
            f"retries: {retry.get('moved')} moved, {retry.get('dead_lettered')} dead-lettered, "
            f"{retry.get('pending')} waiting, {retry.get('lost_to_retention')} lost to retention"
        )
    held = stats.get("retention_held")
    if isinstance(held, dict):
        over = held.get("max_store_bytes")
        by = (
            f"group {held.get('group')!r} at {held.get('queue')} offset {held.get('offset')}"
            if held.get("damaged") is None
            else f"an unreadable consumer group file ({held.get('damaged')})"
        )
        lines.append(
            f"retention held by {by} for {held.get('since_s')} s: log {held.get('log_bytes')} "
            f"bytes{f' (max_store_bytes {over})' if over is not None else ''}"
            f"{', past retention' if held.get('expired') else ''}"
        )
    return lines
