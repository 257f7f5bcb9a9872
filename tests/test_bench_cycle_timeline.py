"""tools/bench_cycle_timeline.py's reading of a perf trace: each cycle's steps, measured
from its fdatasync's return, and whether the loop and the clients shared one CPU."""

from __future__ import annotations

import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent.parent / "tools"
sys.path.insert(0, str(TOOLS))

from bench_cycle_timeline import answer_cycles, cycles, parse  # noqa: E402

LOOP, CLIENTS, FLUSHER = 100, 200, 101


def _line(tid: int, cpu: int, us: float, name: str) -> str:
    return f"{tid:>8} [{cpu:03d}] {1000 + us / 1e6:.9f}: syscalls:sys_{name}: "


def _cycle(at: float, loop_cpu: int, clients_cpu: int) -> list[str]:
    """One cycle starting at ``at`` µs: an fdatasync of 80 µs, two answers, two sends."""
    steps = [
        (FLUSHER, 0, 0, "enter_fdatasync"),
        (LOOP, loop_cpu, 1, "enter_epoll_pwait"),
        (CLIENTS, clients_cpu, 2, "enter_epoll_wait"),
        (FLUSHER, 0, 80, "exit_fdatasync"),
        (LOOP, loop_cpu, 90, "exit_epoll_pwait"),
        (LOOP, loop_cpu, 100, "enter_sendto"),
        (LOOP, loop_cpu, 102, "enter_sendto"),
        (LOOP, loop_cpu, 110, "enter_epoll_pwait"),
        (CLIENTS, clients_cpu, 120, "exit_epoll_wait"),
        (CLIENTS, clients_cpu, 121, "enter_recvfrom"),
        (CLIENTS, clients_cpu, 125, "enter_sendto"),
        (CLIENTS, clients_cpu, 126, "enter_recvfrom"),
        (CLIENTS, clients_cpu, 130, "enter_sendto"),
        (CLIENTS, clients_cpu, 140, "enter_epoll_wait"),
        (LOOP, loop_cpu, 150, "exit_epoll_pwait"),
        (LOOP, loop_cpu, 151, "enter_read"),
        (LOOP, loop_cpu, 155, "enter_read"),
        (LOOP, loop_cpu, 170, "enter_epoll_pwait"),
    ]
    return [_line(tid, cpu, at + us, name) for tid, cpu, us, name in steps]


def test_each_cycle_is_read_from_its_fdatasyncs_return_to_the_next_ones_start() -> None:
    text = "\n".join(
        [*_cycle(0, 1, 1), *_cycle(200, 1, 0), _line(FLUSHER, 0, 400, "enter_fdatasync")]
    )
    found = cycles(parse(text), LOOP, CLIENTS, FLUSHER)
    assert len(found) == 2
    first, second = found
    assert round(first.fdatasync) == 80
    assert round(first.loop_woke) == 10
    assert (round(first.first_answer), round(first.last_answer), first.answers) == (20, 22, 2)
    assert round(first.clients_first_read) == 41
    assert round(first.clients_last_send) == 50
    assert round(first.loop_last_read) == 75
    assert round(first.next_fdatasync) == 120
    assert round(first.loop_ran) == 20 + 20  # 90-110 and 150-170
    assert round(first.clients_ran) == 20  # 120-140
    assert first.one_cpu and not second.one_cpu


def test_a_cycle_without_answers_or_sends_is_left_out() -> None:
    lines = [
        _line(FLUSHER, 0, 0, "enter_fdatasync"),
        _line(FLUSHER, 0, 80, "exit_fdatasync"),
        _line(LOOP, 1, 90, "exit_epoll_pwait"),
        _line(FLUSHER, 0, 200, "enter_fdatasync"),
        "a line of something else",
    ]
    assert cycles(parse("\n".join(lines)), LOOP, CLIENTS, FLUSHER) == []


def test_a_loop_still_running_when_the_fdatasync_returns_counts_from_that_return() -> None:
    lines = _cycle(0, 1, 0)
    # the loop did not wait at 90: it read until 95, when it went into its epoll wait
    lines = [
        line for line in lines if not line.startswith(f"{LOOP:>8}") or " 1000.00009" not in line
    ]
    lines.insert(4, _line(LOOP, 1, 95, "enter_epoll_pwait"))
    lines.insert(5, _line(LOOP, 1, 96, "exit_epoll_pwait"))
    lines.append(_line(FLUSHER, 0, 200, "enter_fdatasync"))
    (cycle,) = cycles(
        parse("\n".join(sorted(lines, key=lambda s: s.split()[2]))), LOOP, CLIENTS, FLUSHER
    )
    assert round(cycle.loop_ran) == 15 + 14 + 20  # 80-95, 96-110, 150-170


def _shared_cycle(at: float, sync: bool = True) -> list[str]:
    """A shared client's cycle from the loop's answer at ``at`` µs to its next answer: the
    clients' turn 100 µs, the appends 17, the flusher's wake-up 13, an fdatasync of 80
    (``sync``), the loop's wake-up 5."""
    steps = [
        (LOOP, 0, "enter_write"),  # the answer
        (LOOP, 2, "enter_epoll_pwait"),
        (CLIENTS, 10, "exit_epoll_wait"),
        (CLIENTS, 12, "enter_recvfrom"),
        (CLIENTS, 112, "enter_sendto"),
        (LOOP, 120, "exit_epoll_pwait"),
        (LOOP, 121, "enter_read"),
    ]
    if sync:
        steps += [
            (LOOP, 138, "enter_futex"),  # the hand-over
            (LOOP, 140, "enter_epoll_pwait"),
            (FLUSHER, 151, "enter_fdatasync"),
            (FLUSHER, 231, "exit_fdatasync"),
            (FLUSHER, 232, "enter_write"),  # its eventfd: not an answer
            (LOOP, 236, "exit_epoll_pwait"),
            (LOOP, 237, "enter_read"),  # the eventfd: not a request
        ]
    return [_line(tid, 0, at + us, name) for tid, us, name in steps]


def test_a_shared_clients_cycle_runs_from_one_answer_to_the_next() -> None:
    text = "\n".join([*_shared_cycle(0), *_shared_cycle(300), _line(LOOP, 0, 600, "enter_write")])
    found = answer_cycles(parse(text), LOOP, CLIENTS, FLUSHER)
    assert len(found) == 2
    first = found[0]
    assert [round(span) for span in first.spans] == [12, 100, 9, 17, 13, 80, 5, 64]
    assert round(first.total) == 300
    assert (first.requests, first.fdatasyncs) == (1, 1)


def test_under_async_the_loop_answers_after_its_read() -> None:
    text = "\n".join([*_shared_cycle(0, sync=False), _line(LOOP, 0, 170, "enter_write")])
    (cycle,) = answer_cycles(parse(text), LOOP, CLIENTS, None)
    assert [round(span) for span in cycle.spans] == [12, 100, 9, 49, 0, 0, 0, 0]
    assert cycle.fdatasyncs == 0


def test_a_shared_cycle_missing_a_step_is_left_out() -> None:
    lines = _shared_cycle(0)
    lines = [line for line in lines if "enter_fdatasync" not in line]
    text = "\n".join([*lines, _line(LOOP, 0, 300, "enter_write")])
    assert answer_cycles(parse(text), LOOP, CLIENTS, FLUSHER) == []


def test_with_no_futex_call_seen_the_hand_over_is_the_loops_read() -> None:
    lines = [line for line in _shared_cycle(0) if "enter_futex" not in line]
    text = "\n".join([*lines, _line(LOOP, 0, 300, "enter_write")])
    (cycle,) = answer_cycles(parse(text), LOOP, CLIENTS, FLUSHER)
    assert [round(span) for span in cycle.spans][3:5] == [0, 30]
