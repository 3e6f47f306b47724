"""Chainer's MNIST example as written: ``L.Classifier(MLP(1000, 10))``
with lazily sized Linears, a ``Trainer`` with a ``StandardUpdater``, an
``Evaluator`` and a ``LogReport``; only the optimizer line changed."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import numpy

import chainer
import chainer.links as L
from chainer import training
from chainer.training import extensions

from tests.chainerkfac.stock import common
from tests.chainerkfac.stock import nets


def _dataset(n, seed):
    rng = numpy.random.RandomState(seed)
    x = rng.rand(n, 784).astype(numpy.float32)
    t = rng.randint(0, 10, size=n).astype(numpy.int32)
    return chainer.datasets.TupleDataset(x, t)


def test_mnist_trainer(caplog, tmp_path):
    numpy.random.seed(0)
    model = L.Classifier(nets.MLP(1000, 10))
    optimizer = common.kfac()                 # <- the one line
    optimizer.setup(model)
    train_iter = chainer.iterators.SerialIterator(_dataset(300, 0), 100)
    test_iter = chainer.iterators.SerialIterator(_dataset(100, 1), 100,
                                                 repeat=False, shuffle=False)
    updater = training.updaters.StandardUpdater(train_iter, optimizer)
    trainer = training.Trainer(updater, (common.STEPS, 'iteration'),
                               out=str(tmp_path))
    trainer.extend(extensions.Evaluator(test_iter, model),
                   trigger=(1, 'iteration'))
    log = extensions.LogReport(trigger=(1, 'iteration'))
    trainer.extend(log)

    class Trainee:
        targets = [model]
        optimizers = [optimizer]

    before = [{n: p.array.copy() for n, p in model.namedparams()
               if p.array is not None}]   # lazily sized: none yet
    with caplog.at_level('WARNING', logger='chainerkfac'):
        trainer.run()
    warnings = [r.getMessage() for r in caplog.records
                if r.name.startswith('chainerkfac')]
    reports = [{k: v for k, v in entry.items() if k.startswith('kfac/')}
               for entry in log.log]
    common.check_trained(Trainee, before, reports, warnings)
    assert all(numpy.isfinite(e['validation/main/loss']) for e in log.log)
    rows = common.rows_of(optimizer.registration_table())
    assert 'A 785x785, G 1000x1000' in rows['/predictor/l1']
    assert 'A 1001x1001, G 1000x1000' in rows['/predictor/l2']
    assert 'A 1001x1001, G 10x10' in rows['/predictor/l3']
