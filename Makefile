# One command does all the set-up and runs the tests on a fresh clone:  make test
#
# Set-up installs torch first (TORCH_SPEC, default the CPU build torch==2.13.0) so that pip never
# resolves a bare `torch` to the multi-GB CUDA wheels; GPU users override it, e.g.
#   make test TORCH_SPEC="torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130"
# or keep the torch they have with  make test TORCH_SPEC= VENV_FLAGS=--system-site-packages
PYTHON ?= python3
VENV ?= .venv
VENV_FLAGS ?=
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
DEMO_ARGS ?=

PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast lint format clean

setup: $(STAMP)

# Triton: a CUDA torch brings its own (kept); on CPU it is installed for the tests, which run the
# `triton` backend's kernels in Triton's interpreter (>= 3.9 works with NumPy 2).
# DeepSpeed ships only an sdist whose setup.py imports torch: it is built without build
# isolation, against the torch installed above (an isolated build would download another torch).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PIP) install --quiet --upgrade pip "setuptools>=77" wheel
	if [ -n "$(strip $(TORCH_SPEC))" ]; then $(PIP) install --quiet $(TORCH_SPEC); fi
	$(PIP) install --quiet --no-build-isolation -e ".[test,eval]"
	$(PY) -c "import triton" 2>/dev/null || $(PIP) install --quiet "triton>=3.9"
	touch $@

# The main job on the embedded demo corpus (CPU is fine): data prep, training, checkpoints.
demo: setup
	$(PY) launchers/pretrain.py --config configs/tiny.yaml $(DEMO_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

test: lint
	$(PY) -m pytest $(PYTEST_ARGS)

# The unit tier only (no multi-process or end-to-end tests).
test-fast: setup
	$(PY) -m pytest -m "not multiprocess and not e2e and not slow" $(PYTEST_ARGS)

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
