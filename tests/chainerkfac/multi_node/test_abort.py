"""An exception on one rank during distributed training ends the job."""
import textwrap

from tests import launch

def test_exception_in_training_on_one_rank_ends_mpiexec(tmp_path):
    script = tmp_path / 'fail_in_training.py'
    script.write_text(textwrap.dedent('''
        from tests.chainerkfac import helpers
        from tests.chainerkfac.multi_node import common

        comm = common.naive()
        model, optimizer = common.distributed(comm)
        lossfun = helpers.loss_of(model)

        def failing_loss(x, t):
            if comm.rank == 1 and optimizer.t == 2:
                raise RuntimeError('deliberate failure on rank 1')
            return lossfun(x, t)

        for step in range(1000):  # rank 0 would wait in step 2 forever
            x, t = common.chunks(step, comm.size)[comm.rank]
            optimizer.update(failing_loss, x, t)
    '''))
    # A hang fails by the launcher's timeout; how long the abort takes is
    # a figure of benchmarks/failure_latency.py, not a limit here.
    proc, _ = launch.run_mpi([script], nproc=2, timeout=60)
    assert proc.returncode != 0
    assert 'deliberate failure on rank 1' in proc.stderr
