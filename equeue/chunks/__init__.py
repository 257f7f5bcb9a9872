"""The chunk storage engine: fixed-size chunk files addressed by global position."""

from equeue.chunks.chunk import Chunk
from equeue.chunks.config import ChunkManagerConfig
from equeue.chunks.manager import ChunkManager
from equeue.chunks.reader import ChunkReader
from equeue.chunks.recovery import TailCut
from equeue.chunks.writer import ChunkWriter
from equeue.format.chunk import ChunkFooter, ChunkHeader, ChunkType

__all__ = [
    "Chunk",
    "ChunkFooter",
    "ChunkHeader",
    "ChunkManager",
    "ChunkManagerConfig",
    "ChunkReader",
    "ChunkType",
    "ChunkWriter",
    "TailCut",
]
