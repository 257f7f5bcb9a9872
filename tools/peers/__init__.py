"""The parts of tools/bench_peers.py, which is the command line: the peer stores, the
scenarios, the cases a child process runs, the runner, the report, the charts and the
metadata of a run."""
