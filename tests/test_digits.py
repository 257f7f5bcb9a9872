"""equeue.digits.ascii_number: the one guard before int() of text from a name, a URL,
an option or a metadata key (review11 R11-7)."""

from __future__ import annotations

import pytest

from equeue.digits import U64_DIGITS, ascii_number
from equeue.store.offsets import set_aside_copy


@pytest.mark.parametrize(
    "text",
    ["", "1" * 5000, "1" * (U64_DIGITS + 1), "\u00b2", "\u0663", "-1", "+1", " 1", "1_0", "0x1"],
)
def test_what_is_not_a_plain_bounded_number_is_none(text: str) -> None:
    assert ascii_number(text) is None


def test_a_u64_and_a_callers_own_bound() -> None:
    assert ascii_number(str(2**64 - 1)) == 2**64 - 1
    assert ascii_number("007") == 7
    assert ascii_number("65535", 5) == 65535
    assert ascii_number("065535", 5) is None


def test_a_set_aside_copy_name_past_20_digits_is_not_a_copy() -> None:
    """R11-7: int() raised a builtin ValueError for 5,000 digits (an intent's list can
    hold that name: it is no directory entry)."""
    assert set_aside_copy("g.json.1795787073692690096.damaged") == ("g.json", 1795787073692690096)
    assert set_aside_copy("g.json.1795787073692690096.7.damaged") == ("g.json", 1795787073692690096)
    assert set_aside_copy("g.json." + "1" * 5000 + ".damaged") is None
    assert set_aside_copy("g.json.1." + "1" * 5000 + ".damaged") is None
    assert set_aside_copy("g.json." + "1" * 21 + ".damaged") is None
