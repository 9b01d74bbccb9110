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

# SGLang 0.5.23 for CPU serving: the wheel without its CUDA-only dependencies, then the rest pinned
# (requirements/sglang-cpu.txt), never changing the torch/transformers/xgrammar pins above.
SGL_STAMP := $(VENV)/.sglang-installed
$(SGL_STAMP): $(STAMP) requirements/sglang-cpu.txt requirements/constraints.txt
	$(BIN)/pip install -q --no-deps sglang==0.5.23
	$(BIN)/pip install -q -r requirements/sglang-cpu.txt -c requirements/constraints.txt
	touch $(SGL_STAMP)

sglang: $(SGL_STAMP)

# Serve the bundled model with ENTMTP on this CPU (Ctrl-C stops it).
serve: $(SGL_STAMP)
	SGLANG_USE_CPU_ENGINE=1 $(BIN)/python -m sglang.launch_server --model-path $(MODEL) \
	    --speculative-algorithm ENTMTP --speculative-draft-model-path $(MODEL)/eagle \
	    --device cpu --attention-backend entmtp_torch --disable-cuda-graph --sleep-on-idle \
	    --max-total-tokens 20000 --port 30000

demo: $(STAMP)
	$(BIN)/entmtp generate --prompt 'def fibonacci(n):' --drafter hydra --tree chain:4 --max-new-tokens 64

test: $(STAMP) $(SGL_STAMP)
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

# Calibrate the shipped Medusa and Hydra tree sets (about 7 minutes per drafter on 2 cores).
trees: $(STAMP)
	for d in hydra medusa; do \
	    $(BIN)/entmtp calibrate --drafter $$d --task code,math,chat,prose,json,mixed --prompts 32 --max-new-tokens 96 && \
	    $(BIN)/entmtp calibrate --drafter $$d --task json --grammar --prompts 32 --max-new-tokens 96 || exit 1; done

bench-policies: $(STAMP)
	$(BIN)/python bench/policies.py

.PHONY: install sglang serve demo test test-slow model trees bench-policies
