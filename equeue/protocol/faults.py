"""Errors on the wire: an exception becomes ``{"code": class name, "message": str}``
and back. The code is the name of a class in ``equeue.errors`` (docs/protocol.md lists
them), so a client raises the same class the store raised in the broker.

An error the broker did not expect (not an equeue error) goes out as ``BrokerError``
with its text; a code this client does not know arrives as ``BrokerError`` too, the
code kept in the message.

A broker registers its store's directory (``hide_store_path``): an error text crossing
the wire names files relative to the store (``consumers/g.json``) and the store itself
as "the store", so a remote client learns nothing of the server's file system; the
broker's own log gets the text with the absolute path.
"""

from __future__ import annotations

import logging
import os
import re

import equeue.errors as errors_module
from equeue.errors import BrokerError, EQueueError, ProtocolError

log = logging.getLogger("equeue.server")

MAX_MESSAGE_CHARS = 4096

# Store directories of the brokers of this process, as patterns: the directory followed
# by a separator (a file in it) or by no further name character (the store itself).
_hidden: dict[str, re.Pattern[str]] = {}


def hide_store_path(path: str | os.PathLike[str]) -> None:
    """Cut ``path`` (a served store's directory, as given and resolved) from every error
    text ``pack_error`` makes from now on."""
    for form in {os.path.abspath(path), os.path.realpath(path)}:
        if form != os.sep and form not in _hidden:
            _hidden[form] = re.compile(re.escape(form) + r"(/|(?![\w.-]))")


def _store_relative(text: str) -> str:
    for pattern in sorted(_hidden.values(), key=lambda p: len(p.pattern), reverse=True):
        text = pattern.sub(lambda m: "" if m.group(1) else "the store", text)
    return text


def pack_error(error: BaseException) -> dict[str, str]:
    if isinstance(error, EQueueError):
        code, text = type(error).__name__, str(error)
    else:
        code, text = BrokerError.__name__, f"{type(error).__name__}: {error}"
    if _hidden:
        sent = _store_relative(text)
        if sent != text:  # the server's log keeps where it was
            log.info("answered %s: %s", code, text[:MAX_MESSAGE_CHARS])
            text = sent
    return {"code": code, "message": text[:MAX_MESSAGE_CHARS]}


def error_class(code: str) -> type[EQueueError] | None:
    found = getattr(errors_module, code, None)
    if isinstance(found, type) and issubclass(found, EQueueError):
        return found
    return None


def unpack_error(value: object, where: str) -> EQueueError:
    """The exception an error answer describes (to raise in the client)."""
    if type(value) is not dict or type(value.get("code")) is not str:
        return ProtocolError(f"{where}: an error answer must be a map with a 'code' string")
    code: str = value["code"]
    message = value.get("message")
    text = message if type(message) is str else ""
    cls = error_class(code)
    if cls is None:
        return BrokerError(f"{code}: {text}")
    # Built without its __init__: some classes take structured arguments (file, offset);
    # on the wire only the text survives.
    error = cls.__new__(cls)
    Exception.__init__(error, text)
    for name, default in _ATTRIBUTES.items():  # what the classes' __init__ would have set
        setattr(error, name, default() if callable(default) else default)
    return error


# Instance attributes some error classes set in __init__; an error from the wire has
# none of their values, so each is None (or empty), as for an error without a location.
_ATTRIBUTES: dict[str, object] = {
    "reason": None, "file": None, "offset": None, "expected": None, "found": None,
    "sent": list, "unanswered": list,
}  # fmt: skip
