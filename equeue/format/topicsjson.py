"""The head of ``topics.json``: the generation of the fold that wrote it, checksummed.

topics.json is a metadata file (equeue/atomicfile.py: ``{"body": ..., "xxh64": ...}``,
the hash over the body only). A writer's fold puts two fields before ``"body"``::

    {"generation": 7, "generation_xxh32": "f6dd0489", "body": {...}, "xxh64": "..."}

``generation_xxh32`` is the xxh32 (hex, 8 digits) of ``b"generation 7"``. The generation
decides whether topics.journal is replayed (equeue/store/topicsfile.py: not when its
generation is below the file's), so a damaged one would drop the journal's topic changes
without a word, the body's checksum being fine: a head whose generation does not match
its checksum, or that is neither of the forms below, is a CorruptionError naming the file
and the field. Still read: a file without a generation (``{"body": ...``: an older
equeue's; generation 0: this one's writer folds it at its first topic change, and a
journal of generation 1 or more with records beside one is refused,
equeue/store/topicsfile.py), and the head the version before this one wrote,
``{"generation": 7, "body": ...`` (no checksum to check).
Readers that ignore the new field (that version, ``read_json``) read the file as before.
"""

from __future__ import annotations

import re
from typing import Final

import xxhash

from equeue.errors import ChecksumMismatchError, CorruptionError
from equeue.format.topicsjournal import TOPICS_JOURNAL_FILE

# One fold per topic change at most: a writer never gets near.
MAX_GENERATION: Final = 1 << 63
# Enough bytes for either head: 20 digits of generation and the checksum field.
HEAD_BYTES: Final = 96
_CHECKED: Final = re.compile(
    rb'\{"generation": (\d{1,20}), "generation_xxh32": "([0-9a-f]{8})", "body": '
)
_UNCHECKED: Final = re.compile(rb'\{"generation": (\d{1,20}), "body": ')
_NONE: Final = b'{"body": '
_FORMAT: Final = b'{"format": '
_KEY: Final = re.compile(rb'\{"[^"\\]{0,40}": ')  # a JSON object's first key
_REMEDY: Final = (
    "restore topics.json, or move it out of the store: the open then rebuilds the topics "
    f"from the queue directories and replays {TOPICS_JOURNAL_FILE} over them"
)


def _bounded(generation: int, file: str) -> int:
    """CorruptionError for a generation no writer reaches (one a fold would overflow: the
    journal's header holds it as a u64)."""
    if generation >= MAX_GENERATION:
        raise CorruptionError(
            f"topics.json's field generation is {generation}, past {MAX_GENERATION}: no "
            f"fold writes that many; {_REMEDY}",
            file=file,
            offset=0,
        )
    return generation


def _check(generation: int) -> str:
    return f"{xxhash.xxh32_intdigest(b'generation %d' % generation):08x}"


def pack_head(generation: int) -> str:
    """The text topics.json starts with, up to ``"body": `` (``{`` for generation 0)."""
    if not generation:
        return "{"
    return f'{{"generation": {generation}, "generation_xxh32": "{_check(generation)}", '


def without_generation(head: bytes) -> bool:
    """Whether topics.json's first bytes ``head`` are those of a file written with no
    generation: by an equeue before the journal (``write_json``), or the first with it.
    This equeue's writers never write one (their folds start at generation 1)."""
    return head.startswith(_NONE)


def read_generation(head: bytes, file: str) -> int:
    """The generation topics.json's first bytes ``head`` name (0: none, or bytes that are
    no JSON head at all: the file's own read reports those). CorruptionError naming
    ``file`` and the field if the head names a generation that does not check out."""
    checked = _CHECKED.match(head)
    if checked is not None:
        generation = int(checked[1])
        if _check(generation) != checked[2].decode():
            raise ChecksumMismatchError(
                f"topics.json's field generation ({generation}) does not match its "
                f"generation_xxh32: a damaged generation decides whether {TOPICS_JOURNAL_FILE} "
                f"is replayed; {_REMEDY}",
                file=file,
                offset=checked.start(1),
                expected=int(checked[2], 16),
                found=int(_check(generation), 16),
            )
        return _bounded(generation, file)
    unchecked = _UNCHECKED.match(head)
    if unchecked is not None:
        return _bounded(int(unchecked[1]), file)
    if head.startswith(_NONE) or head.startswith(_FORMAT) or _KEY.match(head) is None:
        return 0  # (a newer format's: the file's own read refuses it, equeue/atomicfile.py)
    raise CorruptionError(
        f"topics.json's field generation is damaged (its head is {head[:48]!r}, neither "
        f'{{"generation": N, "generation_xxh32": H, "body": ...}} nor {{"body": ...}}); '
        f"{_REMEDY}",
        file=file,
        offset=0,
    )
