"""The broker's file descriptors against the process's limit (RLIMIT_NOFILE, review g F4).

Every connection holds one descriptor (two with ``--shm``: see
SHM_DESCRIPTORS), the store up to ``StoreConfig.max_open_files``,
and the broker a few of its own. Past the limit an accept fails (the client gets a bare
reset, nothing says why) and so do the store's own opens (a send, a checkpoint): so the
broker raises its soft limit to the hard one at start; a ``max_connections`` that still
cannot fit beside the store's files is lowered to what fits if it is the default (1024,
given or not), else refused (``fit_open_files``).
"""

from __future__ import annotations

import logging
import resource

from equeue.errors import ConfigError

log = logging.getLogger("equeue.server")

# Beside connections and the store's files: stdio, the event loop's epoll and wakeup
# pipe, the flusher's and the offset committer's, a metadata file being replaced
# (its file and directory), logging, 16 TLS refusals in their handshake
# (tlsaccept.MAX_REFUSALS_IN_HANDSHAKE), and the status socket with its 2 connections
# (statussock.py), with room to spare.
BROKER_OWN_FILES = 64
# A connection on shared rings (equeue/server/shm.py) holds its socket and, when its hello
# names a ring group of its own (any name: the client chooses), that group's end of its
# wake-up socketpair; the region's memfd is closed once mapped (reviewshm F7: 127 such
# connections ran the store's chunk opens out of descriptors under a limit sized for one
# a connection).
SHM_DESCRIPTORS = 2


def fit_open_files(
    max_connections: int,
    store_files: int,
    listeners: int,
    *,
    default: bool = False,
    per_connection: int = 1,
) -> int:
    """The connections the broker may hold: ``max_connections``, after raising the soft
    RLIMIT_NOFILE to the hard limit where it is below what the broker needs. Where even
    that cannot hold them beside the store's files, the default (``default``: the
    operator asked for no number) is lowered to what fits, with a warning, so ``equeue
    serve`` starts where it did before this check (a container's 1024:1024, review4 R2);
    a number the operator asked for is a ConfigError, and so is a limit that leaves no
    room for one connection. ``per_connection``: the descriptors a connection may hold."""
    needed = max_connections * per_connection + store_files + listeners + BROKER_OWN_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return max_connections
    # (an unlimited hard limit is refused as a soft one by Linux: ask for what is needed)
    target = needed if hard == resource.RLIM_INFINITY else hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    except (ValueError, OSError) as exc:  # (a hard limit above the kernel's nr_open)
        log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    if soft >= needed:
        return max_connections
    room = (soft - store_files - listeners - BROKER_OWN_FILES) // per_connection
    beside = (
        f"the process's open-file limit RLIMIT_NOFILE={soft} (hard {hard}), beside the "
        f"store's {store_files} (StoreConfig.max_open_files), {listeners} listener(s) and "
        f"{BROKER_OWN_FILES} of the broker's own"
    )
    if per_connection > 1:
        beside += f", at {per_connection} a connection (--shm: a socket, a group's wake-up)"
    raise_it = "raise the limit (ulimit -n, systemd LimitNOFILE=)"
    if room < 1:
        raise ConfigError(
            f"{beside}, leaves no room for a connection: {raise_it} to at least "
            f"{needed - max_connections * per_connection + per_connection}"
        )
    if default:
        log.warning(
            "max_connections lowered from its default %d to %d: %s, holds no more; %s for "
            "more, or set --max-connections",
            max_connections, room, beside, raise_it,
        )  # fmt: skip
        return room
    raise ConfigError(
        f"max_connections={max_connections} (--max-connections) cannot fit in {beside} "
        f"(it needs {needed}): lower --max-connections to {room} or {raise_it}"
    )
