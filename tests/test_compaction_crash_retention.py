"""A compaction job killed after its commit point, beside a writer whose retention then
runs (review18 R18-1). The job's manifest names replacements of the oldest chunks; the
writer's retention removed those chunks (the job's lock was gone with it, and retention
adopted only what an `installed` marker announced), and the next recovery installed the
replacements: the records retention removed came back, below a gap every open refused
(MissingChunkError). Now retention installs a committed job first, then adopts, then
removes. The control: a job killed before its commit point is discarded."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import pytest
from compaction_crash_child import forked

from equeue import MessageStore, StoreConfig
from equeue.chunks.stream import ChunkFile
from equeue.compaction import commit
from equeue.compaction.rewrite import rewrite_group

SIZE = 8 * 1024
LATER = 7200  # seconds: apply_retention's `now` ahead, past every chunk's hour
CONFIG = StoreConfig(chunk_data_size=SIZE, flush="os")


def _chunks(path: Path) -> list[str]:
    return sorted(p.name for p in (path / "messages").glob("chunk-*"))


def _kill_call(lines: list[str], where: str) -> int:
    calls = [line for line in lines if line.startswith("CALL")]
    if where == "manifest":
        chosen = [c for c in calls if c.split("->")[-1].strip().endswith("manifest.json")]
    elif where == "second rename":
        chosen = [c for c in calls if " rename " in c and "/messages/" in c.split("->")[-1]][1:]
    else:  # "before the manifest": the last call before it
        at = next(i for i, c in enumerate(calls) if c.split("->")[-1].strip().endswith(".json"))
        chosen = [calls[at - 1]]
    return int(chosen[0].split()[1])


@pytest.mark.parametrize("where", ["manifest", "second rename", "before the manifest"])
def test_retention_after_a_job_killed_mid_install_leaves_an_openable_store(
    tmp_path: Path, where: str
) -> None:
    path = tmp_path / "store"
    with MessageStore.open(path, CONFIG) as store:
        store.create_topic("d", 1)
        for i in range(1000):
            store.send("d", f"plain {i:05d}".encode() + b"x" * 60)
    names = _chunks(path)
    assert len(names) > 10
    writer = MessageStore.open(path, dataclasses.replace(CONFIG, retention=dt.timedelta(hours=1)))
    try:
        staging = commit.new_staging(path)
        results = [
            rewrite_group([ChunkFile.open(path / "messages" / name, None)], [], staging, 1)
            for name in names[:6]
        ]
        job = tmp_path / "job.json"
        job.write_text(json.dumps({"results": [asdict(r) for r in results], "read": names[:6]}))
        probe = tmp_path / "probe"  # the calls of a whole install, on a copy
        shutil.copytree(path, probe)
        code, lines = forked(
            [str(probe), str(probe / "compaction" / staging.name), str(job), "never", "0"]
        )
        assert code == 0 and lines[-1] == "DONE", lines
        kill = _kill_call(lines, where)
        code, _ = forked([str(path), str(staging), str(job), "after", str(kill)])
        assert code == -9
        assert writer.apply_retention(now=time.time() + LATER) > 0
        left = _chunks(path)
    finally:
        writer.close()
    assert left == [names[-1]], left  # retention's: the replacements went too
    for read_only in (True, False):  # before: MissingChunkError, both
        with MessageStore.open(path, CONFIG, read_only=read_only) as opened:
            first, end = opened.queue_range("d", 0)
            assert end == 1000
            [message] = opened.pull("d", 0, first, max_count=1).messages
            assert message.body.startswith(f"plain {first:05d}".encode())
    assert _chunks(path) == [names[-1]]
