# Yuxi sessions. `make help` lists the targets; `make run` starts everything.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.DEFAULT_GOAL := help
.PHONY: help setup run test bench chaos db-init worker serve clean

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) \
		| awk 'BEGIN {FS = ":.*## "}; {printf "  %-10s %s\n", $$1, $$2}'

# Reinstall only when pyproject.toml changed since the last install.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test]'
	@touch $@

setup: $(STAMP) ## create .venv and install the project (only when needed)

run: setup ## set up the database (embedded if none) and run the API and a worker
	$(BIN)/yuxi dev

test: setup ## run the tests (PYTEST_ARGS="-k name" to select)
	$(BIN)/pytest -q $(PYTEST_ARGS)

bench: setup ## run the benchmarks
	$(BIN)/python -m benchmarks.run

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
