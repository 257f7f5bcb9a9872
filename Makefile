# Everything a fresh machine needs (Python 3.11 + pip) is installed from here.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: all install test lint typecheck demo pipeline bench bench-redis clean check-java

all: test

# setup.py builds the C accelerator (equeue/cext/) in place; a changed C file rebuilds it.
$(STAMP): pyproject.toml setup.py $(wildcard equeue/cext/*.c equeue/cext/*.h)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,spark,bench]'
	# Bytecode, as pip writes for a wheel: an editable install gets none where the
	# environment sets PYTHONDONTWRITEBYTECODE, and every process compiles from source.
	$(PY) -m compileall -q equeue
	touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check equeue tests tools
	$(VENV)/bin/ruff format --check equeue tests tools
	$(VENV)/bin/mypy

# bench-redis: tests/test_bench_broker.py runs the Redis Streams side where it can.
# --durations: every run's log names its slowest tests (the suite's time is watched).
# TEST_WORKERS=N: N pytest-xdist worker processes (--dist loadgroup: tests/conftest.py
# keeps the tests of one shared set-up, the SparkSession or a module-scoped fixture, on
# one worker). Half a serial run's wall time is waiting (fsyncs, children, brokers), which
# workers overlap; see docs/testing.md for the runs. TEST_WORKERS=0 runs serially.
TEST_WORKERS ?= 3
PARALLEL := $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadgroup)
test: lint bench-redis
	$(PY) -m pytest -q $(PARALLEL) --durations=30

# The demo's last steps run Spark, which needs Java: say so before anything starts.
# (equeue compact checks the version itself: 17 or newer.)
check-java:
	@if [ -n "$$JAVA_HOME" ]; then java="$$JAVA_HOME/bin/java"; else java=$$(command -v java); fi; \
	if [ -z "$$java" ] || [ ! -x "$$java" ]; then \
		echo "make demo: the demo compacts its store with Spark, which needs Java 17:" \
			"no java on PATH, and JAVA_HOME is unset or has no bin/java." \
			"Install it (apt install openjdk-17-jre-headless) or set JAVA_HOME;" \
			"without Java, '$(PY) tools/demo.py ./demo-store' runs the rest." >&2; \
		exit 1; \
	fi

demo: check-java $(STAMP)
	$(PY) tools/demo.py ./demo-store
	$(VENV)/bin/equeue compact ./demo-store --master 'local[2]'
	$(VENV)/bin/equeue verify ./demo-store

# Orders stream from a producer process through a Structured Streaming query into
# per-minute Parquet, with compaction beside it, for about 30 s on local[2].
pipeline: check-java $(STAMP)
	$(PY) tools/pipeline_example.py --seconds 30

# tools/bench_broker.py's peer, Redis Streams: Debian's redis-server, installed where
# missing and possible (root, or sudo without a password); else the tool skips its rows.
bench-redis:
	@command -v redis-server >/dev/null 2>&1 || \
	{ if [ "$$(id -u)" = 0 ]; then sudo=; else sudo="sudo -n"; fi; \
	  { $$sudo apt-get install -y -qq redis-server || \
	    { $$sudo apt-get update -qq && $$sudo apt-get install -y -qq redis-server; }; \
	  } >/dev/null 2>&1; } || \
	echo "make: redis-server is not installed and could not be (apt-get install" \
		"redis-server): tools/bench_broker.py and its tests skip the Redis rows" >&2

bench: $(STAMP) bench-redis
	$(PY) tools/bench_chunks.py
	$(PY) tools/bench_store.py
	$(PY) tools/bench_durable.py
	$(PY) tools/bench_peers.py
	$(PY) tools/bench_compaction.py --markdown
	$(PY) tools/bench_spark_source.py
	$(PY) tools/bench_broker.py --markdown -

clean:
	rm -rf $(VENV) demo-store .mypy_cache .pytest_cache .ruff_cache build equeue/*.so
