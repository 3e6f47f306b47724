# The two set-up commands of the README: `make demo` and `make test`.
# Both create the virtualenv on a fresh machine.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec

# Chainer 7.8.1 is an sdist whose setup.py and `import chainer` need
# pkg_resources, which setuptools 82 removed: hold setuptools<81 for the
# build (PIP_BUILD_CONSTRAINT) and at run time (PIP_CONSTRAINT).
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export PIP_BUILD_CONSTRAINT := $(CURDIR)/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# Open MPI 5 inside containers: allow root and more ranks than cores.
# Users of a real cluster never need these.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export PRTE_MCA_rmaps_default_mapping_policy := :oversubscribe
export OMPI_MCA_btl_vader_single_copy_mechanism := none
export PYTHONUNBUFFERED := 1

.PHONY: venv test test-fast test-mpi demo clean

venv: $(VENV)/.installed

$(VENV)/.installed: requirements.txt constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --no-cache-dir -r requirements.txt
	touch $@

# Single-process tests, then the distributed ones under mpiexec -n 1..4.
test: venv
	$(PY) -m pytest -q -m "not mpi" tests
	$(PY) -m tests.run_mpi --mpiexec $(MPIEXEC)

test-fast: venv
	$(PY) -m pytest -q -m "not mpi and not slow" tests

test-mpi: venv
	$(PY) -m tests.run_mpi --mpiexec $(MPIEXEC)

demo: venv
	$(MPIEXEC) -n 2 $(PY) train_imagenet.py --demo

clean:
	rm -rf $(VENV) result demo_out
