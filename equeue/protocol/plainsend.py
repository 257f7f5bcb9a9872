"""The asyncio client's plain send with one request in flight on its connection, in C
(equeue/cext/clientsend.c): the request frame written whole and the answer read straight
from the connection's read buffer, without msgpack's Packer and Unpacker, the frame
reader or the answer dispatch. Both give None for anything but the common, valid case;
the caller then takes the general path (RequestEncoder, AnswerReader), which produces
the same bytes and results, or the precise error.

``send_frame(request_id, topic, body, max_frame_bytes) -> bytes | int | None``: the whole
frame of ``[request_id, "send", {"topic": topic, "body": body}]``, RequestEncoder.frame's
bytes; an int (the payload's size, nothing built) when over max_frame_bytes.

``send_result(buffer, nbytes, request_id, topic, max_frame_bytes) -> SendResult | None``:
the result when the first nbytes of buffer are exactly the one frame answering
``request_id`` with status OK and a SendResult.

``conn_type``: equeue/cext/clientconn.c's ClientConn, the base of the asyncio client's
protocol: its connection state as C fields and ``get_buffer``, ``buffer_updated`` and
``direct`` (the send above and its answer) without a Python frame.
``raw_sock_type``: equeue/cext/rawsock.c's RawSock, the base of the asyncio client's own
socket transport on selector loops (equeue/client/rawconn.py).
``read_mux_type``: equeue/cext/readmux.c's ReadMux, one loop reader for many of those
transports (an epoll set); None also where there is no epoll.

All are None (the names, not a function) without the accelerator: the client binds
them once, and a call is one C call with no Python frame around it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from equeue import speedups

_fast = speedups.SPEEDUPS

send_frame: Final[Callable[[int, str, bytes, int], bytes | int | None] | None] = (
    None if _fast is None else _fast.client_send_frame
)
send_result: Final[Callable[[Any, int, int, str, int], Any] | None] = (
    None if _fast is None else _fast.client_send_result
)
conn_type: Final[type | None] = None if _fast is None else _fast.client_conn_type()
raw_sock_type: Final[type | None] = None if _fast is None else _fast.client_raw_sock_type()
read_mux_type: Final[type | None] = None if _fast is None else _fast.client_read_mux_type()
