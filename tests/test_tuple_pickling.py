"""TupleMessage and TupleSendResult (the NamedTuples of equeue.store.types) pickle and
unpickle in an accelerated process and in an ``EQUEUE_PURE_PYTHON=1`` one, each way
round: with the accelerator, the module's Message and SendResult are the C types, so the
NamedTuples are pickled by their own names."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from equeue import speedups
from equeue.store.types import Message, SendResult, TupleMessage, TupleSendResult

HERE = Path(__file__).parent
needs_c = pytest.mark.skipif(speedups.SPEEDUPS is None, reason="the C accelerator is not built")
MESSAGE = ("c5f6cce2000000000000004a", "t", 1, 7, 74, "tag", "k", {"p": "q"}, 3, b"b", 5, 6)
RESULT = ("c5f6cce2000000000000004a", "t", 1, 7, 74, 1_795_648_194.344364)

# dump: pickles [TupleMessage, TupleSendResult, Message, SendResult] of the fields above;
# load: unpickles them and prints each one's type (module.qualname) and its fields.
CHILD = """
import json, pickle, sys
from equeue import speedups
from equeue.store import types
from test_tuple_pickling import MESSAGE as M, RESULT as R
assert (speedups.SPEEDUPS is None) == (sys.argv[2] == "pure"), speedups.SPEEDUPS
if sys.argv[1] == "dump":
    made = [types.TupleMessage(*M), types.TupleSendResult(*R), types.Message(*M),
            types.SendResult(*R)]
    sys.stdout.buffer.write(pickle.dumps(made))
else:
    got = pickle.load(sys.stdin.buffer)
    names = [type(x).__module__ + "." + type(x).__qualname__ for x in got]
    same = [tuple(x) == want for x, want in zip(got, [M, R, M, R])]
    print(json.dumps([names, same]))
"""


def _child(mode: str, action: str, data: bytes = b"") -> bytes:
    env = {k: v for k, v in os.environ.items() if k != "EQUEUE_PURE_PYTHON"}
    if mode == "pure":
        env["EQUEUE_PURE_PYTHON"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), str(HERE), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", CHILD, action, mode],
        input=data, capture_output=True, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout


def test_the_named_tuples_pickle_in_this_process() -> None:
    for made in (TupleMessage(*MESSAGE), TupleSendResult(*RESULT)):
        back = pickle.loads(pickle.dumps(made))
        assert type(back) is type(made) and back == made
        assert repr(back) == repr(made) and repr(made).startswith(type(made).__name__ + "(")
    # (the C types are unchanged: they pickle as the module's Message and SendResult)
    assert type(pickle.loads(pickle.dumps(Message(*MESSAGE)))) is Message
    assert type(pickle.loads(pickle.dumps(SendResult(*RESULT)))) is SendResult


@needs_c
@pytest.mark.parametrize(("dumper", "loader"), [("c", "pure"), ("pure", "c"), ("c", "c")])
def test_pickled_in_one_kind_of_process_unpickled_in_the_other(dumper: str, loader: str) -> None:
    names, same = json.loads(_child(loader, "load", _child(dumper, "dump")))
    assert same == [True] * 4
    types = "equeue.store.types."
    if loader == "pure":  # one class each: the NamedTuples
        assert names == [types + "Message", types + "SendResult"] * 2
    elif dumper == "c":  # the NamedTuples stay NamedTuples, the C types C types
        assert names == [types + n for n in ("TupleMessage", "TupleSendResult")] + [
            types + "Message",
            types + "SendResult",
        ]
    else:  # a pure process's Message is its one class: the C type here
        assert names == [types + "Message", types + "SendResult"] * 2


def test_pickled_and_unpickled_in_a_pure_process() -> None:
    names, same = json.loads(_child("pure", "load", _child("pure", "dump")))
    assert same == [True] * 4 and names == ["equeue.store.types.Message",
                                            "equeue.store.types.SendResult"] * 2  # fmt: skip
