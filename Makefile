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

.PHONY: demo test test-transformers4 bench
demo: $(VENV)/.installed-base
	$(PY) examples/demo.py

test: $(VENV)/.installed-test
	$(PY) -m pytest -q

test-transformers4: $(VENV4)/.installed
	$(VENV4)/bin/python -m pytest -q

bench: $(VENV)/.installed-plot
	$(PY) -m tools.bench --out bench_out $(ARGS)
