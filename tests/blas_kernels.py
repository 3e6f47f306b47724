"""Run the numerical tests again with OpenBLAS forced onto kernels other
than this machine's default, with one and with two BLAS threads.

OpenBLAS picks its kernels by CPU at run time, and a kernel (or another
number of threads) rounds a product differently. A test that compares
stored numbers bit for bit after a BLAS call passes on the machine that
wrote them and fails elsewhere; forcing another kernel here makes it fail
on the developer's machine first. ``.ci/run`` runs this (``make
test-kernels``)::

    python -m tests.blas_kernels --mpiexec .venv/bin/mpiexec

Each pass checks, in a child process, that OpenBLAS really runs another
kernel than the default (``OPENBLAS_CORETYPE`` is ignored by a build
without dynamic architecture selection: then the pass fails, rather than
repeating the default run). A build may run a neighbour of the kernel
asked for (NumPy 2's OpenBLAS runs Katmai for Prescott); the pass says
which.
"""
import argparse
import os
import platform
import shlex
import subprocess
import sys
import time

#: Kernels every CPU of the architecture runs, in order of preference.
#: Prescott (SSE3) and Sandybridge (AVX) run on any x86-64 made since
#: 2011; ARMV8 on any 64-bit ARM.
KERNELS = {'x86_64': ('Prescott', 'Sandybridge', 'Nehalem'),
           'aarch64': ('ARMV8', 'CortexA57')}

#: The numerical tests: the library's own (oracles, the stored-reference
#: guard, linalg, packing, the blocks), the harness's resume tests, and
#: the distributed equivalence tests under mpiexec.
SINGLE = ['tests/chainerkfac', 'tests/harness/test_resume.py',
          'tests/harness/test_updater.py']
MPI = ['tests/chainerkfac/multi_node', 'tests/chainerkfac/test_training.py']

_PROBE = ('import threadpoolctl, numpy\n'
          'info = [i for i in threadpoolctl.threadpool_info()'
          ' if i["internal_api"] == "openblas"]\n'
          'print(info[0]["architecture"] if info else "none")\n')


def current_kernel(env=None) -> str:
    """The kernel OpenBLAS (under NumPy) runs with ``env``."""
    out = subprocess.run([sys.executable, '-c', _PROBE], env=env,
                         check=True, stdout=subprocess.PIPE,
                         universal_newlines=True).stdout
    return out.strip()


def other_kernels(default: str, machine: str = None, count: int = 2):
    """``count`` kernels of this architecture other than ``default``."""
    machine = machine or platform.machine()
    choices = [k for k in KERNELS.get(machine, ())
               if k.lower() != default.lower()]
    if len(choices) < count:
        raise SystemExit('no {} OpenBLAS kernels other than {} known for '
                         '{}'.format(count, default, machine))
    return choices[:count]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--mpiexec', default='mpiexec')
    parser.add_argument('--sizes', default='1,2,3,4',
                        help='process counts of the distributed tests with '
                        'one BLAS thread')
    parser.add_argument('--sizes-two-threads', default='1,2',
                        help='the same with two BLAS threads per process '
                        '(more ranks than that oversubscribe small '
                        'machines)')
    args = parser.parse_args(argv)
    default = current_kernel()
    kernels = other_kernels(default)
    print('blas kernels: default {}; forcing {}'.format(
        default, ', '.join(kernels)), flush=True)
    failed = []
    # One kernel with one BLAS thread, the other with two.
    for kernel, threads, sizes in zip(kernels, (1, 2),
                                      (args.sizes, args.sizes_two_threads)):
        env = dict(os.environ, OPENBLAS_CORETYPE=kernel,
                   OPENBLAS_NUM_THREADS=str(threads),
                   OMP_NUM_THREADS=str(threads))
        running = current_kernel(env)
        print('OPENBLAS_CORETYPE={}: OpenBLAS runs {}'.format(
            kernel, running), flush=True)
        if running.lower() == default.lower():
            print('OPENBLAS_CORETYPE={} is not honoured'.format(kernel),
                  flush=True)
            failed.append(kernel)
            continue
        commands = [
            [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider',
             '-m', 'not mpi and not slow'] + SINGLE,
            [sys.executable, '-m', 'tests.run_mpi', '--mpiexec',
             args.mpiexec, '--sizes', sizes] + MPI]
        for command in commands:
            label = 'OPENBLAS_CORETYPE={} OPENBLAS_NUM_THREADS={}'.format(
                kernel, threads)
            print('$ {} {}'.format(label, shlex.join(command)), flush=True)
            start = time.time()
            rc = subprocess.call(command, env=env)
            print('{}: exit {} in {:.0f} s'.format(label, rc,
                                                   time.time() - start),
                  flush=True)
            if rc:
                failed.append(kernel)
    if failed:
        print('blas kernels: failed with ' + ', '.join(sorted(set(failed))))
        return 1
    print('blas kernels: passed with ' + ', '.join(kernels))
    return 0


if __name__ == '__main__':
    sys.exit(main())
