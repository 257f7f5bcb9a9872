"""Which set-aside copies a group deletion's finish renames ``.group-deleted`` (they then
stop holding retention): the ones its intent lists, those present at its commit point,
whatever the wall clock stamped on them (review9 R9-1: ordered by ns stamp against the
intent's, a copy the group made again set aside with the clock stepped back was renamed,
the R8-3 loss again). An intent without the list (written before it) keeps the stamp
rule; a malformed list is damage, set aside with nothing deleted."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from test_group_delete_later import _delete_failing
from test_group_delete_review8 import CONFIG, DLQ, RETRY, _living_group, open_refusing

from equeue import MessageStore
from equeue.atomicfile import read_json, write_json
from equeue.server import retry

HOUR_NS = 3600 * 10**9


def _side(path: Path) -> Path:
    side = path / "consumers" / "recovered"
    side.mkdir(parents=True, exist_ok=True)
    return side


def _intent_of(side: Path) -> Path:
    (intent,) = [e for e in side.iterdir() if e.name.endswith(".deleting")]
    return intent


def test_a_copy_set_aside_after_the_intent_with_a_clock_behind_keeps_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reviewer's d1_clock_step.py: the intent left by a failed finish, g made again,
    its copy set aside stamped an hour behind the intent's clock; and a copy of the
    deleted g stamped an hour ahead of it (a clock stepped back before the deletion)."""
    path = _living_group(tmp_path / "s")
    side = _side(path)
    ahead = side / f"g.json.{time.time_ns() + HOUR_NS}.damaged"  # the deleted g's
    ahead.write_bytes(b"the old g's damaged group file")
    with MessageStore.open(path, CONFIG) as store:
        assert _delete_failing(store, monkeypatch, 2).unfinished  # an intent is left
        intent = read_json(_intent_of(side))
        assert intent["deleting"]["set_aside"] == [ahead.name]
        store.commit_offset("g", "t", 0, 1)  # g made again
        behind = side / f"g.json.{time.time_ns() - HOUR_NS}.damaged"  # the new g's
        behind.write_bytes(b"the new g's damaged group file")
    with MessageStore.open(path, CONFIG) as store:
        assert not store.recovery.problems, store.recovery.problems
        assert "g" in store.consumer_groups()
        assert store._group_files.set_aside() == [behind.name]  # it holds retention still
    assert sorted(os.listdir(side)) == sorted([behind.name, f"{ahead.name}.group-deleted"])


def test_the_first_finish_renames_the_copies_present_at_the_commit_point(
    tmp_path: Path,
) -> None:
    """The group file damaged at the deletion (moved aside by it) and an older copy
    stamped ahead of the clock: both listed, both renamed; another group's copy not."""
    path = _living_group(tmp_path / "s")
    side = _side(path)
    ahead = side / f"g.json.{time.time_ns() + HOUR_NS}.damaged"
    ahead.write_bytes(b"an old copy")
    other = side / f"h.json.{time.time_ns() - HOUR_NS}.damaged"
    other.write_bytes(b"another group's copy")
    with MessageStore.open(path, CONFIG) as store:
        (path / "consumers" / "g.json").write_bytes(b"{ damaged under the handle")
        deleted = store.delete_group("g")
        assert deleted.unfinished == ""
    (moved,) = [e for e in os.listdir(side) if e.startswith("g.json.") and ahead.name not in e]
    moved = moved.removesuffix(".group-deleted")
    assert sorted(os.listdir(side)) == sorted(
        [other.name, f"{ahead.name}.group-deleted", f"{moved}.group-deleted"]
    )


def _old_intent(path: Path, stamp: int, extra: dict[str, object]) -> Path:
    intent = _side(path) / f"g.json.{stamp}.deleting"
    topics = {RETRY: {"mark": -1, "ends": [1, 0]}, DLQ: {"mark": -1, "ends": [1]}}
    deleting = {"dead_letters": True, "topics": topics, **extra}
    write_json(intent, {"group": "g", "offsets": {}, "deleting": deleting})
    return intent


def test_an_intent_without_the_list_renames_the_copies_stamped_before_it(
    tmp_path: Path,
) -> None:
    """An intent written by an equeue before the list: acted on as then."""
    path = _living_group(tmp_path / "s")
    stamp = time.time_ns()
    side = _side(path)
    older = side / f"g.json.{stamp - 1}.damaged"
    newer = side / f"g.json.{stamp + 1}.damaged"
    for copy in (older, newer):
        copy.write_bytes(b"a damaged copy")
    _old_intent(path, stamp, {})
    with MessageStore.open(path, CONFIG) as store:
        assert not store.recovery.problems, store.recovery.problems
        assert sorted(store.topics()) == [retry.DELAY_TOPIC, "t"]
    assert sorted(os.listdir(side)) == sorted([newer.name, f"{older.name}.group-deleted"])


MALFORMED = {
    "not a list": "g.json.1.damaged",
    "a number": [1],
    "another group's copy": ["h.json.1.damaged"],
    "a path out of the directory": ["../g.json.1.damaged"],
    "an intent, not a copy": ["g.json.1.deleting"],
    "no stamp": ["g.json.damaged"],
    # review10 F3: "\u00b2".isdigit() is true and int() refuses it (a builtin ValueError
    # refused every writable open); "\u0663" is a decimal digit int() reads as 3.
    "a superscript digit stamp": ["g.json.\u00b2.damaged"],
    "a superscript digit k": ["g.json.1.\u00b2.damaged"],
    "an Arabic-Indic digit stamp": ["g.json.\u0663.damaged"],
    # review11 R11-7: int() refuses more than 4,300 digits (a builtin ValueError refused
    # every writable open again); a name in the list is not bounded by NAME_MAX
    "a stamp of 5,000 digits": ["g.json." + "1" * 5000 + ".damaged"],
    "a k of 5,000 digits": ["g.json.1." + "1" * 5000 + ".damaged"],
    "a stamp past a u64's 20 digits": ["g.json." + "1" * 21 + ".damaged"],
}


@pytest.mark.parametrize("label", list(MALFORMED))
def test_a_malformed_list_is_damage_set_aside_with_nothing_deleted(
    tmp_path: Path, label: str
) -> None:
    path = _living_group(tmp_path / "s")
    side = _side(path)
    copy = side / "h.json.1.damaged"
    copy.write_bytes(b"another group's copy")
    intent = _old_intent(path, time.time_ns(), {"set_aside": MALFORMED[label]})
    open_refusing(path, intent, "set_aside")
    assert sorted(os.listdir(side)) == sorted([copy.name, f"{intent.name}.damaged"])


@pytest.mark.parametrize("stamp", ["\u00b2", "\u0663"])
def test_delete_group_leaves_a_copy_name_with_a_non_ascii_digit_alone(
    tmp_path: Path, stamp: str
) -> None:
    """review10 F4: such a name in consumers/recovered/ made delete_group raise a builtin
    ValueError ("\u00b2": isdigit() is true, int() refuses it) or renamed it as g's copy
    ("\u0663": int() reads 3); no equeue writes one, so it is not g's copy."""
    path = _living_group(tmp_path / "s")
    foreign = _side(path) / f"g.json.{stamp}.damaged"
    foreign.write_bytes(b"a file no equeue wrote")
    with MessageStore.open(path, CONFIG) as store:
        assert not store.recovery.problems, store.recovery.problems
        deleted = store.delete_group("g", delete_dead_letters=True)
        assert deleted.group == "g" and not deleted.unfinished
        assert "g" not in store.consumer_groups()
        assert sorted(store.topics()) == [retry.DELAY_TOPIC, "t"]
    assert os.listdir(foreign.parent) == [foreign.name]
    assert foreign.read_bytes() == b"a file no equeue wrote"
