"""ChainerMN's MNIST example as written — a lazily sized MLP, the data
scattered by ``chainermn.scatter_dataset``, a ``Trainer`` with a
``StandardUpdater``, ``chainermn.create_multi_node_evaluator`` — with
ChainerMN's own ``create_multi_node_optimizer`` wrapping the one line
``KFAC(...)``. (``multi_node/test_chainermn_wrapper.py`` checks the
wrapper's steps against chainerkfac's and one process on fixed-size nets;
this is the stock script's pattern, whose links are sized by the first
forward, which the wrapper's first update only broadcasts.)"""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import numpy
import pytest

import chainer
import chainer.links as L
from chainer import training
from chainer.training import extensions

from tests.chainerkfac.stock import common
from tests.chainerkfac.stock import nets

ITERATIONS = common.STEPS + 1      # the first only broadcasts rank 0's


def _dataset(n, seed):
    rng = numpy.random.RandomState(seed)
    x = rng.rand(n, 64).astype(numpy.float32)
    t = rng.randint(0, 10, size=n).astype(numpy.int32)
    return chainer.datasets.TupleDataset(x, t)


@pytest.mark.mpi
def test_chainermn_mnist_script(tmp_path):
    chainermn = pytest.importorskip('chainermn')
    from tests.chainerkfac.multi_node import common as mn
    comm = chainermn.create_communicator('naive')
    numpy.random.seed(comm.rank)          # rank-dependent: the broadcast
    model = L.Classifier(nets.MLP(100, 10))
    optimizer = chainermn.create_multi_node_optimizer(
        common.kfac(), comm)              # <- the one line
    optimizer.setup(model)
    train = _dataset(40 * comm.size, 0) if comm.rank == 0 else None
    test = _dataset(20 * comm.size, 1) if comm.rank == 0 else None
    train = chainermn.scatter_dataset(train, comm, shuffle=True)
    test = chainermn.scatter_dataset(test, comm, shuffle=True)
    train_iter = chainer.iterators.SerialIterator(train, 10)
    test_iter = chainer.iterators.SerialIterator(test, 10, repeat=False,
                                                 shuffle=False)
    updater = training.updaters.StandardUpdater(train_iter, optimizer)
    trainer = training.Trainer(updater, (ITERATIONS, 'iteration'),
                               out=str(tmp_path))
    trainer.extend(chainermn.create_multi_node_evaluator(
        extensions.Evaluator(test_iter, model), comm),
        trigger=(1, 'iteration'))
    log = extensions.LogReport(trigger=(1, 'iteration'))
    trainer.extend(log)
    trainer.run()

    kfac = optimizer.actual_optimizer
    mn.assert_everywhere(kfac.t == common.STEPS and kfac.gradients_reduced
                         and kfac.transport.size == comm.size,
                         'K-FAC steps through the wrapper')
    kfac_blocks = [b for b in kfac.blocks if b.factor_names]
    mn.assert_everywhere(len(kfac_blocks) == 3, 'three Linear blocks')
    due = common.refresh_steps(kfac, 'A')        # the defaults: step 0
    mn.assert_everywhere(all(
        b.last_refresh[n] == due[-1]
        for b in kfac_blocks for n in b.factor_names), 'refreshed when due')
    mn.assert_everywhere(all(
        b.has_inverses() and b.inverse_count['A'] == len(due)
        for b in kfac_blocks if kfac.transport.owns(b)),
        'owned blocks inverted when due')
    reports = [e for e in log.log if 'kfac/preconditioned_blocks' in e]
    mn.assert_everywhere(len(reports) == common.STEPS and all(
        e['kfac/preconditioned_blocks'] == 3 and e['kfac/plain_blocks'] == 0
        for e in reports), 'reported: every block preconditioned')
    mn.assert_everywhere(all(numpy.isfinite(e['validation/main/loss'])
                             for e in log.log), 'evaluated')
    weights = mn.params(model)
    mn.assert_everywhere(all(numpy.isfinite(w).all()
                             for w in weights.values()), 'finite')
    # Every rank holds the same model.
    mn.assert_everywhere(mn.max_relative_diff(
        weights, mn.world.bcast(weights, root=0)) == 0, 'ranks agree')
