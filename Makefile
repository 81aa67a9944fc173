# Two commands: `make train` (set up, then the default debug run on the embedded corpus) and `make test`.
# ARGS goes to the training command, after the shipped config (its flags override the config's block):
#   make train ARGS="--max_steps 100 --output_dir runs/x"
#
# torch is installed first, pinned: pip takes a CPU build of 2.13.0 where one is on its path (a local wheel or
# index), and PyPI's 2.13.0 wheel, a CUDA build, elsewhere. For a small CPU build from PyTorch's own index:
#   make train TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
ARGS ?=
BIN := $(VENV)/bin
# DeepSpeed JIT-builds a few ops on first use; keep them with this checkout's virtualenv, so that two
# checkouts (or two virtualenvs) never rebuild over each other's cache.
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch_extensions

.PHONY: setup train test golden lint clean gpu-check slurm-deps

setup: $(VENV)/.installed $(VENV)/.ops

$(VENV)/.installed: setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e ".[dev,logging]"
	touch $@

# DeepSpeed's ops that the shipped configs use (CPU Adam, FusedAdam, the CPU's collectives), compiled once into
# TORCH_EXTENSIONS_DIR, so that no test and no first run waits minutes for a compile (BENCHMARKS.md, ops-build:cpu).
$(VENV)/.ops: $(VENV)/.installed
	$(BIN)/python -m adaptive_ds.tools.build_ops
	touch $@

train: setup
	$(BIN)/deepspeed launchers/train.py --ds_config ds_configs/debug_cpu.json $(ARGS)

# Two pytest workers more than the logical CPUs this process may use (at most 8): the end-to-end tests spend part of
# their time waiting on something other than a CPU (a scheduler, a collective timeout, a launcher's restart), which
# the extra workers fill. Each worker and its subprocesses get their share of the CPUs' threads (tests/conftest.py).
# worksteal evens out the long end-to-end tests.
TEST_WORKERS ?= $(shell $(PYTHON) -c "import os; print(min(8, len(os.sched_getaffinity(0)) + 2))")
test: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal -m "not golden"

# Slurm and munge from Debian's packages, for the tests that run a job on a one-node Slurm of this machine
# (tests/integration/test_slurm.py): installed once, as root with apt-get; where they cannot be, it says why and those
# tests skip. CI runs it before `make test`.
SLURM_PROGRAMS := slurmctld slurmd sbatch munged
slurm-deps:
	@missing=; for program in $(SLURM_PROGRAMS); do command -v $$program >/dev/null || missing=$$program; done; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
		echo "slurm-deps: installing slurm-wlm and munge needs root and apt-get; the Slurm tests will skip"; \
	else \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			slurm-wlm munge >/dev/null \
		|| echo "slurm-deps: apt-get could not install slurm-wlm and munge; the Slurm tests will skip"; \
	fi

# The recorded losses, bit for bit (tests/fixtures/golden_losses.json): a change to the training wing keeps them.
golden: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal -m golden

# The GPU acceptance run (docs/hardware.md, "GPU acceptance"); a dry run of every stage on a machine without CUDA.
gpu-check: setup
	$(BIN)/python -m adaptive_ds.tools.acceptance

lint: setup
	$(BIN)/ruff check adaptive_ds launchers tests

clean:
	rm -rf $(VENV) *.egg-info
