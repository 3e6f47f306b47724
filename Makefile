# The two set-up commands of the README: `make demo` and `make test`.
# Both create the virtualenv on a fresh machine.
# The first interpreter that really is Python $(1): on PATH, then pyenv's
# (whose shim on PATH fails when it is not pyenv's selected version). Empty
# if none.
find_python = $(shell for p in python$(1) \
	"$$(pyenv root 2>/dev/null)"/versions/$(1).*/bin/python$(1) \
	"$${PYENV_ROOT:-$$HOME/.pyenv}"/versions/$(1).*/bin/python$(1); do \
	"$$p" -c 'import sys; assert "%d.%d" % sys.version_info[:2] == "$(1)"' \
	>/dev/null 2>&1 && { command -v "$$p"; break; }; done)
PYTHON ?= $(call find_python,3.11)
VENV ?= .venv
PY := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
# Second CI leg: NumPy 2 on Python 3.12 (chainerkfac/_compat.py).
PYTHON_NP2 ?= $(call find_python,3.12)
VENV_NP2 ?= .venv-np2
PY_NP2 := $(VENV_NP2)/bin/python

# Chainer 7.8.1 is an sdist whose setup.py and `import chainer` need
# pkg_resources, which setuptools 82 removed (80.9 and later warn at its
# every import): hold setuptools<80.9 for the build (PIP_BUILD_CONSTRAINT)
# and at run time (PIP_CONSTRAINT).
export PIP_CONSTRAINT := $(CURDIR)/constraints.txt
export PIP_BUILD_CONSTRAINT := $(CURDIR)/constraints.txt
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# The PyPI Open MPI's help texts live in the venv: without OPAL_PREFIX a
# process started without mpiexec prints "Sorry! You were supposed to get
# help about: mpi-abort ... help-mpi-api.txt: No such file or directory"
# after every error instead of Open MPI's message (train_imagenet.py also
# sets it for itself when it is unset). Each venv has its own Open MPI.
test test-fast test-mpi test-kernels demo: export OPAL_PREFIX := $(abspath $(VENV))
test-numpy2: export OPAL_PREFIX := $(abspath $(VENV_NP2))
# Open MPI 5 inside containers: allow root and more ranks than cores.
# Users of a real cluster never need these.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export PRTE_MCA_rmaps_default_mapping_policy := :oversubscribe
export OMPI_MCA_btl_vader_single_copy_mechanism := none
export PYTHONUNBUFFERED := 1

.PHONY: venv venv-np2 test test-fast test-mpi test-kernels test-numpy2 test-gpu demo clean

venv: $(VENV)/.installed

# The library is installed editable (pyproject.toml), so scripts in any
# directory import it; the harness folders are used from the checkout.
$(VENV)/.installed: requirements.txt constraints.txt pyproject.toml
	@if [ -z '$(PYTHON)' ]; then echo 'make: no Python 3.11 found (python3.11 on PATH, or one of pyenv'"'"'s versions): install it, or name it: make $(or $(MAKECMDGOALS),test) PYTHON=/path/to/python3.11' >&2; exit 1; fi
	@if ! '$(PYTHON)' -c 'import sys' >/dev/null 2>&1; then echo 'make: PYTHON=$(PYTHON) does not run: name a Python 3.11 interpreter: make $(or $(MAKECMDGOALS),test) PYTHON=/path/to/python3.11' >&2; exit 1; fi
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --no-cache-dir -r requirements.txt
	$(VENV)/bin/pip install -q --no-cache-dir --no-deps -e .
	touch $@

venv-np2: $(VENV_NP2)/.installed

$(VENV_NP2)/.installed: requirements-numpy2.txt constraints.txt pyproject.toml
	@py='$(PYTHON_NP2)'; \
	if [ -z "$$py" ]; then py='$(PYTHON)'; \
	echo "test-numpy2: no Python 3.12 found; using $$py with NumPy 2"; fi; \
	echo "$$py -m venv $(VENV_NP2)"; "$$py" -m venv $(VENV_NP2)
	$(VENV_NP2)/bin/pip install -q --no-cache-dir -r requirements-numpy2.txt
	$(VENV_NP2)/bin/pip install -q --no-cache-dir --no-deps -e .
	touch $@

# Single-process tests, then the distributed ones under mpiexec -n 1..4.
test: venv
	$(PY) -m pytest -q -m "not mpi" tests
	$(PY) -m tests.run_mpi --mpiexec $(MPIEXEC)

test-fast: venv
	$(PY) -m pytest -q -m "not mpi and not slow" tests

test-mpi: venv
	$(PY) -m tests.run_mpi --mpiexec $(MPIEXEC)

# The numerical tests again with OpenBLAS forced onto two kernels other
# than this CPU's default (one and two BLAS threads): a test that depends
# on the machine's floating-point kernels fails here, on the developer's
# machine, before it fails on a user's (docs/tests.md).
test-kernels: venv
	$(PY) -m tests.blas_kernels --mpiexec $(MPIEXEC)

# The fast single-process tests (tests/chainerkfac/test_compat.py among
# them) again on NumPy 2 / Python 3.12. `-p chainerkfac._compat` applies the
# patches before any test module imports chainer (the rule for users is
# `import chainerkfac` before `import chainer`).
test-numpy2: venv-np2
	$(PY_NP2) -c 'import sys, numpy; print("test-numpy2: Python", sys.version.split()[0], "NumPy", numpy.__version__)'
	$(PY_NP2) -m pytest -q -p chainerkfac._compat -m "not mpi and not slow" tests

# The GPU tests (CuPy and a CUDA device): pytest -m gpu, then the distributed
# ones under mpiexec -n 1..4, every rank on device 0 (tests/gpu/run.sh says
# how). No virtualenv is made: on a GPU node without network, with Chainer's
# wheel in .whl/, run `make test-gpu PY=python3 MPIEXEC=mpiexec`.
test-gpu:
	PY='$(PY)' MPIEXEC='$(MPIEXEC)' bash tests/gpu/run.sh all

# The library as a user installs it: a fresh virtualenv elsewhere,
# `pip install <checkout>[mpi]` (not editable), a script run from there.
check-install:
	@d=$$(mktemp -d) && trap 'rm -rf "$$d"' EXIT && \
	$(PYTHON) -m venv "$$d/venv" && \
	"$$d/venv/bin/pip" install -q --no-cache-dir "$(CURDIR)[mpi]" && \
	cd "$$d" && "$$d/venv/bin/python" -c 'import numpy, chainerkfac, chainer, chainer.links as L; \
	m = L.Classifier(chainer.Sequential(L.Linear(None, 8), L.Linear(None, 3))); \
	o = chainerkfac.optimizers.KFAC(verbose=False).setup(m); \
	o.update(m, numpy.ones((4, 5), numpy.float32), numpy.zeros(4, numpy.int32)); \
	assert chainerkfac.__file__.startswith("'"$$d"'"), chainerkfac.__file__; \
	print("check-install: chainerkfac", chainerkfac.__version__, "from", chainerkfac.__file__)' && \
	"$$d/venv/bin/mpiexec" --version | head -1

# One BLAS thread per rank: several ranks on few cores otherwise spin
# against each other (K-FAC's epoch took 4x longer with 2 threads per rank).
# --overwrite: every `make demo` starts clean (an earlier demo's runs in
# demo_out/ are removed first, not appended to).
demo: venv
	OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 \
	$(MPIEXEC) -n 2 $(PY) train_imagenet.py --demo --overwrite

clean:
	rm -rf $(VENV) $(VENV_NP2) result demo_out
