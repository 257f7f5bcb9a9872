"""The broker's file descriptors against the process's limit (RLIMIT_NOFILE, review g F4).

Every connection holds one descriptor, the store up to ``StoreConfig.max_open_files``,
and the broker a few of its own. Past the limit an accept fails (the client gets a bare
reset, nothing says why) and so do the store's own opens (a send, a checkpoint): so the
broker raises its soft limit to the hard one at start, and refuses a ``max_connections``
that cannot fit beside the store's files.
"""

from __future__ import annotations

import logging
import resource

from equeue.errors import ConfigError

log = logging.getLogger("equeue.server")

# Beside connections and the store's files: stdio, the event loop's epoll and wakeup
# pipe, the flusher's and the offset committer's, a metadata file being replaced
# (its file and directory), logging, and 16 TLS refusals in their handshake
# (tlsaccept.MAX_REFUSALS_IN_HANDSHAKE), with room to spare.
BROKER_OWN_FILES = 64


def fit_open_files(max_connections: int, store_files: int, listeners: int) -> int:
    """The soft RLIMIT_NOFILE after raising it (to the hard limit, where it is below what
    the broker needs); ConfigError if ``max_connections`` cannot fit under it."""
    needed = max_connections + store_files + listeners + BROKER_OWN_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return needed if soft == resource.RLIM_INFINITY else soft
    # (an unlimited hard limit is refused as a soft one by Linux: ask for what is needed)
    target = needed if hard == resource.RLIM_INFINITY else hard
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    except (ValueError, OSError) as exc:  # (a hard limit above the kernel's nr_open)
        log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    if soft < needed:
        room = soft - store_files - listeners - BROKER_OWN_FILES
        raise ConfigError(
            f"max_connections={max_connections} (--max-connections) cannot fit in the "
            f"process's open-file limit RLIMIT_NOFILE={soft} (hard {hard}): with the store's "
            f"{store_files} (StoreConfig.max_open_files), {listeners} listener(s) and "
            f"{BROKER_OWN_FILES} of the broker's own it needs {needed}; lower "
            f"--max-connections to {max(room, 0)} or raise the limit (ulimit -n, systemd "
            "LimitNOFILE=)"
        )
    return soft
