# One-command entry points; every target sets up first (idempotent, seconds when done).
VENV ?= $(CURDIR)/.venv
PY := $(VENV)/bin/python
NP ?= 2

.PHONY: setup run run-mpi test test-fast doctor clean

setup:
	HPCTRAIN_VENV=$(VENV) bash modules/install.sh

run: setup
	$(PY) -m hpctrain train

run-mpi: setup
	OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
	  mpirun -n $(NP) --oversubscribe $(PY) -m hpctrain train --strategy ddp

test: setup
	$(PY) -m pytest -q tests

# The edit loop: every test that needs no mpirun and no SLURM (markers in pyproject.toml).
test-fast: setup
	$(PY) -m pytest -q -m "not mpi and not slurm" tests

doctor: setup
	$(PY) -m hpctrain doctor

clean:
	rm -rf $(VENV) hpctrain-out .pytest_cache
