# Every target works on a fresh machine with Python 3.10+, PostgreSQL and Redis running.
# Addresses and paths come from FT_* variables (docs/configuration.md); the defaults suit one machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo up worker migrate test lint compose-check clean soak

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first: the project's torch range then installs nothing bigger.
	$(PY) -m pip install -q "torch==2.13.0" || $(PY) -m pip install -q "torch>=2.4,<2.15"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

## DeepSpeed's ops are compiled here, not inside the first job (see worker/prebuild.py). Which ops this machine
## can build changes with no file here changing (libaio-dev installed after the first install makes NVMe
## offload's op buildable), so every install compares the ops folder's manifest with what can be built now and
## builds only what is missing: a few seconds when nothing is.
install: $(STAMP)
	$(PY) -m worker.prebuild

## Set up everything, start the stack and run a demo fine-tune end to end.
demo: install
	$(PY) -m scripts.demo

## Run the stack in the foreground: API (127.0.0.1:8000), control plane and one worker.
up: install
	$(PY) -m scripts.stack

## Start one more node's worker against a running stack (how a GPU node joins): FT_NODE_NAME (one per worker;
## the default, the host name, is `make up`'s on this host, e.g. FT_NODE_NAME=gpu-2 make worker: a worker under
## a name a live worker holds refuses to start), FT_NODE_SLOTS (default: its GPUs, 2 on a CPU-only node),
## FT_QUEUES (the queues it serves).
worker: install
	$(PY) -m worker

migrate: install
	$(PY) -c "from api.settings import get_settings; from scripts.stack import database_exists_or_create as c; c(get_settings().database_url)"
	$(PY) -m alembic upgrade head

lint: install
	$(VENV)/bin/ruff check .

## The whole test suite: lint, then every test against real Postgres, Redis, Celery and the launcher.
## Two pytest-xdist workers, a test file each at a time: each is a session of its own (database, Redis
## database, stack), and most of a test's time is waiting on processes it started, which the other overlaps.
test: install lint
	$(PY) -m pytest -p no:cacheprovider -n 2 --dist loadfile

## A seeded chaos soak (docs/guarantees.md#the-soak): the stack on its own Postgres, Redis and store under a steady
## workload while a nemesis faults every part of it for MINUTES; the same SEED replays the same faults; OVERLAP (0-1)
## is the share of faults joined by a second one while they hold, and AT_ONCE (2 or more) the most that hold together.
## It prints `violations: N` and fails when N > 0.
MINUTES ?= 3
SEED ?= 1
OVERLAP ?= 0
AT_ONCE ?= 2
soak: install
	$(PY) -m soak --minutes $(MINUTES) --seed $(SEED) --overlap $(OVERLAP) --at-once $(AT_ONCE)

clean:
	rm -rf var
