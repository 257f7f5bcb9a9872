"""Where and on what a run ran: file system, Python build, source state, versions, load."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import sqlite3
import subprocess
import sysconfig
from pathlib import Path

from peers.scenarios import PEERS

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository


def file_system(path: Path) -> str:
    target = os.path.realpath(path)
    best: tuple[str, str, str] | None = None
    with contextlib.suppress(OSError), open("/proc/mounts", encoding="utf-8") as f:
        for line in f:
            parts = line.split()
            if len(parts) < 3:
                continue
            device, mount, fstype = parts[0], parts[1], parts[2]
            inside = target == mount or target.startswith(mount.rstrip("/") + "/")
            if inside and (best is None or len(mount) >= len(best[1])):
                best = (device, mount, fstype)
    return "unknown" if best is None else f"{best[2]} ({best[0]}) at {best[1]}"


def python_build() -> str:
    args = str(sysconfig.get_config_var("CONFIG_ARGS") or "")
    parts = [
        "PGO" if "--enable-optimizations" in args else "no PGO",
        "LTO" if "--with-lto" in args else "no LTO",
    ]
    return ", ".join(parts)


def source_state() -> str:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True, timeout=10
        ).stdout.rstrip("\n")

    try:
        commit = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--", "equeue").splitlines()
    except (OSError, subprocess.SubprocessError):
        return "not a git checkout"
    if not changed:
        return f"{commit}, equeue/ unmodified"
    return f"{commit} + uncommitted changes in {', '.join(sorted(c[3:] for c in changed))}"


def versions() -> dict[str, str]:
    found = {"sqlite3": f"SQLite {sqlite3.sqlite_version}"}
    for peer in PEERS:  # keyed by peer: the modes list names each peer's version
        if peer.dist:
            try:
                found[peer.key] = importlib.metadata.version(peer.dist)
            except importlib.metadata.PackageNotFoundError:
                found[peer.key] = "not installed"
    return found


def load_average() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:
        return (float("nan"),) * 3
