"""create_communicator's errors, and one rank's exception ending the job."""
import textwrap

from tests import launch

import pytest
from chainermn import nccl

from chainerkfac.communicators import create_communicator

def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match='naive, pure_nccl'):
        create_communicator('flat')


@pytest.mark.skipif(nccl._available, reason='CuPy with NCCL is installed')
def test_pure_nccl_without_cupy_is_a_clear_error():
    with pytest.raises(RuntimeError, match='CuPy'):
        create_communicator('pure_nccl')


def test_exception_on_one_rank_aborts_the_job(tmp_path):
    script = tmp_path / 'fail_on_rank_1.py'
    script.write_text(textwrap.dedent('''
        from chainerkfac.communicators import create_communicator
        comm = create_communicator('naive')
        if comm.rank == 1:
            raise RuntimeError('deliberate failure on rank 1')
        comm.mpi_comm.Barrier()  # without the hook rank 0 waits forever
    '''))
    # A hang fails by the launcher's timeout; how long the abort takes is
    # a figure of benchmarks/failure_latency.py, not a limit here.
    proc, _ = launch.run_mpi([script], nproc=2, timeout=60)
    assert proc.returncode != 0
    assert 'deliberate failure on rank 1' in proc.stderr
