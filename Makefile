# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Each creates the virtual environment on first use, with the exact versions of constraints/locked.txt (`make lock`
# moves them to the newest releases). TORCH_SPEC pins the CPU wheel this
# machine has on disk; on a GPU machine use your own torch (`pip install -e .`).
# `make test` also builds .venv-lowest with the lowest supported transformers/accelerate
# (constraints/lowest.txt) and runs the `lowest` subset there, .venv-lean with the package alone (no extras) for
# the `lean` subset, and .venv-newest with the newest torch this machine has (NEWEST_TORCH_SPEC) for the unit tier
# and one 2 x 2 launch.

VENV ?= .venv
PYTHON := $(VENV)/bin/python
LOWEST_VENV ?= .venv-lowest
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
LOWEST_STAMP := $(LOWEST_VENV)/.installed
LEAN_VENV ?= .venv-lean
LEAN_STAMP := $(LEAN_VENV)/.installed
NEWEST_VENV ?= .venv-newest
NEWEST_TORCH_SPEC ?= torch==2.14.1
NEWEST_STAMP := $(NEWEST_VENV)/.installed
LOCK := constraints/locked.txt
# A locked install that fails says which pin the registry no longer serves, and stops.
EXPLAIN_LOCK = { python3 tools/lock.py explain --venv $(1); exit 1; }
# pip would compile every module of torch and transformers at install time, most of which no test imports; instead
# the first process to import a module compiles it once. That needs bytecode written, so PYTHONDONTWRITEBYTECODE
# (set on some machines) is not passed on: with it, every process of every launch compiles again (1.8x the suite).
PIP_FLAGS ?= --quiet --no-compile
unexport PYTHONDONTWRITEBYTECODE
# What every launch imports, compiled once when its environment is built: a later shell that sets
# PYTHONDONTWRITEBYTECODE then still starts from bytecode.
WARM_IMPORTS := import accelerate.commands.launch, hf_flexdemo.integrations.trainer; from transformers import Trainer

.PHONY: demo test test-unit test-lowest test-lean test-newest venv venvs docs lock

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml $(LOCK)
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install $(PIP_FLAGS) "$(TORCH_SPEC)" -c $(LOCK) || $(call EXPLAIN_LOCK,$(VENV))
	$(PYTHON) -m pip install $(PIP_FLAGS) -e ".[test,bench]" -c $(LOCK) || $(call EXPLAIN_LOCK,$(VENV))
	$(PYTHON) -c "$(WARM_IMPORTS)"
	touch $(STAMP)

$(LOWEST_STAMP): setup.cfg pyproject.toml constraints/lowest.txt
	python3 -m venv $(LOWEST_VENV)
	$(LOWEST_VENV)/bin/python -m pip install $(PIP_FLAGS) "$(TORCH_SPEC)"
	$(LOWEST_VENV)/bin/python -m pip install $(PIP_FLAGS) -e ".[test]" -c constraints/lowest.txt
	$(LOWEST_VENV)/bin/python -c "$(WARM_IMPORTS)"
	touch $(LOWEST_STAMP)

# The package alone (`pip install -e .`: torch, transformers, accelerate), as a user of the optimizer installs it.
$(LEAN_STAMP): setup.cfg pyproject.toml $(LOCK)
	python3 -m venv $(LEAN_VENV)
	$(LEAN_VENV)/bin/python -m pip install $(PIP_FLAGS) "$(TORCH_SPEC)" -c $(LOCK) || $(call EXPLAIN_LOCK,$(LEAN_VENV))
	$(LEAN_VENV)/bin/python -m pip install $(PIP_FLAGS) -e . "pytest>=8" -c $(LOCK) || $(call EXPLAIN_LOCK,$(LEAN_VENV))
	$(LEAN_VENV)/bin/python -c "$(WARM_IMPORTS)"
	touch $(LEAN_STAMP)

# The newest releases on purpose, ignoring the lock: the newest torch (2.14.1: its CUDA build from this machine's
# files, which runs on CPU, with its own Triton), then the extras with torch named again, so that pip keeps it.
$(NEWEST_STAMP): setup.cfg pyproject.toml
	python3 -m venv $(NEWEST_VENV)
	$(NEWEST_VENV)/bin/python -m pip install $(PIP_FLAGS) "$(NEWEST_TORCH_SPEC)"
	$(NEWEST_VENV)/bin/python -m pip install $(PIP_FLAGS) -e ".[test,bench]" "$(NEWEST_TORCH_SPEC)"
	$(NEWEST_VENV)/bin/python -c "$(WARM_IMPORTS)"
	touch $(NEWEST_STAMP)

# T5 translation, offline preset, 2 simulated nodes x 2 processes on this machine's CPU.
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/accelerate launch --config_file accelerate_configs/cpu_2x2.yaml \
		training_scripts/train_t5.py --preset offline

# The unit tier's tests are one process each, most of them one thread: two at a time on two cores (pytest-xdist).
# Every other test starts processes of its own and runs alone.
UNIT_WORKERS ?= 2

# The four environments install two at a time: unpacking wheels is one core's work each.
test: venvs
	$(MAKE) test-lowest test-lean test-newest test-unit
	$(PYTHON) -m pytest -q --durations=30 -m "not lean and not unit"
	$(PYTHON) tools/lock.py newer --venv $(NEWEST_VENV)

# The lock moved to the newest releases (a fresh venv, a few minutes), and docs/getting-started.md's table with it.
lock:
	python3 tools/lock.py refresh

venvs:
	$(MAKE) -j2 $(STAMP) $(LOWEST_STAMP) $(LEAN_STAMP) $(NEWEST_STAMP)

test-unit: $(STAMP)
	$(PYTHON) -m pytest -q -m unit -n $(UNIT_WORKERS)

test-lowest: $(LOWEST_STAMP)
	$(LOWEST_VENV)/bin/python -m pytest -q -m lowest

# The unit tier, and one 2 x 2 launch of a user's own Trainer script (tests/test_user_script.py).
test-newest: $(NEWEST_STAMP)
	$(NEWEST_VENV)/bin/python -c 'import torch; print("torch", torch.__version__)'
	$(NEWEST_VENV)/bin/python -m pytest -q -p no:cacheprovider -m unit -n $(UNIT_WORKERS)
	$(NEWEST_VENV)/bin/python -m pytest -q -p no:cacheprovider -m multiprocess tests/test_user_script.py

test-lean: $(LEAN_STAMP)
	FLEXDEMO_LEAN_VENV=1 $(LEAN_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_lean_install.py

# The documentation site (mkdocs.yml, docs/) into site/; --strict fails on a broken link or a page left out of the nav.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --site-dir site
