# Two commands on a fresh machine: `make serve` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# GPU boxes: install your CUDA build instead, e.g. make TORCH_SPEC="torch==2.13.0 --index-url <CUDA wheel index>"
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= dev
STAMP := $(VENV)/.installed-$(EXTRAS)
# A deliberate, persistent inductor cache: the second warm-up on a machine is much faster.
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/inductor
TINY ?= .cache/tiny-flux

.PHONY: install test serve clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

install: $(STAMP)

test: install
	$(PY) -m pytest -q -ra

# Until the HTTP server lands: build the tiny model once and generate a pack with two adapters.
serve: install
	@test -f $(TINY)/model_index.json || $(VENV)/bin/hotlora tiny-model $(TINY) --family flux
	$(VENV)/bin/hotlora generate --model $(TINY) \
		--lora identity=$(TINY)/adapters/identity-diffusers:0.8 \
		--lora style=$(TINY)/adapters/style-kohya.safetensors:1.0 \
		--prompt "a portrait in watercolor" -n 6 --batch-size 3 --seed 0 --out out/serve

clean:
	rm -rf $(VENV) .cache out
