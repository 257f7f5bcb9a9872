"""The chunk maker as a slow, shared disk makes it (not a test module): with
EQUEUE_TEST_SLOW_MAKER=MS set, conftest.py has each file made ahead (equeue/chunks/ahead.py)
take up to MS milliseconds more, a seeded random sleep before and after it is made, in the
test process (not its child processes). A test that reads a live store's files without
settling the maker (store_helpers.settle_chunk_maker; snapshot and tree do) meets the
maker at work there: at 20, test_batch_bodies' rejected-batch snapshot failed 3 of 3 before
it settled. The suite itself runs without it."""

from __future__ import annotations

import os
import random
import time
from typing import Any

SLOW_MAKER_ENV = "EQUEUE_TEST_SLOW_MAKER"
MAKE = "make_ahead_file"  # the maker's job calls it by the manager module's name


def install_from_environment() -> None:
    setting = os.environ.get(SLOW_MAKER_ENV, "")
    if setting:
        install(float(setting) / 1000)


def install(most: float, seed: int = 17) -> None:
    """Every later make_ahead_file sleeps up to ``most`` seconds before, and again after.
    (equeue imported here: a run without the setting imports nothing of it early.)"""
    import equeue.chunks.manager

    real = getattr(equeue.chunks.manager, MAKE)
    draw = random.Random(seed)

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(draw.uniform(0, most))
        made = real(*args, **kwargs)
        time.sleep(draw.uniform(0, most))
        return made

    setattr(equeue.chunks.manager, MAKE, slow)
