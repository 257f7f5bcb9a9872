"""The compaction batch: decide survivors (Spark), rewrite chunks, install them atomically."""
