"""Run the tests marked ``mpi`` under ``mpiexec -n 1, 2, 3, 4``.

Each launch is wrapped in a timeout so that a deadlock fails the suite
instead of hanging it. Inside the job, :mod:`tests.mpi_pytest` runs pytest on
every rank and combines the exit codes, so one failing rank fails the launch.
"""
import argparse
import os
import subprocess
import sys
import time


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument('--mpiexec', default='mpiexec')
    parser.add_argument('--sizes', default='1,2,3,4')
    parser.add_argument('--timeout', type=float, default=600)
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
    for size in [int(s) for s in args.sizes.split(',')]:
        cmd = [args.mpiexec, '-n', str(size), sys.executable, '-m',
               'tests.mpi_pytest'] + args.pytest_args
        print('$ ' + ' '.join(cmd), flush=True)
        start = time.time()
        try:
            rc = subprocess.run(cmd, env=env, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            print('TIMEOUT after {:.0f} s (-n {})'.format(
                args.timeout, size), flush=True)
            rc = 124
        print('-n {}: exit {} in {:.1f} s'.format(
            size, rc, time.time() - start), flush=True)
        if rc != 0:
            failed.append(size)
    if failed:
        print('mpi tests failed for -n ' + ', '.join(map(str, failed)))
        return 1
    return 0


if __name__ == '__main__':
    sys.exit(main())
