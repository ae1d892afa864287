# make demo: set up (once) and train the built-in demo.  make test: set up (once) and run the tests.
PYTHON ?= python3
VENV ?= .venv
# A CPU build keeps set-up small; on a GPU machine pass TORCH_SPEC=torch (or install your own).
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
# --no-compile: byte-compiling torch, transformers and ray up front takes about a minute of a
# 2-core set-up; Python compiles the modules a run imports when it first needs them instead.

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --no-compile "$(TORCH_SPEC)" -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tba train

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

bench: $(STAMP)
	$(VENV)/bin/python benchmarks/bench_buffer.py

clean:
	rm -rf $(VENV) runs
