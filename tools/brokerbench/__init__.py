"""tools/bench_broker.py's parts: the servers it starts, the producer and consumer processes
it drives, and its report."""
