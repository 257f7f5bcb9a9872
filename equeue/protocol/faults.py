"""Errors on the wire: an exception becomes ``{"code": class name, "message": str}``
and back. The code is the name of a class in ``equeue.errors`` (docs/protocol.md lists
them), so a client raises the same class the store raised in the broker.

An error the broker did not expect (not an equeue error) goes out as ``BrokerError``
with its text; a code this client does not know arrives as ``BrokerError`` too, the
code kept in the message.
"""

from __future__ import annotations

import equeue.errors as errors_module
from equeue.errors import BrokerError, EQueueError, ProtocolError

MAX_MESSAGE_CHARS = 4096


def pack_error(error: BaseException) -> dict[str, str]:
    if isinstance(error, EQueueError):
        code, text = type(error).__name__, str(error)
    else:
        code, text = BrokerError.__name__, f"{type(error).__name__}: {error}"
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
