# Two commands work on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-all lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m meshtron train --config configs/tiny.yaml
	$(PY) -m meshtron generate --checkpoint runs/tiny/checkpoints --prompt "def " --max-new-tokens 200 --temperature 0.8 --top-k 40 --seed 0

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

test-all: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m "slow or not slow"

lint: $(STAMP)
	$(PY) -m ruff check meshtron tests benchmarks

bench: $(STAMP)
	$(PY) -m meshtron bench train

clean:
	rm -rf $(VENV) runs .pytest_cache
