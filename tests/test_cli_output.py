"""What the ``equeue`` command prints around its results: ``--version``, errors under
``--json``, and sentences wrapped for a terminal only (a real pty), never in a pipe."""

from __future__ import annotations

import json
import os
import pty
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_cli import build_store, flip, frame_offsets, message_chunks, patch

import equeue
from equeue.cli import main
from equeue.inspect.render import WIDTH


def equeue_command(*args: str | Path, terminal: bool = False) -> tuple[int, str, str]:
    """``python -m equeue ARGS``: (status, stdout, stderr); stdout a pipe, or a pty."""
    command = [sys.executable, "-m", "equeue", *map(str, args)]
    if not terminal:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        return done.returncode, done.stdout, done.stderr
    leader, follower = pty.openpty()
    with subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=follower, stderr=subprocess.PIPE
    ) as process:
        os.close(follower)
        out = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: the command has closed the terminal
                break
            if not chunk:
                break
            out += chunk
        os.close(leader)
        assert process.stderr is not None
        err = process.stderr.read().decode()
        code = process.wait(timeout=120)
    return code, out.decode().replace("\r\n", "\n"), err


@pytest.fixture
def torn(tmp_path: Path) -> Path:
    """A store whose ongoing chunk ends in a torn frame (verify says a long sentence)."""
    path = tmp_path / "store"
    build_store(path)
    chunk = message_chunks(path)[-1]
    patch(chunk, frame_offsets(chunk)[1], struct.pack("<I", 200) + b"torn" * 10)
    return path


def test_version() -> None:
    code, out, err = equeue_command("--version")
    assert (code, out, err) == (0, f"equeue {equeue.__version__}\n", "")


def test_sentences_are_whole_in_a_pipe_and_wrapped_on_a_terminal(torn: Path) -> None:
    code, out, err = equeue_command("verify", torn)
    assert (code, err) == (1, "")
    lines = out.splitlines()
    reason = next(line for line in lines if line.startswith("  torn tail: "))
    assert reason.endswith("which recovery would cut")  # the whole sentence, one line
    assert len(reason) > WIDTH
    checked = next(line for line in lines if line.startswith("Checked "))
    assert checked.endswith(" KiB).") and len(checked) > WIDTH
    # The control: on a terminal the same sentences are wrapped at 80 columns.
    code, shown, err = equeue_command("verify", torn, terminal=True)
    assert (code, err) == (1, "")
    assert all(len(line) <= WIDTH or str(torn) in line for line in shown.splitlines())
    assert " ".join(shown.split()) == " ".join(out.split())  # the same words


def run_json_error(capsys: pytest.CaptureFixture[str], *args: str | Path) -> tuple[int, Any]:
    code = main([*map(str, args), "--json"])
    out, err = capsys.readouterr()
    # stdout holds results only: the records read before the error, if any
    assert all("error" not in json.loads(line) for line in out.splitlines())
    assert err.count("\n") == 1, err  # one line: a JSON object
    return code, json.loads(err)


def test_json_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    store = tmp_path / "store"
    build_store(store)
    code, doc = run_json_error(capsys, "verify", tmp_path)
    assert code == 2
    assert doc == {"error": doc["error"], "path": str(tmp_path)}
    assert "is not an equeue store" in doc["error"]
    code, doc = run_json_error(capsys, "records", store, "--bogus")  # argparse's own
    assert (code, doc) == (2, {"error": "unrecognized arguments: --bogus", "path": None})
    code, doc = run_json_error(capsys, "records", store, "--limit", "x")
    assert code == 2 and "--limit" in doc["error"] and doc["path"] is None
    chunk = message_chunks(store)[1]
    flip(chunk, frame_offsets(chunk)[0][2] + 70)
    code, doc = run_json_error(capsys, "records", store)
    assert code == 1 and doc["path"] == str(chunk)
    assert "record checksum" in doc["error"] and "equeue verify" in doc["error"]
    # The control: without --json, the same errors are text, with the same statuses.
    assert main(["records", str(store)]) == 1
    assert main(["records", str(store), "--bogus"]) == 2
    _, err = capsys.readouterr()
    assert err.startswith("equeue: error: ") and "usage: equeue records" in err
    assert not any(line.startswith("{") for line in err.splitlines())
