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

.PHONY: install lint test test-full test-families serve clean

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
# tests/conftest.py marks each module's tests as one xdist group, meant to keep them in one process
# (their compiled engines are module fixtures). With pytest 9 and xdist 3.8 the marks group nothing:
# xdist names a group by rewriting ``item._nodeid``, which pytest 9 no longer reads, so tests are
# scheduled one by one. Measured from a fresh clone (2 cores, 2026-12-06): one by one 38:57; by module
# (--dist loadfile) 41:57, the contract module's 19 families then on one process at the end.
TEST_WORKERS ?= 2
test: lint $(BROWSER) $(PROMTOOL)
	$(PY) -m pytest -q -ra --durations=25 -n $(TEST_WORKERS) --dist loadgroup

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
