"""The broker's periodic jobs (the group coordinator's tick, the held pulls' poll, the
stats sample), each in its own ``try``: one failing does not stop the others. A job
that fails tick after tick is logged with its traceback when it starts failing, then
once a minute with the count, and once when it works again (not ten tracebacks a second).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

REPEAT_S: Final = 60.0


@dataclass
class _Failing:
    said: float  # clock() when it was last logged
    times: int = 1  # failures since it started failing


class PeriodicJobs:
    def __init__(self, log: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self._log = log
        self._clock = clock
        self._failing: dict[str, _Failing] = {}

    def run(self, name: str, job: Callable[[], object]) -> None:
        try:
            job()
        except Exception:
            self._failed(name)
        else:
            failing = self._failing.pop(name, None)
            if failing is not None:
                self._log.warning(
                    "the broker's periodic %s works again after %d failed runs", name, failing.times
                )

    def _failed(self, name: str) -> None:
        now = self._clock()
        failing = self._failing.get(name)
        if failing is None:
            self._failing[name] = _Failing(now)
            self._log.exception(
                "the broker's periodic %s failed (it runs again every tick; while it keeps "
                "failing this is logged once a minute)", name,
            )  # fmt: skip
            return
        failing.times += 1
        if now - failing.said >= REPEAT_S:
            failing.said = now
            self._log.exception(
                "the broker's periodic %s failed again (%d runs failed so far)", name, failing.times
            )
