#!/usr/bin/env bash
# The GPU tests: `pytest -m gpu` over the whole suite (single process; the
# GPU cases beside their CPU twins in tests/chainerkfac too), then the distributed GPU
# tests under `mpiexec -n 1..4`, every rank on device 0 (host-staged
# communicator). From the project root:
#
#     bash tests/gpu/run.sh [all|single|mpi]          (default: all)
#
# which is what `make test-gpu` runs. On a GPU node without network access
# (the node's own python3 with NumPy 2, CuPy and mpi4py, its own Open MPI,
# Chainer carried as a wheel in .whl/: README, section GPU):
#
#     bash tests/gpu/run.sh
#   or
#     make test-gpu PY=python3 MPIEXEC=mpiexec
#
# Chainer is installed from .whl/chainer-*.whl into $SITE (no network, no
# dependencies) when the interpreter cannot import it. The output also goes
# to $LOG ($OUT/gpu_test.log when $OUT is set, else result/gpu_test.log).
# Environment: PY (python3), MPIEXEC (mpiexec), SITE (/tmp/site), LOG,
# MPI_SIZES (1,2,3,4), MPI_TIMEOUT (seconds per mpiexec launch, 300).
# The backend chainerkfac.cudnn (cuDNN 9 for Chainer) is on by default, so
# the whole suite runs with it; CHAINERKFAC_CUDNN=0 runs the suite on
# Chainer's own path, and the cuDNN tests (tests/gpu/test_cudnn_gpu.py and
# tests/chainerkfac/test_cudnn_library.py) then still run with it, apart.
# Exit status: 0 when every step passed; 3 when no GPU is usable (nothing
# would run: every GPU test would be skipped).
set -u -o pipefail
cd "$(dirname "$0")/../.." || exit 2

PY=${PY:-python3}
MPIEXEC=${MPIEXEC:-mpiexec}
SITE=${SITE:-/tmp/site}
WHAT=${1:-all}
LOG=${LOG:-${OUT:-result}/gpu_test.log}
mkdir -p "$(dirname "$LOG")"
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 \
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

case "$WHAT" in
    all|single|mpi) ;;
    *) echo "usage: bash tests/gpu/run.sh [all|single|mpi]" >&2; exit 2 ;;
esac

{
echo "== GPU tests ($WHAT), $(date -u +%Y-%m-%dT%H:%M:%SZ), $(hostname)"
if ! "$PY" -c 'import chainerkfac, chainer' >/dev/null 2>&1; then
    wheel=$(ls .whl/chainer-*.whl 2>/dev/null | head -n 1)
    if [ -z "$wheel" ]; then
        echo "Chainer cannot be imported by $PY and there is no" \
             ".whl/chainer-*.whl to install it from (README, section GPU)"
        exit 2
    fi
    echo "\$ $PY -m pip install --no-index --no-deps --target $SITE $wheel"
    "$PY" -m pip install -q --no-index --no-deps --no-compile \
        --target "$SITE" "$wheel" || exit 2
fi
"$PY" - <<'EOF'
import sys
import chainerkfac  # NOQA  (before chainer: NumPy-2 shims)
import chainer
import numpy
print('Python', sys.version.split()[0], '| NumPy', numpy.__version__,
      '| Chainer', chainer.__version__)
try:
    import cupy
    runtime = cupy.cuda.runtime
    print('CuPy', cupy.__version__, '| CUDA runtime', runtime.runtimeGetVersion(),
          '| driver', runtime.driverGetVersion(),
          '| devices', runtime.getDeviceCount(),
          '| device 0:', runtime.getDeviceProperties(0)['name'].decode())
    from chainermn import nccl
    print('NCCL available to ChainerMN:', nccl._available)
    from chainerkfac import linalg_cuda
    print('cuSOLVER potri bound:', linalg_cuda._raw_potri() is not None,
          '| libcusolver:', linalg_cuda._loaded_cusolver())
    print('cuDNN for Chainer:', chainerkfac.cudnn.describe())
except Exception as error:
    print('CuPy / GPU problem: {}: {}'.format(type(error).__name__, error))
EOF
"$PY" - <<'EOF'
import sys
from tests.gpu import support
if support.SKIP_REASON is not None:
    print('No usable GPU here, every GPU test would be skipped:',
          support.SKIP_REASON)
    sys.exit(3)
EOF
} 2>&1 | tee "$LOG" || exit $?

single=skipped
cudnn=skipped
mpi=skipped
if [ "$WHAT" != mpi ]; then
    # every GPU test of the suite: tests/gpu and the GPU cases that sit
    # beside their CPU twins (tests/chainerkfac/test_tf32.py, ...)
    echo "== pytest -m 'gpu and not mpi' tests" \
         "(CHAINERKFAC_CUDNN=${CHAINERKFAC_CUDNN:-})" | tee -a "$LOG"
    "$PY" -m pytest -v -rfEs --durations=10 -p no:cacheprovider \
        -p chainerkfac._compat -m 'gpu and not mpi' tests 2>&1 \
        | tee -a "$LOG"
    single=$?
    if [ "${CHAINERKFAC_CUDNN:-}" = 0 ]; then
        echo "== CHAINERKFAC_CUDNN=1: the cuDNN tests" | tee -a "$LOG"
        CHAINERKFAC_CUDNN=1 "$PY" -m pytest -v -rfEs --durations=10 \
            -p no:cacheprovider -p chainerkfac._compat \
            tests/gpu/test_cudnn_gpu.py \
            tests/chainerkfac/test_cudnn_library.py 2>&1 | tee -a "$LOG"
        cudnn=$?
    fi
fi
if [ "$WHAT" != single ]; then
    echo "== mpiexec -n ${MPI_SIZES:-1,2,3,4}: pytest -m 'mpi and gpu'" \
         "tests/gpu" | tee -a "$LOG"
    "$PY" -m tests.run_mpi --mpiexec "$MPIEXEC" \
        --sizes "${MPI_SIZES:-1,2,3,4}" --timeout "${MPI_TIMEOUT:-300}" \
        --marker 'mpi and gpu' -- -p chainerkfac._compat -rfEs tests/gpu \
        2>&1 | tee -a "$LOG"
    mpi=$?
fi
echo "== GPU tests: single-process exit $single, cuDNN exit $cudnn," \
     "mpiexec exit $mpi (log: $LOG)" | tee -a "$LOG"
for rc in "$single" "$cudnn" "$mpi"; do
    if [ "$rc" != skipped ] && [ "$rc" != 0 ]; then
        exit 1
    fi
done
exit 0
