"""Launch a script under ``mpiexec`` from a test (as root, oversubscribed)."""
import os
import subprocess
import sys
import time

from benchmarks import _common
from tests.run_mpi import LAUNCH_TRIES, launcher_failed  # NOQA (re-exported)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = os.path.join(os.path.dirname(sys.executable), 'mpiexec')


def mpi_env():
    """The environment for a child ``mpiexec`` on this machine."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT='1',
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM='1',
               PRTE_MCA_rmaps_default_mapping_policy=':oversubscribe',
               OMP_NUM_THREADS='1', OPENBLAS_NUM_THREADS='1',
               PYTHONUNBUFFERED='1')
    env['PYTHONPATH'] = os.pathsep.join(
        [REPO] + [p for p in [os.environ.get('PYTHONPATH')] if p])
    return env


def run_mpi(args, nproc, timeout=60, env=None, cwd=REPO):
    """Run ``python args...`` on ``nproc`` ranks (``env``: default
    :func:`mpi_env`); return (process, seconds) of the launch that ran:
    one whose launcher itself failed to start (Open MPI's PMIx listener,
    see :func:`harness.mpi.stale_session_dirs`) is started again, as
    :mod:`tests.run_mpi` does."""
    cmd = [sys.executable] + [str(a) for a in args]
    env = mpi_env() if env is None else env
    if nproc > 1:
        return _common.run_mpiexec([MPIEXEC, '-n', str(nproc)] + cmd, env,
                                   timeout, cwd=cwd)
    start = time.time()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)
    return proc, time.time() - start
