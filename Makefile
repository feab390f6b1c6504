# Two commands work on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-slow test-all lint bench gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	# megatron-core, the reference for Megatron interop tests: 0.19.2 (the version the interop was written
	# against) declares Python >= 3.12 but ships a cp311 wheel that works here; --no-deps keeps torch pinned.
	$(PY) -m pip install --quiet --no-deps --ignore-requires-python megatron-core==0.19.2
	touch $(STAMP)

# The embedded corpus (CPython stdlib sources) -> a BPE tokenizer -> an indexed dataset, built once.
DATA := runs/data
$(DATA)/stdlib.jsonl: $(STAMP)
	$(PY) -m meshtron corpus stdlib --output $@
$(DATA)/tokenizer/tokenizer.json: $(DATA)/stdlib.jsonl
	$(PY) -m meshtron tokenizer train --input $< --vocab-size 4096 --output $(DATA)/tokenizer
$(DATA)/stdlib.idx: $(DATA)/tokenizer/tokenizer.json
	$(PY) -m meshtron preprocess --input $(DATA)/stdlib.jsonl --json-key text --tokenizer $(DATA)/tokenizer \
		--output-prefix $(DATA)/stdlib --workers 2 --append-eod --no-progress

# --checkpoint.load auto: a second `make run` resumes runs/tiny (already finished: it only generates)
# instead of being refused for training into a run directory that holds a run.
run: $(STAMP) $(DATA)/stdlib.idx
	$(PY) -m meshtron train --config configs/tiny.yaml --checkpoint.load auto
	$(PY) -m meshtron generate --checkpoint runs/tiny/checkpoints --prompt "def " --max-new-tokens 120 --temperature 0.8 --top-k 40 --seed 0

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q

test-slow: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m slow

test-all: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m "slow or not slow"

lint: $(STAMP)
	$(PY) -m ruff check meshtron tests benchmarks

bench: $(STAMP)
	$(PY) -m meshtron bench train

# On one GPU, under 10 minutes: environment, kernels, host syncs, bf16 parity, MFU, graphs, ... (JSON + table);
# without CUDA it prints one line and exits 0.
gpu-check: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m meshtron.bench.gpu_check

clean:
	rm -rf $(VENV) runs .pytest_cache
