"""The documented layouts are the format modules' own tables, so they cannot drift."""

from __future__ import annotations

from pathlib import Path

import equeue.compaction.commit
import equeue.format.chunk
import equeue.format.message

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_format_doc_holds_every_layout_table() -> None:
    text = (DOCS / "format.md").read_text()
    for module in (equeue.format.chunk, equeue.format.message, equeue.compaction.commit):
        assert module.__doc__ is not None
        assert module.__doc__.strip() in text, f"docs/format.md is stale for {module.__name__}"
