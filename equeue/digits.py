"""Numbers written as text in names, URLs, options and metadata keys.

``int(text)`` refuses more than ``sys.get_int_max_str_digits()`` (4,300) digits with a
builtin ValueError (review11 R11-7: a deletion intent listing a 5,000-digit stamp
refused every writable open), and ``str.isdigit()`` is true of digits ``int()`` reads
differently or not at all ("\u00b2", "\u0663": review10 F3/F4). So the length is
bounded first, then the characters, and only then is ``int()`` called."""

from typing import Final

# The widest number equeue writes as text is a u64 (a ns stamp: 19 digits until 2286; a
# log position or a queue offset): 2**64 - 1 has 20 digits. No bound of a caller is wider.
U64_DIGITS: Final = 20


def ascii_number(text: str, max_digits: int = U64_DIGITS) -> int | None:
    """The value of ``text`` if it is 1 to ``max_digits`` ASCII digits (no sign, space
    or "_"); None otherwise, without calling ``int()`` on it."""
    if 0 < len(text) <= max_digits and text.isascii() and text.isdigit():
        return int(text)
    return None
