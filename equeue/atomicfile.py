"""Small files replaced atomically: temp file, fsync, rename, fsync the directory.

Each file holds one JSON document ``{"xxh64": hex, "body": ...}``; the hash
covers the canonical encoding of the body, so a flipped bit is reported as
corruption (with the file) instead of being read as different data.

A document may carry ``"format": N`` beside them (none: format 1, all this version
writes): a later equeue that changes a file's body so that this one would misread it
writes a higher N, and this reader refuses it as newer (NewerFormatError), before its
body is looked at. Every version before this one ignores fields beside the two.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import xxhash

from equeue.chunks.fileops import fsync_directory, write_error
from equeue.errors import ChecksumMismatchError, CorruptionError, NewerFormatError
from equeue.safepath import check_removable, open_file, opener


def _canonical(body: Any) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def write_json(path: Path, body: Any) -> None:
    data = json.dumps(
        {"xxh64": xxhash.xxh64_hexdigest(_canonical(body)), "body": body}, sort_keys=True
    ).encode()
    write_bytes(path, data)


def write_bytes(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` or what it held before, never a part: a temporary file,
    fsynced, renamed over it."""
    temp = path.with_name(f"{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(temp, "xb", opener=opener) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
        fsync_directory(path.parent)
    except OSError as exc:
        temp.unlink(missing_ok=True)
        raise write_error(exc, "writing", path) from exc


# The largest metadata document read. Far above any this version writes (topics.json
# takes ~100 bytes a topic, up to ~350 with 255-byte names: ~760 k topics at the worst;
# every other file is smaller), so a larger file was grown by hand, a bad copy or a file
# system fault: refused from its size, before its bytes are read into memory.
MAX_METADATA_BYTES = 256 << 20


def read_json(path: Path) -> Any:
    """The body stored in ``path``; CorruptionError if it does not check out."""
    with open_file(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size <= MAX_METADATA_BYTES:
            raw = f.read(MAX_METADATA_BYTES + 1)  # (it may grow after the fstat)
            size = len(raw)
        if size > MAX_METADATA_BYTES:
            raise CorruptionError(
                f"is {size} bytes, more than a metadata file holds "
                f"({MAX_METADATA_BYTES}): not a file equeue wrote",
                file=path,
                offset=0,
            )
        return decode_json(raw, path)


# The highest ``"format"`` of a metadata document this version reads (module docstring).
METADATA_FORMAT = 1


def decode_json(raw: bytes, path: Path) -> Any:
    """The body of a metadata file's bytes ``raw``, read from ``path``."""
    try:
        doc = json.loads(raw)
        stored, body = doc["xxh64"], doc["body"]
        computed = xxhash.xxh64_hexdigest(_canonical(body))
    except KeyError as exc:  # valid JSON, but not a metadata file's document
        raise CorruptionError(
            f"unreadable metadata file (no {exc} field)", file=path, offset=0
        ) from exc
    except (ValueError, TypeError) as exc:
        raise CorruptionError(f"unreadable metadata file ({exc})", file=path, offset=0) from exc
    except RecursionError:  # arrays or objects nested past the interpreter's limit
        raise CorruptionError(
            "unreadable metadata file (nested too deeply to decode)", file=path, offset=0
        ) from None
    found = doc.get("format")  # (a dict: it had "body"; none is format 1)
    reads = f"format {METADATA_FORMAT}"
    NewerFormatError.check(
        "metadata format", found, METADATA_FORMAT, file=path, offset=0, reads=reads
    )
    if stored != computed:
        raise ChecksumMismatchError(
            "metadata checksum mismatch",
            file=path,
            offset=0,
            expected=_hex_or_none(stored),
            found=int(computed, 16),
        )
    return body


def _hex_or_none(value: object) -> int | None:
    try:
        return int(str(value), 16)
    except ValueError:
        return None


def remove_temp_files(directory: Path) -> None:
    for entry in directory.glob("*.tmp"):
        check_removable(entry)
        entry.unlink(missing_ok=True)
