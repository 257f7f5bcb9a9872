"""The ``code_path`` fixture: a test that uses it runs once on the C accelerator and
once on the pure-Python paths (not a test module)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from equeue import speedups


@pytest.fixture(params=["c", "python"])
def code_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "python":
        monkeypatch.setattr(speedups, "SPEEDUPS", None)
    elif speedups.SPEEDUPS is None:
        pytest.skip("the C accelerator is not built (or EQUEUE_PURE_PYTHON is set)")
    yield request.param
