# Types of the C accelerator (equeue/cext/); see equeue/speedups.py.
from collections.abc import Callable
from typing import Any, type_check_only

def xxh3_64(data: bytes | memoryview, /) -> int: ...
def configure(head_size: int, frame_overhead: int, queue_record: int, max_name: int, /) -> None: ...
def check_batch(
    items: list[Any],
    outgoing_type: type,
    slow: Callable[[Any], tuple[Any, ...]],
    tag_check: Callable[[str], tuple[bytes, int]],
    max_body: int,
    chunk_size: int,
    queue_count: int,
    /,
) -> list[Any]: ...
def write_run(
    mm: Any,
    data_offset: int,
    start: int,
    room: int,
    base: int,
    now_ns: int,
    topic: str,
    topic_bytes: bytes,
    checked: list[Any],
    i: int,
    turn: int,
    queue_maps: list[Any],
    queue_ends: list[int],
    queue_sizes: list[int],
    next_offsets: list[int],
    id_prefix: str,
    result_type: type,
    stored_at: float,
    xxh32: Callable[[bytes], int],
    results: list[Any],
    /,
) -> tuple[int, int, int, list[int], list[tuple[str, int]]]: ...
def decode_run(
    mm: Any,
    data_offset: int,
    data_end: int,
    base: int,
    positions: list[int],
    message_type: type,
    id_prefix: str,
    decode_properties: Callable[[bytes], dict[str, str]],
    /,
) -> list[Any]: ...
def pull_chunk(
    mm: Any,
    data_offset: int,
    data_end: int,
    base: int,
    entries: bytes,
    first: int,
    offset: int,
    queue_id: int,
    topic: str,
    room: int,
    out: list[Any],
    message_type: type,
    id_prefix: str,
    decode_properties: Callable[[bytes], dict[str, str]],
    /,
) -> int: ...
def collect(
    entries: list[tuple[int, int]],
    found: dict[int, tuple[Any, int]],
    offset: int,
    queue_id: int,
    topic: str,
    room: int,
    out: list[Any],
    /,
) -> tuple[int, int]: ...
def trim_run(
    messages: list[Any], counted: int, budget: int, offset: int, /
) -> tuple[int, int, int]: ...

class Sender:
    def __init__(
        self,
        store: Any,
        lock: Any,
        writer: Any,
        queues: dict[str, Any],
        topic_bytes: dict[str, bytes],
        round_robin: dict[str, int],
        keys: Any,
        id_prefix: str,
        result_type: type,
        tag_check: Callable[[str], tuple[bytes, int]],
        xxh32: Callable[[bytes], int],
        clock: Any,
        data_offset: int,
        max_body: int,
        chunk_size: int,
        fallback: Callable[..., Any] | None = None,
        /,
    ) -> None: ...
    @property
    def rereads(self) -> tuple[int, int]: ...  # sends that read the (log, queue) chunk again
    def call(self, topic: object, body: object, /, **fields: object) -> Any: ...
    def send(
        self,
        topic: object,
        body: object,
        tag: object,
        key: object,
        properties: object,
        code: object,
        queue_id: object,
        /,
    ) -> Any: ...
    def write_checked(self, topic: str, queues: list[Any], checked: tuple[Any, ...], /) -> Any: ...
    def append_bodies(
        self, topic: str, queues: list[Any], bodies: list[bytes], start: int, out: list[Any], /
    ) -> int: ...
    def plain_bodies(self, items: object, /) -> bool: ...
    def check(
        self,
        queue_count: int,
        body: object,
        tag: object,
        key: object,
        properties: object,
        code: object,
        queue_id: object,
        /,
    ) -> Any: ...

def scan_frames(
    buf: Any, data_offset: int, available: int, max_length: int, start: int, /
) -> tuple[int, int]: ...
def match_run(
    mm: Any,
    data_offset: int,
    start: int,
    end: int,
    base: int,
    verify: bool,
    queues: dict[bytes, list[list[Any]]],
    key_from: int,
    keyed: list[tuple[str, str, int]],
    touched: list[list[Any]],
    /,
) -> tuple[int, int]: ...
def pack_columns(columns: tuple[Any, ...], /) -> bytes | None: ...
def results_of_columns(value: object, result_type: type, /) -> list[Any] | None: ...
def all_bytes(items: object, /) -> bool: ...
def frame_offsets(buf: Any, start: int, end: int, /) -> tuple[int, bytes]: ...
def record_columns(buf: Any, offsets: bytes, id_prefix: str, /) -> tuple[Any, ...]: ...
def record_bodies(buf: Any, offsets: bytes, /) -> tuple[int, bytes, bytes]: ...
def last_nonzero(buf: Any, start: int, stop: int, /) -> int: ...
def prefault_request(mapping: int, address: int, length: int, /) -> bool: ...
def prefault_forget(mapping: int, /) -> None: ...
def prefault_supported() -> bool: ...
def prefault_pending() -> list[int]: ...

# equeue.store.types.Message when this module loads (equeue/cext/message.c); typed as
# the NamedTuple there, which it behaves as.
Message: type

def message_doc(doc: str, /) -> None: ...

# equeue.store.types.SendResult when this module loads (equeue/cext/sendresult.c); typed
# as the NamedTuple there, which it behaves as.
SendResult: type

def send_result_doc(doc: str, /) -> None: ...
def pack_pull_columns(
    messages: list[Any], next_offset: int, topic: str, queue_id: int, id_prefix: str, room: int, /
) -> tuple[bytes | None, int] | None: ...
def unpack_pull_columns(value: object, message_type: type, /) -> tuple[list[Any], int] | None: ...

# The broker's plain send (equeue/cext/sendframe.c)
def send_frame(
    buffer: Any, nbytes: int, max_frame_bytes: int, /
) -> tuple[int, str, bytes] | None: ...
def send_body(body: bytes, /) -> tuple[int, str, bytes] | None: ...
def send_answer(request_id: int, result: Any, kind: type[bytes] = ..., /) -> bytes | None: ...
def plain_send(
    buffer: Any,
    nbytes: int,
    max_frame_bytes: int,
    send: Callable[[str, bytes], Any],
    kind: type[bytes],
    reserved: str,
    /,
) -> tuple[int, Any, Any] | None: ...

# The broker's durable answers after their fdatasync (equeue/cext/release.c)
def frames_by_peer(batch: list[Any], kind: type, /) -> list[tuple[Any, bytes, int]] | None: ...
def release_frames(
    batch: list[Any],
    kind: type,
    counters: Any,
    other: Callable[[Any, bytes, int], None],
    failed: Callable[[Any, BaseException], None],
    /,
) -> bool: ...
def answers_written_directly() -> int: ...  # sent by C to the socket, in this process

# The group commit's add as the send lane makes it (equeue/cext/commitadd.c): whether C
# added it, else commit.add did
def commit_add(commit: Any, peer: Any, request_id: int, result: Any, messages: int, /) -> bool: ...
def commit_adds_in_c() -> int: ...  # the adds made in C so far, in this process

# The broker's send_bodies read from its frame (equeue/cext/bodyspans.c)
@type_check_only  # (its type is not a module attribute)
class BodySpans:
    def __len__(self) -> int: ...
    def __getitem__(self, i: int, /) -> bytes: ...

def bodies_body(body: bytes, max_bodies: int, /) -> tuple[int, str, BodySpans] | None: ...
def bodies_read(
    view: memoryview, nbytes: int, max_frame_bytes: int, max_bodies: int, /
) -> tuple[int, str, BodySpans] | None: ...
def answer_around(request_id: int, result: bytes, /) -> bytes: ...
def packed_answer(topic: str, count: int, columns: list[bytearray], /) -> bytes | None: ...

# The clients' send_bodies request and answer (equeue/cext/answercols.c)
def bodies_request(
    request_id: int, topic: str, bodies: list[bytes], max_frame_bytes: int, /
) -> bytes | int | None: ...
def columns_answer(frame: bytes | memoryview, rids: set[int], /) -> list[Any] | None: ...
def pull_answer(frame: bytes | memoryview, rids: set[int], /) -> list[Any] | None: ...

# The asyncio client's connection state and its direct path (equeue/cext/clientconn.c):
# the base class of equeue/client/aio.py's _Protocol (its fields: aio.py's _PyConn)
def client_conn_type() -> type: ...
def client_coalescer_types() -> tuple[type, type]: ...
def client_answer_type() -> type: ...

# The asyncio client's own socket transport on selector loops (equeue/cext/rawsock.c):
# the base class of equeue/client/rawconn.py's RawTransport
def client_raw_sock_type() -> type: ...

# One loop reader for many of those transports, an epoll set (equeue/cext/readmux.c):
# None where there is no epoll
def client_read_mux_type() -> type | None: ...

# The shared-memory rings (equeue/cext/shmring.c): (ShmRing, ShmWaker, ShmMux),
# None off Linux; broken: the error class of a ring index out of bounds
def shm_types(broken: type, /) -> tuple[type, type, type] | None: ...

# The future of a direct send, its task woken at once when safe (equeue/cext/wakeup.c):
# Waiter(loop), asyncio's future protocol
def client_waiter_type() -> type: ...

# AsyncClient.send's plain call as a coroutine in C (equeue/cext/sendcoro.c):
# client_send_method(py_send, answered, marker) -> the class's send; SendCoro's type
def client_send_method(py_send: Any, answered: Any, marker: Any, /) -> Any: ...
def client_send_coro_type() -> type: ...

# The asyncio client's plain send (equeue/cext/clientsend.c)
def client_send_frame(
    request_id: int, topic: str, body: bytes, max_frame_bytes: int, /
) -> bytes | int | None: ...
def client_send_result(
    buffer: Any, nbytes: int, request_id: int, topic: str, max_frame_bytes: int, /
) -> Any: ...

class SendLane:
    """A connection's buffer_updated and get_buffer in C (cext/sendlane.c)."""

    def __init__(
        self,
        connection: Any,
        view: memoryview,
        max_frame_bytes: int,
        max_in_flight: int,
        kind: type[bytes],
        reserved: str,
        commit: Any,
        counters: Any,
        holds: Any,
        /,
    ) -> None: ...
    def __call__(self, nbytes: int, /) -> None: ...
    def get_buffer(self, sizehint: int, /) -> memoryview: ...

class Flusher:
    """The broker's group-commit fdatasync thread (flusher.c, equeue/server/flushers.py)."""

    event_fd: int  # readable once a flush ended
    timer_fd: int  # readable once the armed bound passed
    def start(self, fd: int) -> None: ...
    def collect(self) -> tuple[int, float, float] | None: ...
    def arm(self, us: int) -> None: ...
    def expired(self) -> bool: ...
    def close(self) -> None: ...

class CCounters:
    """The broker's counters as C integers (cext/counters.c; stats.py's Counters)."""

    requests: int
    sends: int
    send_requests: int
    pulls: int
    bytes_in: int
    bytes_out: int
    errors: int
