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


CHAINERMN_COMMUNICATOR = '''
    import chainerkfac
    import chainer
    import chainer.links as L
    import chainermn
    import numpy
    comm = chainermn.create_communicator('naive')   # installs no hook
    numpy.random.seed(0)
    model = L.Classifier(chainer.Sequential(L.Linear(8, 16),
                                            L.Linear(16, 3)))
    rng = numpy.random.RandomState(comm.rank)
'''


def test_a_bad_first_batch_on_one_rank_ends_chainermns_wrapped_kfac(
        tmp_path):
    """ChainerMN's own communicator and wrapper around K-FAC: the wrapper's
    first update only broadcasts, and K-FAC joined the process group (and
    installed the except hook) at its second. A bad label on rank 1 at the
    first step left rank 0 waiting forever; K-FAC's setup now installs the
    hook under mpiexec."""
    script = tmp_path / 'first_batch.py'
    script.write_text(textwrap.dedent(CHAINERMN_COMMUNICATOR) +
                      textwrap.dedent('''
        optimizer = chainermn.create_multi_node_optimizer(
            chainerkfac.optimizers.KFAC(verbose=False), comm)
        optimizer.setup(model)
        for step in range(1000):
            x = rng.randn(4, 8).astype(numpy.float32)
            t = rng.randint(0, 3, 4).astype(numpy.int32)
            if comm.rank == 1 and step == 0:
                t[0] = 99           # deliberate failure on rank 1
            optimizer.update(model, x, t)
    '''))
    proc, _ = launch.run_mpi([script], nproc=2, timeout=60)
    assert proc.returncode != 0
    assert 'Uncaught exception on rank 1' in proc.stderr


def test_an_exception_on_one_rank_ends_the_guarded_optimizer(tmp_path):
    """GuardedOptimizer (the MLPerf baselines) over ChainerMN's own
    communicator never installed the except hook: a raising loss on rank 1
    left rank 0 in the step's all-reduce forever."""
    script = tmp_path / 'guarded.py'
    script.write_text(textwrap.dedent(CHAINERMN_COMMUNICATOR) +
                      textwrap.dedent('''
        optimizer = chainerkfac.optimizers.GuardedOptimizer(
            chainer.optimizers.MomentumSGD(0.01), comm=comm)
        optimizer.setup(model)

        def loss(x, t):
            if comm.rank == 1 and optimizer.t == 2:
                raise RuntimeError('deliberate failure on rank 1')
            return model(x, t)

        for step in range(1000):
            x = rng.randn(4, 8).astype(numpy.float32)
            t = rng.randint(0, 3, 4).astype(numpy.int32)
            optimizer.update(loss, x, t)
    '''))
    proc, _ = launch.run_mpi([script], nproc=2, timeout=60)
    assert proc.returncode != 0
    assert 'deliberate failure on rank 1' in proc.stderr


def test_process_local_runs_under_one_mpiexec_stay_independent(tmp_path):
    """``KFAC(process_local=True)`` is for independent runs under one
    ``mpiexec`` (a sweep): one failing does not end the others (the except
    hook installed by ``setup`` under several processes is left out)."""
    script = tmp_path / 'independent.py'
    script.write_text(textwrap.dedent(CHAINERMN_COMMUNICATOR) +
                      textwrap.dedent('''
        import time
        optimizer = chainerkfac.optimizers.KFAC(verbose=False,
                                                process_local=True)
        optimizer.setup(model)
        for step in range(6):
            if comm.rank == 1 and step == 2:
                raise RuntimeError('deliberate failure on rank 1')
            if comm.rank == 0 and step == 2:
                time.sleep(2)       # rank 1 has failed by now
            x = rng.randn(4, 8).astype(numpy.float32)
            t = rng.randint(0, 3, 4).astype(numpy.int32)
            optimizer.update(model, x, t)
        print('rank {} finished'.format(comm.rank), flush=True)
    '''))
    proc, _ = launch.run_mpi([script], nproc=2, timeout=60)
    assert 'deliberate failure on rank 1' in proc.stderr
    assert 'rank 0 finished' in proc.stdout
