# Two commands do all the set-up on a fresh machine: `make demo` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL := entmtp_sglang/models/entmtp-tiny

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip==25.3
	$(BIN)/pip install -q -e '.[test,bench]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/entmtp generate --prompt 'def fibonacci(n):' --drafter hydra --tree chain:4 --max-new-tokens 64

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# Rebuild the bundled model from scratch (about an hour on 2 cores; never run in CI).
model: $(STAMP)
	$(BIN)/python -c "from pathlib import Path; from entmtp_sglang.training import corpus; \
	corpus.build(Path('runs/corpus'), Path('entmtp_sglang/data/prompts'), Path('runs/wheels'))"
	$(BIN)/python -m entmtp_sglang.training.train --out $(MODEL) --work runs/train \
	    --target-steps 520 --drafter-steps 360 --seed 0
	cp runs/corpus/manifest.json $(MODEL)/data_manifest.json
	$(BIN)/python -m entmtp_sglang.training.evaluate --model $(MODEL)

# Calibrate the shipped tree sets (about 10 minutes per drafter on 2 cores).
trees: $(STAMP)
	for d in medusa hydra; do $(BIN)/entmtp calibrate --drafter $$d --task code,math,chat,prose,json,mixed \
	    --prompts 16 --max-new-tokens 96; done

bench-policies: $(STAMP)
	$(BIN)/python bench/policies.py

.PHONY: install demo test test-slow model trees bench-policies
