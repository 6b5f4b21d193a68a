# Yuxi sessions. `make help` lists the targets; `make run` starts everything.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help setup system-packages run test bench db-init worker serve clean

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) \
		| awk 'BEGIN {FS = ":.*## "}; {printf "  %-10s %s\n", $$1, $$2}'

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

bench: setup ## run the benchmarks
	$(BIN)/python -m benchmarks.run

db-init: setup ## create the database of YUXI_DATABASE_URL and install the schema
	$(BIN)/yuxi db init

worker: setup ## run one Procrastinate worker
	$(BIN)/yuxi worker

serve: setup ## run the HTTP API
	$(BIN)/yuxi serve

clean: ## remove .venv and caches (keeps .yuxi, the embedded database)
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
	find . -path ./.yuxi -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
