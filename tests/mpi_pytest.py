"""pytest entry point for one rank of an ``mpiexec`` job (see run_mpi.py).

Rank 0 prints pytest's report; the other ranks print theirs only when they
fail. The job's exit code is the maximum over ranks, so a failure on any rank
fails the job.
"""
import io
import sys
import contextlib

import pytest
from mpi4py import MPI


def main():
    world = MPI.COMM_WORLD
    args = ['-q', '-m', 'mpi', '-p', 'no:cacheprovider', '--color=no'] + sys.argv[1:]
    if world.rank == 0:
        rc = int(pytest.main(args))
        out = ''
    else:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = int(pytest.main(args))
        out = buf.getvalue()
    # pytest's "no tests collected" (5) is not a failure of the job.
    rc = 0 if rc == 5 else rc
    worst = world.allreduce(rc, op=MPI.MAX)
    if rc != 0 and world.rank != 0:
        sys.stdout.write('--- rank {} ---\n{}'.format(world.rank, out))
        sys.stdout.flush()
    world.Barrier()
    sys.exit(worst)


if __name__ == '__main__':
    main()
