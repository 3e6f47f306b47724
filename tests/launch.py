"""Launch a script under ``mpiexec`` from a test (as root, oversubscribed)."""
import os
import subprocess
import sys
import time

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
    if nproc > 1:
        cmd = [MPIEXEC, '-n', str(nproc)] + cmd
    for attempt in range(1, LAUNCH_TRIES + 1):
        start = time.time()
        proc = subprocess.run(cmd, env=mpi_env() if env is None else env,
                              cwd=cwd,
                              capture_output=True, text=True,
                              timeout=timeout)
        if nproc == 1 or attempt == LAUNCH_TRIES or not launcher_failed(
                proc.returncode, proc.stdout + proc.stderr):
            break
    return proc, time.time() - start
