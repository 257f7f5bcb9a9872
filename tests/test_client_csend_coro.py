"""AsyncClient.send's C coroutine (equeue/cext/sendcoro.c) as introspection and re-entry see
it: re-entered while it runs (send/throw/close from the code it runs) it refuses as a
Python coroutine does, and never frees what runs; ``inspect.getcoroutinestate`` and
anyio's "has the task started" read it; weak references; ``iscoroutinefunction``; and
the accelerator builds and imports on Python 3.13 with setup.py's flags.

The re-entry cases run in a child process under ``-X dev`` (the debug allocator turns a
freed running coroutine into a crash, reported here as a failed test, not a dead suite);
the same file is that child's script (``python -X dev THIS CASE KIND``)."""

from __future__ import annotations

import ast
import asyncio
import gc
import inspect
import os
import shutil
import subprocess
import sys
import tempfile
import weakref
from pathlib import Path
from typing import Any

import pytest

import equeue.aio
from equeue import speedups
from equeue.client.aio import AsyncClient
from equeue.protocol.sendcoro import send_method

ROOT = Path(__file__).resolve().parent.parent
PY313 = Path("/root/.pyenv/versions/3.13.0/bin/python3.13")
needs_c = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="no C accelerator")
c_send: Any = AsyncClient.send
py_send: Any = getattr(c_send, "__wrapped__", c_send)


class _Unconnected:
    """A client with no connection: the C coroutine's first step delegates to the async
    def, which awaits ``_call``: code the SendCoro runs, which re-enters it."""

    _protocol = None
    url = "unix:/nowhere"

    def __init__(self, case: str, gate: asyncio.Event | None = None) -> None:
        self.case, self.gate = case, gate
        self.states: list[str] = []

    async def _call(self, call: Any) -> str:
        coro: Any = asyncio.current_task().get_coro()  # type: ignore[union-attr]
        if self.gate is not None:
            self.states.append(inspect.getcoroutinestate(coro))
            await self.gate.wait()
            return "done"
        print("cr_running", coro.cr_running, flush=True)
        try:
            if self.case == "send":
                coro.send(None)
            elif self.case == "throw":
                coro.throw(ValueError("thrown in"))
            else:
                coro.close()
        except ValueError as e:
            print("raised", type(e).__name__, e, flush=True)
        gc.collect()
        junk = [bytearray(64) for _ in range(10_000)]  # (reuses a freed frame's memory)
        await asyncio.sleep(0)
        del junk
        return "done"


def _reenter(case: str, kind: str) -> None:
    async def main() -> None:
        client = _Unconnected(case)
        coro = c_send(client, "t", b"b") if kind == "c" else py_send(client, "t", b"b")
        print("result", await asyncio.wait_for(asyncio.create_task(coro), 10), flush=True)

    asyncio.run(main())


@needs_c
@pytest.mark.parametrize("kind", ["c", "async def"])
@pytest.mark.parametrize("case", ["send", "throw", "close"])
def test_reentering_a_running_send_is_refused_as_a_python_coroutine_is(
    case: str, kind: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-X", "dev", __file__, case, kind[0]],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        "cr_running True",
        "raised ValueError coroutine already executing",
        "result done",
    ], done.stdout + done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr


class _Protocol:
    """A live connection with nothing in flight whose ``direct()`` answers the general way
    (a ``(status, payload)`` tuple), so the C coroutine calls ``answered`` with it."""

    closed = False
    pending = False

    def direct(self, topic: str, body: bytes) -> asyncio.Future[Any]:
        future = asyncio.get_running_loop().create_future()
        future.get_loop().call_soon(future.set_result, (0, "payload"))
        return future


class _Connected:
    _protocol = _Protocol()
    url = "unix:/fake"


@needs_c
def test_reentering_while_the_answer_is_decoded_is_refused() -> None:
    seen: list[Any] = []
    coros: list[Any] = []

    def answered(client: Any, answer: Any) -> str:
        seen.append((answer, coros[0].cr_running))
        try:
            coros[0].send(None)
        except ValueError as e:
            seen.append(str(e))
        return "decoded"

    async def main() -> None:
        send = send_method(py_send, answered, asyncio.coroutines._is_coroutine)  # type: ignore[misc,attr-defined]
        coros.append(send(_Connected(), "t", b"x"))
        assert await asyncio.wait_for(coros[0], 10) == "decoded"

    asyncio.run(main())
    assert seen == [((0, "payload"), True), "coroutine already executing"]


@needs_c
def test_getcoroutinestate_reads_it_at_every_state() -> None:
    async def main() -> None:
        gate = asyncio.Event()
        client = _Unconnected("", gate)
        coro = c_send(client, "t", b"b")
        assert (coro.cr_running, coro.cr_suspended, coro.cr_frame) == (False, False, None)
        # created: CLOSED, not CREATED (no frame: docs/client.md); neither is "started"
        assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED
        task = asyncio.create_task(coro)
        await asyncio.sleep(0)
        assert client.states == [inspect.CORO_RUNNING]  # (read from inside its step)
        assert inspect.getcoroutinestate(coro) == inspect.CORO_SUSPENDED
        assert coro.cr_suspended and not coro.cr_running
        gate.set()
        assert await asyncio.wait_for(task, 10) == "done"
        assert inspect.getcoroutinestate(coro) == inspect.CORO_CLOSED
        assert (coro.cr_running, coro.cr_suspended) == (False, False)

    asyncio.run(main())


def _anyio_task_started(task: asyncio.Task[Any]) -> bool:
    """anyio's asyncio backend (agronholm/anyio src/anyio/_backends/_asyncio.py,
    ``_task_started``), as written there: its cancel scopes call it for every task."""
    coro = task.get_coro()
    assert coro is not None
    try:
        return inspect.getcoroutinestate(coro) in (inspect.CORO_RUNNING, inspect.CORO_SUSPENDED)  # type: ignore[arg-type]
    except AttributeError:
        raise Exception(f"Cannot determine if task {task} has started or not") from None


@needs_c
def test_anyio_sees_a_send_task_started_while_it_waits() -> None:
    async def main() -> None:
        gate = asyncio.Event()
        task = asyncio.create_task(c_send(_Unconnected("", gate), "t", b"b"))
        assert not _anyio_task_started(task)  # (not stepped yet)
        await asyncio.sleep(0)
        assert _anyio_task_started(task)
        gate.set()
        assert await asyncio.wait_for(task, 10) == "done"

    asyncio.run(main())


@needs_c
def test_it_takes_weak_references_and_has_no_origin_or_stack() -> None:
    async def main() -> None:
        gate = asyncio.Event()
        coro: Any = c_send(_Unconnected("", gate), "t", b"b")
        ref: Any = weakref.ref(coro)
        assert ref() is coro and coro.cr_origin is None
        task = asyncio.create_task(coro)
        await asyncio.sleep(0)
        assert task.get_stack() == []  # (no frame: docs/client.md)
        gate.set()
        await asyncio.wait_for(task, 10)
        del task, coro
        gc.collect()
        assert ref() is None

    asyncio.run(main())


def test_the_method_is_a_coroutine_function_to_inspect_and_asyncio() -> None:
    client = equeue.aio.AsyncClient.__new__(equeue.aio.AsyncClient)
    for send in (equeue.aio.AsyncClient.send, client.send):
        assert inspect.iscoroutinefunction(send) and asyncio.iscoroutinefunction(send)


def _setup_flags() -> list[str]:
    """extra_compile_args of setup.py's Extension, read from its source."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "extra_compile_args":
            return [ast.literal_eval(e) for e in node.value.elts]  # type: ignore[attr-defined]
    raise AssertionError("setup.py has no extra_compile_args")


@pytest.mark.skipif(
    not PY313.exists() or shutil.which("gcc") is None, reason="no Python 3.13 or gcc"
)
def test_the_accelerator_builds_and_imports_on_python_3_13() -> None:
    flags = _setup_flags()
    assert "-Werror=implicit-function-declaration" in flags
    includes = subprocess.run(
        [f"{PY313}-config", "--includes"], capture_output=True, text=True, check=True
    ).stdout.split()
    suffix = subprocess.run(
        [f"{PY313}-config", "--extension-suffix"], capture_output=True, text=True, check=True
    ).stdout.strip()
    out = tempfile.mkdtemp(prefix="eq313", dir="/tmp")
    try:
        sources = sorted(str(p) for p in (ROOT / "equeue" / "cext").glob("*.c"))
        fast = [f for f in flags if not f.startswith("-O")] + ["-O0"]  # (the build's speed only)
        built = subprocess.run(
            [
                "gcc",
                *fast,
                "-shared",
                "-fPIC",
                *includes,
                *sources,
                "-o",
                f"{out}/_speedups{suffix}",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert built.returncode == 0, built.stderr
        loaded = subprocess.run(
            [str(PY313), "-c", "import _speedups; print(_speedups.client_send_coro_type())"],
            cwd=out,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert loaded.returncode == 0, loaded.stderr
        assert "SendCoro" in loaded.stdout
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    _reenter(sys.argv[1], {"c": "c", "a": "async def"}[sys.argv[2]])
