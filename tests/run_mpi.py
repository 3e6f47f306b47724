"""Run the tests marked ``mpi`` under ``mpiexec -n 1, 2, 3, 4``.

Each launch is wrapped in a timeout so that a deadlock fails the suite
instead of hanging it. Inside the job, :mod:`tests.mpi_pytest` runs pytest on
every rank and combines the exit codes, so one failing rank fails the launch.
"""
import argparse
import os
import re
import shlex
import subprocess
import sys
import time

from harness import mpi

#: A launcher that failed to start (before any rank ran a test): Open MPI
#: 5's "The PMIx server's listener thread failed to start" hit CI runs (the
#: cause: harness.mpi.stale_session_dirs). Such a launch is tried again
#: (at most LAUNCH_TRIES times); a launch in which a test ran never is.
LAUNCH_TRIES = mpi.LAUNCH_TRIES
_TESTS_RAN = re.compile(r'\d+ (passed|failed|error|skipped|deselected)')


def launcher_failed(rc: int, output: str) -> bool:
    """Whether a launch failed to start MPI itself (see LAUNCH_TRIES)."""
    return mpi.launcher_failed(rc, output) and not _TESTS_RAN.search(output)


def _launch(cmd, env, timeout):
    try:
        done = subprocess.run(cmd, env=env, timeout=timeout,
                              stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT,
                              universal_newlines=True)
        return done.returncode, done.stdout
    except subprocess.TimeoutExpired as expired:
        output = expired.stdout or ''
        if isinstance(output, bytes):
            output = output.decode(errors='replace')
        return 124, output + 'TIMEOUT after {:.0f} s\n'.format(timeout)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument('--mpiexec', default='mpiexec')
    parser.add_argument('--sizes', default='1,2,3,4')
    parser.add_argument('--timeout', type=float, default=600)
    parser.add_argument('--marker', default='mpi',
                        help="pytest -m expression, e.g. 'mpi and gpu' "
                             '(default: mpi)')
    parser.add_argument('pytest_args', nargs='*', default=['tests'])
    args = parser.parse_args(argv)
    env = dict(os.environ)
    env.setdefault('OMPI_ALLOW_RUN_AS_ROOT', '1')
    env.setdefault('OMPI_ALLOW_RUN_AS_ROOT_CONFIRM', '1')
    env.setdefault('PRTE_MCA_rmaps_default_mapping_policy', ':oversubscribe')
    env.setdefault('OMPI_MCA_btl_vader_single_copy_mechanism', 'none')
    env['PYTHONUNBUFFERED'] = '1'
    # One BLAS thread per rank: ranks oversubscribe the cores already.
    for name in ('OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS'):
        env.setdefault(name, '1')
    failed = []
    totals = {'passed': 0, 'failed': 0, 'skipped': 0}
    for size in [int(s) for s in args.sizes.split(',')]:
        cmd = [args.mpiexec, '-n', str(size), sys.executable, '-m',
               'tests.mpi_pytest', '-m', args.marker] + args.pytest_args
        print('$ ' + shlex.join(cmd), flush=True)
        start = time.time()
        for attempt in range(1, LAUNCH_TRIES + 1):
            rc, output = _launch(cmd, env, args.timeout)
            if attempt == LAUNCH_TRIES or not launcher_failed(rc, output):
                break
            sys.stdout.write(output)
            print('-n {}: mpiexec failed to start (exit {}), launch {} of '
                  '{}: trying again'.format(size, rc, attempt + 1,
                                            LAUNCH_TRIES), flush=True)
            time.sleep(2.0)
        sys.stdout.write(output)
        for word in totals:
            found = re.findall(r'(\d+) ' + word, output)
            totals[word] += int(found[-1]) if found else 0
        print('-n {}: exit {} in {:.1f} s'.format(
            size, rc, time.time() - start), flush=True)
        if rc != 0:
            failed.append(size)
    if failed:
        print('mpi tests failed for -n ' + ', '.join(map(str, failed)))
        totals['failed'] = max(totals['failed'], 1)
    print('mpi: {passed} passed, {failed} failed, {skipped} skipped'.format(
        **totals), flush=True)
    return 1 if failed else 0


if __name__ == '__main__':
    sys.exit(main())
