"""The documented layouts are the format modules' own tables, so they cannot drift."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import equeue
import equeue.compaction.commit
import equeue.format.chunk
import equeue.format.message
import equeue.format.topicsjournal
from equeue import MessageStore, StoreConfig
from equeue.format.chunk import HEADER_SIZE
from equeue.server import BrokerThread

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_format_doc_holds_every_layout_table() -> None:
    text = (DOCS / "format.md").read_text()
    for module in (
        equeue.format.chunk,
        equeue.format.message,
        equeue.format.topicsjournal,
        equeue.compaction.commit,
    ):
        assert module.__doc__ is not None
        assert module.__doc__.strip() in text, f"docs/format.md is stale for {module.__name__}"


def _python_block(text: str, after: str) -> str:
    """The first ```python block after the line ``after``."""
    rest = text[text.index(after) :]
    start = rest.index("```python\n") + len("```python\n")
    return rest[start : rest.index("```", start)]


def test_compaction_doc_shows_the_real_topic_policy_repr(tmp_path: Path) -> None:
    """Its policy example is run as written (on a temporary store), and the comment after
    ``store.topic_policy("prices")`` must be what that call returns."""
    code = _python_block((DOCS / "compaction.md").read_text(), "## Policy, per topic")
    call = 'store.topic_policy("prices")'
    lines = code.splitlines()
    shown = lines[lines.index(call) + 1]
    assert shown.startswith("# ")
    namespace: dict[str, Any] = {}
    exec(code.replace('"./store"', repr(str(tmp_path / "store"))), namespace)
    store = namespace["store"]
    try:
        assert shown[2:] == repr(store.topic_policy("prices"))
    finally:
        store.close()


def test_readme_names_the_directory_recovery_copies_cut_bytes_to(tmp_path: Path) -> None:
    """A torn tail after the last record of the log is cut at the next open: the copy lands
    where the README says."""
    path = tmp_path / "store"
    config = StoreConfig(chunk_data_size=4096, default_queue_count=1)
    with MessageStore.open(path, config) as store:
        sent = store.send("t", b"kept")
    chunk = next((path / "messages").glob("chunk-*"))
    with open(chunk, "r+b") as f:
        f.seek(HEADER_SIZE + sent.position + 200)  # past the record: a torn write
        f.write(b"torn" * 4)
    with MessageStore.open(path, config) as store:
        assert store.recovery.cuts
    copies = list(path.rglob("*.cut"))
    assert len(copies) == 1
    where = copies[0].parent.relative_to(path).as_posix() + "/"
    assert where == "messages/recovered/"
    readme = " ".join((DOCS.parent / "README.md").read_text().split())
    assert f"copying the cut bytes to `{where}`" in readme


def test_readme_broker_example_runs_as_written() -> None:
    """The README's broker example, run against a real broker on the store's socket."""
    text = (DOCS.parent / "README.md").read_text()
    code = _python_block(text, "## Many processes: the broker")
    home = Path(tempfile.mkdtemp(prefix="eq", dir="/tmp"))
    handled: list[bytes] = []
    try:
        store = home / "orders-store"
        with BrokerThread(store):
            namespace = {"handle": lambda m: handled.append(m.body), "equeue": equeue}
            # the example runs the consumer until stopped: bound it to the one message
            code = code.replace("consumer.run(handle)", "consumer.run(handle, max_messages=1)")
            code = code.replace('"./orders-store"', repr(str(store)))
            exec(compile(code, "README.md", "exec"), namespace)
        assert handled == [b"..."]
    finally:
        shutil.rmtree(home, ignore_errors=True)
