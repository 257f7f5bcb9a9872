"""store.py's parts (storetopics.py, storesend.py, storereads.py, storeoffsets.py,
storeupkeep.py): every function a part writes for MessageStore (first parameter
``self``) is bound in the class's own dict under its own name, so a function added to a
part and not bound there, or bound under another name, fails here, not at a caller."""

from __future__ import annotations

import inspect
from types import FunctionType, ModuleType

from equeue.store import storeoffsets, storereads, storesend, storetopics, storeupkeep
from equeue.store.store import MessageStore

PARTS = (storetopics, storesend, storereads, storeoffsets, storeupkeep)


def methods_of(part: ModuleType) -> dict[str, FunctionType]:
    found = {}
    for name, value in vars(part).items():
        if isinstance(value, FunctionType) and value.__module__ == part.__name__:
            parameters = list(inspect.signature(value).parameters)
            if parameters[:1] == ["self"]:
                found[name] = value
    return found


def test_every_method_of_a_part_is_bound_on_the_class_by_its_name() -> None:
    wrong = [
        f"{part.__name__}.{name}"
        for part in PARTS
        for name, function in methods_of(part).items()
        if MessageStore.__dict__.get(name) is not function
    ]
    assert wrong == []
    assert all(methods_of(part) for part in PARTS)
