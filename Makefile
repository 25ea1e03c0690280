# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Each creates the virtual environment on first use. TORCH_SPEC pins the CPU wheel this
# machine has on disk; on a GPU machine use your own torch (`pip install -e .`).

VENV ?= .venv
PYTHON := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test venv

venv: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet "$(TORCH_SPEC)"
	$(PYTHON) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

# T5 translation, offline preset, 2 simulated nodes x 2 processes on this machine's CPU.
demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/accelerate launch --config_file accelerate_configs/cpu_2x2.yaml \
		training_scripts/train_t5.py --preset offline

test: $(STAMP)
	$(PYTHON) -m pytest -q
