# Two commands on a fresh machine: `make serve` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# GPU boxes: install your CUDA build instead, e.g. make TORCH_SPEC="torch==2.13.0 --index-url <CUDA wheel index>"
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev,serve
STAMP := $(VENV)/.installed-$(EXTRAS)
# A deliberate, persistent inductor cache: the second warm-up on a machine is much faster.
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/inductor

# The playground's browser test drives Debian's Chromium (no browser download: there is no internet).
BROWSER := /usr/bin/chromium /usr/bin/chromedriver
# The alert rules and dashboard queries are checked by Prometheus' own promtool (Debian's prometheus).
PROMTOOL := /usr/bin/promtool
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install lint test test-durations test-full test-families serve clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

install: $(STAMP)

$(BROWSER):
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium chromium-driver

$(PROMTOOL):
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus

# ruff's rules: pyproject.toml [tool.ruff]; ruff itself is pinned in the dev extra.
lint: install
	$(VENV)/bin/ruff check src tests bench

# Two test processes (CI has 2 cores): most of a test's time is compiling, one Python thread each.
# tests/scheduling.py keeps the tests that share a compiled fixture in one process and hands the
# longest sets out first, by tests/durations.json.
TEST_WORKERS ?= 2
test: lint $(BROWSER) $(PROMTOOL)
	$(PY) -m pytest -q -ra --durations=25 -n $(TEST_WORKERS)

# Records tests/durations.json (what tests/scheduling.py orders by) from `make test` in a fresh clone
# of the committed HEAD, the case CI runs (its own .venv and empty compile caches; ~45 min on 2 cores).
# Re-run it when tests are added or moved; tests it does not know are estimated.
DURATIONS_RUN := $(CURDIR)/.cache/durations-run
test-durations:
	rm -rf $(DURATIONS_RUN) && git clone -q $(CURDIR) $(DURATIONS_RUN)
	HOTLORA_STORE_TEST_DURATIONS=$(CURDIR)/tests/durations.json \
		$(MAKE) -C $(DURATIONS_RUN) test TORCHINDUCTOR_CACHE_DIR=$(DURATIONS_RUN)/.cache/inductor
	rm -rf $(DURATIONS_RUN)

# The per-family modules (fused, auto, int8, bf16, formats, mixed batches, the three APIs, Ray) for every family beyond
# flux and sdxl; `make test` runs the correctness contract for all of them. Not part of `make test`.
test-families: install
	$(PY) -m pytest -q -ra -m families tests/integration tests/e2e tests/ray

# The real SDXL architecture served end to end (~15 GB peak in one process, ~40 min on 2 cores; the model is
# built once into .cache/fullsize). Not part of `make test`.
test-full: install
	$(PY) -m pytest -q -ra -m fullsize tests/fullsize

# The HTTP server on the built-in tiny model (built on first use), on 127.0.0.1:8000.
serve: install
	$(VENV)/bin/hotlora serve $(SERVE_ARGS)

clean:
	rm -rf $(VENV) .cache out
