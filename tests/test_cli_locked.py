"""The `equeue` commands that write, on a store another handle writes (review17 R17-7):
one line naming the holder's pid and what a command-line user can do, never the API's
"open it with read_only=True or close the other handle"."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from equeue import MessageStore
from equeue.cli import main
from equeue.errors import StoreLockedError


@pytest.mark.parametrize(
    ("command", "more", "advice"),
    [
        ("rebuild-topics", [], "stop that process first"),
        ("serve", ["--quiet"], "the store is served already: connect to it"),
        ("delete-group", ["g"], "delete the group through the broker"),
    ],
)
def test_a_locked_store_is_refused_with_advice_for_a_command_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    command: str,
    more: list[str],
    advice: str,
) -> None:
    store = tmp_path / "store"
    with MessageStore.open(store) as writer:
        writer.create_topic("t", 1)
        writer.commit_offset("g", "t", 0, 0)
        args = [command, str(store), *more]
        before = sorted((p.name, p.stat().st_size) for p in store.iterdir() if p.is_file())
        if command == "serve":  # in a process of its own: serve sets up logging first
            done = subprocess.run(
                [sys.executable, "-m", "equeue", *args], capture_output=True, text=True, timeout=60
            )
            code, err = done.returncode, done.stderr.strip()
        else:
            code, err = main(args), capsys.readouterr().err.strip()
        assert code == 1
        assert len(err.splitlines()) == 1, err
        assert "is open for writing by pid" in err and advice in err, err
        assert "read_only=True" not in err, err
        after = sorted((p.name, p.stat().st_size) for p in store.iterdir() if p.is_file())
        assert after == before
    with MessageStore.open(store), pytest.raises(StoreLockedError, match=r"read_only=True"):
        MessageStore.open(store)  # the API's words stay
