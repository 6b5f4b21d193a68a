# Yuxi sessions. `make help` lists the targets; `make run` starts everything.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help setup system-packages run test bench bench-scale bench-peers bench-storage bench-latency bench-all chaos db-init worker serve clean

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) \
		| awk 'BEGIN {FS = ":.*## "}; {printf "  %-13s %s\n", $$1, $$2}'

# Reinstall only when pyproject.toml changed since the last install.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test]'
	@touch $@

# The web UI's npm packages (only when the lock file changed) and its bundle
# (web/dist/app.js, not minified) whenever a source changed.
WEB_STAMP := web/node_modules/.installed
$(WEB_STAMP): web/package-lock.json
	cd web && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

web/dist/app.js: $(WEB_STAMP) web/build.mjs $(wildcard web/src/*.js)
	cd web && node build.mjs

setup: system-packages $(STAMP) web/dist/app.js ## create .venv, install the project and build the web UI (only when needed)

# The confined sandbox needs bubblewrap (and slirp4netns for
# YUXI_SANDBOX_NETWORK=outbound), the browser tests Debian's chromium, the
# web UI node/npm, and the connection-pooling test pgbouncer
# (docs/scale-out.md); as root on Debian they are installed here, elsewhere
# the missing ones are named (the sandbox tools refuse to run without them:
# docs/sandbox.md).
SYSTEM_PACKAGES := bwrap:bubblewrap slirp4netns:slirp4netns chromium:chromium npm:npm \
	pgbouncer:pgbouncer
system-packages:
	@missing=""; for pair in $(SYSTEM_PACKAGES); do \
		command -v $${pair%%:*} >/dev/null || missing="$$missing $${pair#*:}"; done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing$$missing"; apt-get update -qq && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
		else echo "yuxi: please install$$missing (the sandbox, the web UI and its browser tests need them)"; fi; fi

run: setup ## set up the database (embedded if none) and run the API and a worker
	$(BIN)/yuxi dev

test: setup ## run the tests (PYTEST_ARGS="-k name" to select)
	$(BIN)/pytest -q $(PYTEST_ARGS)

bench: setup ## run the benchmarks (the headline: system vs direct graph)
	$(BIN)/python -m benchmarks.run

bench-scale: setup ## queries at scale: 10k and 100k sessions, plans, p50/p99 (~2-4 min)
	$(BIN)/python -m benchmarks.scale $(BENCH_ARGS)

# The peer system (DBOS Transact, from PyPI) is the optional `bench` extra.
BENCH_STAMP := $(VENV)/.installed-bench
$(BENCH_STAMP): pyproject.toml $(STAMP)
	$(BIN)/pip install -q -e '.[test,bench]'
	@touch $@

bench-peers: setup $(BENCH_STAMP) ## the peers' workload through Yuxi and through DBOS 3.4 (~1 min)
	$(BIN)/python -m benchmarks.peers $(BENCH_ARGS)

bench-storage: setup ## bytes per turn of a 1,000-turn session (~30 s)
	$(BIN)/python -m benchmarks.storage $(BENCH_ARGS)

bench-latency: setup ## fan-out of 64 children and its floor (a lone chain), wake p50/p99, SSE fan-in to 500 subscribers (~2.5 min)
	$(BIN)/python -m benchmarks.latency $(BENCH_ARGS)

bench-all: bench bench-scale bench-peers bench-storage bench-latency ## every benchmark, one after the other (~7-10 min on 2 vCPUs)

chaos: setup ## kill workers and APIs, restart PostgreSQL, terminate backends during a fan-out; report losses
	$(BIN)/python -m benchmarks.chaos

db-init: setup ## create the database of YUXI_DATABASE_URL and install the schema
	$(BIN)/yuxi db init

worker: setup ## run one Procrastinate worker
	$(BIN)/yuxi worker

serve: setup ## run the HTTP API
	$(BIN)/yuxi serve

clean: ## remove .venv and caches (keeps .yuxi, the embedded database)
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
	find . -path ./.yuxi -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
