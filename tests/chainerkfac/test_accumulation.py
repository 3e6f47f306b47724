"""Between the micro-batches of a step (``acc_iters > 1``) the gradients
the accumulator holds leave an array in ``param.grad``: Chainer's
``ParameterStatistics`` read it after every iteration and raised
``'NoneType' object has no attribute 'ravel'`` at the first."""
import tempfile

import numpy
import pytest

import chainer
import chainer.links as L
from chainer import training
from chainer.training import extensions

import chainerkfac
from tests.chainerkfac import helpers


#: The two accumulating optimizers, each stepping every 2 micro-batches.
MAKERS = pytest.mark.parametrize('make', [
    lambda: helpers.kfac(lr=0.05, acc_iters=2),
    lambda: chainerkfac.optimizers.GuardedOptimizer(
        chainer.optimizers.MomentumSGD(0.05), 2),
], ids=['kfac', 'guarded'])


@MAKERS
def test_parameter_statistics_in_an_accumulating_trainer(make):
    x, t = helpers.data(n=16, shape=(5,), n_class=3)
    model = L.Classifier(helpers.MLP())
    optimizer = make()
    optimizer.setup(model)
    iterator = chainer.iterators.SerialIterator(
        chainer.datasets.TupleDataset(x, t), 4, shuffle=False)
    updater = training.updaters.StandardUpdater(iterator, optimizer)
    with tempfile.TemporaryDirectory() as out:
        trainer = training.Trainer(updater, (6, 'iteration'), out=out)
        trainer.extend(extensions.ParameterStatistics(
            model, trigger=(1, 'iteration')))
        log = extensions.LogReport(trigger=(1, 'iteration'))
        trainer.extend(log)
        trainer.run()
    assert optimizer.t == 3
    grads = [value for entry in log.log for key, value in entry.items()
             if key.endswith('/predictor/l1/W/grad/mean')]
    # the held micro-batches show zeros; the steps their whole gradient
    assert len(grads) == 6 and all(g == 0 for g in grads[0::2])
    assert all(numpy.isfinite(g) and g != 0 for g in grads[1::2])


@MAKERS
def test_a_copy_inside_a_step_finishes_it_as_the_original(make):
    """``copy.deepcopy`` of an optimizer after 1 of 2 micro-batches: the
    held sums were keyed by the original parameters' ``id`` and lost in
    the copy (K-FAC 0.055 off); GuardedOptimizer could not be copied at
    all (``KeyError: 'actual_optimizer'``)."""
    import copy
    x, t = helpers.data(n=8, shape=(5,), n_class=3)
    model = L.Classifier(helpers.MLP())
    optimizer = make()
    optimizer.setup(model)
    optimizer.update(model, x[:4], t[:4])
    twin = copy.deepcopy(optimizer)
    for each in (optimizer, twin):
        each.update(each.target, x[4:], t[4:])
        assert each.t == 1
    for (name, a), (_, b) in zip(sorted(optimizer.target.namedparams()),
                                 sorted(twin.target.namedparams())):
        numpy.testing.assert_array_equal(a.array, b.array, name)
