# One command does all the set-up and runs the tests on a fresh clone:  make test
#
# Set-up installs the exact versions CI tested (LOCK, requirements/lock.txt; `make lock`
# refreshes it) and torch first (TORCH_SPEC, default the CPU build torch==2.13.0) so that pip
# never resolves a bare `torch` to the multi-GB CUDA wheels; GPU users override it, e.g.
#   make test TORCH_SPEC="torch==2.11.0 --index-url https://download.pytorch.org/whl/cu130"
# or keep the torch they have with  make test TORCH_SPEC= VENV_FLAGS=--system-site-packages
# (LOCK= installs the newest versions pyproject.toml allows instead of the locked ones).
PYTHON ?= python3
VENV ?= .venv
VENV_FLAGS ?=
TORCH_SPEC ?= torch==2.13.0
LOCK ?= requirements/lock.txt
TRITON_LOCK ?= requirements/triton-cpu.txt
PYTEST_ARGS ?=
# pytest-xdist workers (each file's tests stay on one worker, sharing its fixtures; files in
# collection order, which tests/conftest.py starts with the slow tests); 0: none
PYTEST_WORKERS ?= 2
DEMO_ARGS ?=
COMPAT_ARGS ?=
TORCH_COMPAT_ARGS ?=

PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
CONSTRAINTS := $(if $(strip $(LOCK)),-c $(LOCK))
XDIST := $(if $(filter-out 0,$(PYTEST_WORKERS)),-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder)
# what `make lock` leaves out of the lock: the package itself and the torch build with what
# only a torch build pins (its Triton and CUDA wheels), which stay the GPU user's choice
UNLOCKED := ^(focus-pretrain|torch|triton|pytorch-triton[a-z0-9-]*|nvidia-[a-z0-9-]+|cuda-[a-z0-9-]+)==

.PHONY: setup demo test test-fast test-compat test-torch lint format lock clean

setup: $(STAMP)

# Triton: a CUDA torch brings its own (kept); on CPU it is installed for the tests, which run the
# `triton` backend's kernels in Triton's interpreter (>= 3.9 works with NumPy 2), at the version
# of TRITON_LOCK. DeepSpeed ships only an sdist whose setup.py imports torch: it is built without
# build isolation, against the torch installed above (an isolated build would download another).
$(STAMP): pyproject.toml $(LOCK) $(TRITON_LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV_FLAGS) $(VENV)
	$(PIP) install --quiet $(CONSTRAINTS) --upgrade pip "setuptools>=77" wheel
	if [ -n "$(strip $(TORCH_SPEC))" ]; then $(PIP) install --quiet $(CONSTRAINTS) $(TORCH_SPEC); fi
	$(PY) -c "import triton" 2>/dev/null || $(PIP) install --quiet \
		$(if $(strip $(LOCK)),-r $(TRITON_LOCK),"triton>=3.9")
	$(PIP) install --quiet $(CONSTRAINTS) --no-build-isolation -e ".[test,eval,wandb]"
	touch $@

# The main job on the embedded demo corpus (CPU is fine): data prep, training, checkpoints.
demo: setup
	$(PY) launchers/pretrain.py --config configs/tiny.yaml $(DEMO_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The whole suite on the locked versions, then the HF-facing tests against the lowest and the
# newest supported transformers (tools/hf_compat.py: a small second venv, .venv-compat).
test: lint
	FOCUS_LOCK="$(LOCK)" $(PY) -m pytest $(XDIST) $(PYTEST_ARGS)
	$(MAKE) test-compat
	$(MAKE) test-torch

test-compat: setup
	$(PY) tools/hf_compat.py --torch "$(TORCH_SPEC)" --lock "$(LOCK)" \
		--pytest-args="-q $(XDIST)" $(COMPAT_ARGS)

# The tests marked `torch` (captures, dispatch counts, backends vs the reference) and the shipped
# HF modeling tests again under the lowest torch pyproject.toml allows (the GPU image's), laid over
# the locked environment (tools/torch_compat.py: build/torch-compat/overlay-torch-<version>).
test-torch: setup
	$(PY) tools/torch_compat.py --pytest-args="-q $(XDIST)" $(TORCH_COMPAT_ARGS)

# The unit tier only (no multi-process or end-to-end tests).
test-fast: setup
	$(PY) -m pytest $(XDIST) -m "not multiprocess and not e2e and not slow" $(PYTEST_ARGS)

# Refresh the lock: a fresh venv with the newest versions pyproject.toml allows, frozen into
# requirements/ (run it on a CPU machine, like CI's, so that the CPU Triton is recorded), then the
# whole test suite on it. Commit the new lock only if the tests pass.
lock:
	rm -rf $(VENV) .venv-compat
	$(MAKE) setup LOCK=
	mkdir -p requirements
	{ echo "# Exact versions CI tested (make lock; torch and its CUDA/Triton wheels excluded)."; \
	  $(PIP) freeze --all --exclude-editable | grep -v -i -E '$(UNLOCKED)' | sort -f; } \
		> requirements/lock.txt
	$(PIP) freeze | grep -i -E '^triton==' > $(TRITON_LOCK)
	touch $(STAMP)
	$(MAKE) test

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .venv-compat build *.egg-info .pytest_cache .ruff_cache .hypothesis
