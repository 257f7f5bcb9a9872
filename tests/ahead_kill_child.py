"""The writer tests/test_chunk_ahead.py SIGKILLs at a step of making the next log chunk
ahead (equeue/chunks/ahead.py).

    python tests/ahead_kill_child.py STORE_DIR STEP [hold]

It opens STORE_DIR (flush="sync", 4 KiB log chunks: a roll-over every ~12 sends) and
sends message ``seq`` = 0, 1, 2, ... to topic ``t``, printing ``A <seq> <position>`` once
each send returned (acknowledged, durable). At STEP it prints ``STEP <step>`` once:

* ``creating``: the made-ahead file exists under its temporary name, nothing in it yet;
  the chunk maker stays there (later roll-overs make their chunks on the writer's thread);
* ``ready``: a file made ahead is in place for the next roll-over (the maker goes on);
* ``installed``: a made-ahead file was renamed to the new chunk's name and the maker
  stays before the directory's fsync (the writer's flushes must do it themselves).

With ``hold`` the sends stop once the step is reached (the one in progress ends), so a
kill finds the step's state, not a later roll-over's. It runs until it is killed, or for
at most 60 s.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import equeue.chunks.ahead
import equeue.chunks.manager
from equeue import MessageStore, StoreConfig
from equeue.chunks.chunk import Chunk
from equeue.chunks.manager import ChunkManager
from equeue.format.chunk import ChunkHeader

STEPS = ("creating", "ready", "installed")
_said = threading.Lock()


def config() -> StoreConfig:
    return StoreConfig(flush="sync", chunk_data_size=4096, default_queue_count=1)


def body(seq: int) -> bytes:
    return b"%08d" % seq * 40


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def say_step_once(step: str) -> None:
    if _said.acquire(blocking=False):
        say(f"STEP {step}")


def arm(step: str) -> None:
    if step == "creating":

        def allocate(fd: int, offset: int, length: int) -> bool:
            say_step_once(step)
            time.sleep(3600)
            return False

        vars(equeue.chunks.ahead)["_allocate"] = allocate  # make_ahead_file looks it up
    elif step == "ready":
        make = ChunkManager._make_ahead

        def made(self: ChunkManager, header: ChunkHeader) -> None:
            make(self, header)
            if self._ahead is not None:
                say_step_once(step)

        ChunkManager._make_ahead = made  # type: ignore[method-assign]
    elif step == "installed":

        def stay(chunk: Chunk) -> None:
            say_step_once(step)
            time.sleep(3600)

        equeue.chunks.manager._name_durable = stay
    else:
        raise SystemExit(f"unknown step {step!r}; one of {', '.join(STEPS)}")


def main() -> int:
    path, step = Path(sys.argv[1]), sys.argv[2]
    hold = sys.argv[3:] == ["hold"]
    arm(step)
    store = MessageStore.open(path, config())
    if "t" not in store.topics():
        store.create_topic("t", 1)
    end = time.monotonic() + 60
    seq = 0
    while time.monotonic() < end:
        if hold and _said.locked():
            time.sleep(0.01)
            continue
        result = store.send("t", body(seq))
        say(f"A {seq} {result.position}")
        seq += 1
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
