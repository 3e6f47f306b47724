"""An exception on one rank during distributed training ends the job."""
import os
import subprocess
import sys
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.dirname(os.path.abspath(__file__)))))


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
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT='1',
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM='1',
               PRTE_MCA_rmaps_default_mapping_policy=':oversubscribe',
               PYTHONPATH=os.pathsep.join(
                   [REPO] + [p for p in [os.environ.get('PYTHONPATH')] if p]))
    mpiexec = os.path.join(os.path.dirname(sys.executable), 'mpiexec')
    start = time.time()
    proc = subprocess.run([mpiexec, '-n', '2', sys.executable, str(script)],
                          env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    elapsed = time.time() - start
    assert proc.returncode != 0
    assert 'deliberate failure on rank 1' in proc.stderr
    assert elapsed < 30
