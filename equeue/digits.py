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


PORT_FORM: Final = "a number from 0 to 65535 in ASCII digits"


def port_number(text: str) -> int | None:
    """The TCP port ``text`` writes: ASCII digits, 0 to 65535, leading zeros read as
    getaddrinfo(3) and urllib read them ("08080" is 8080; the listener refused more than 5
    characters, the client took them: round 20); None otherwise (also for ""). The zeros
    are stripped before ``ascii_number``, so any number of them costs no ``int()``."""
    digits = text.lstrip("0")
    if not digits:
        return 0 if text else None
    number = ascii_number(digits, 5)
    return number if number is not None and number <= 65535 else None
