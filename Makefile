# Two entry points, each installs what it needs into .venv first:
#   make demo   - 2 local CPU ranks (gloo) train a small model with graphddp
#   make test   - the test suite
#   make bench  - the benchmark (not a test; ARGS="--model mlp" etc.)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch 2.13.0 is what tests pin; an unpinned torch pulls a CUDA build.
TORCH := torch==2.13.0

$(VENV)/.installed-%: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[$*]' '$(TORCH)'
	touch $@

$(VENV)/.installed-base: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e . '$(TORCH)'
	touch $@

# The suite with transformers 4.x (make test installs 5.x, what users get): its own venv.
VENV4 := .venv-tf4
$(VENV4)/.installed: pyproject.toml
	test -x $(VENV4)/bin/python || $(PYTHON) -m venv $(VENV4)
	$(VENV4)/bin/python -m pip install -q -e '.[test-tools]' '$(TORCH)' 'transformers>=4.40,<5'
	touch $@

# One GPU: the GPU lane (tests/gpu: every mode against DDP on CUDA, and the CUDA benchmark's
# memory bounds) with the machine's own Python, whose torch must be a CUDA build (the CPU wheel
# the other targets pin cannot see a GPU); it needs transformers and pytest there. Without CUDA
# every test skips. GRAPHDDP_GPU_OUT names where the benchmark's table goes (bench_out/).
PYTHON_GPU ?= python3

.PHONY: demo test test-transformers4 test-gpu bench
demo: $(VENV)/.installed-base
	$(PY) examples/demo.py

# The unit tests on two pytest workers (pytest-xdist): each runs one process's compiles, about a
# core's work, so two use the cores the multi-rank and end-to-end tests after them use alone.
test: $(VENV)/.installed-test
	$(PY) -m pytest -q -n 2 tests/unit
	$(PY) -m pytest -q --ignore=tests/unit

test-gpu:
	$(PYTHON_GPU) -m pytest -q -p no:cacheprovider -rA tests/gpu

test-transformers4: $(VENV4)/.installed
	$(VENV4)/bin/python -m pytest -q

bench: $(VENV)/.installed-plot
	$(PY) -m tools.bench --out bench_out $(ARGS)
