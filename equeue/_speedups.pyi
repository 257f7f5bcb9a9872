# Types of the C accelerator (equeue/_speedups.c); see equeue/speedups.py.
from collections.abc import Callable
from typing import Any

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
def check_one(
    fields: tuple[object, ...],
    tag_check: Callable[[str], tuple[bytes, int]],
    max_body: int,
    chunk_size: int,
    queue_count: int,
    /,
) -> Any: ...
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
def write_one(
    mm: Any,
    data_offset: int,
    start: int,
    room: int,
    base: int,
    now_ns: int,
    topic: str,
    topic_bytes: bytes,
    checked: tuple[Any, ...],
    queue_id: int,
    queue_offset: int,
    queue_map: Any,
    queue_end: int,
    queue_size: int,
    id_prefix: str,
    result_type: type,
    stored_at: float,
    /,
) -> tuple[Any, int] | None: ...
def scan_frames(
    buf: Any, data_offset: int, available: int, max_length: int, start: int, /
) -> tuple[int, int]: ...
def last_nonzero(buf: Any, start: int, stop: int, /) -> int: ...
