"""The one-line swap: a standard Chainer Trainer script trains with
MomentumSGD and with KFAC, differing only in the line that builds the
optimizer, and K-FAC's loss drops."""
import numpy
import pytest

import chainer
import chainer.links as L
from chainer import training
from chainer.training import extensions

import chainerkfac


def digits():
    from sklearn.datasets import load_digits
    data = load_digits()
    x = (data.data / 16.0).astype(numpy.float32)
    t = data.target.astype(numpy.int32)
    return chainer.datasets.TupleDataset(x, t)


def train(make_optimizer, out, epochs=3):
    """An ordinary Chainer training script; only the optimizer varies."""
    numpy.random.seed(0)
    model = L.Classifier(chainer.Sequential(
        L.Linear(64, 32), chainer.functions.relu, L.Linear(32, 10)))
    optimizer = make_optimizer()                      # <- the one line
    optimizer.setup(model)
    iterator = chainer.iterators.SerialIterator(digits(), 128, shuffle=True)
    updater = training.updaters.StandardUpdater(iterator, optimizer)
    trainer = training.Trainer(updater, (epochs, 'epoch'), out=str(out))
    log = extensions.LogReport(trigger=(1, 'epoch'))
    trainer.extend(log)
    trainer.run()
    return [entry['main/loss'] for entry in log.log]


@pytest.mark.slow
def test_kfac_drops_in_for_momentum_sgd(tmp_path):
    sgd = train(lambda: chainer.optimizers.MomentumSGD(lr=0.01,
                                                       momentum=0.9),
                tmp_path / 'sgd')
    kfac = train(lambda: chainerkfac.optimizers.KFAC(lr=0.01, momentum=0.9,
                                                     damping=1e-2,
                                                     verbose=False),
                 tmp_path / 'kfac')
    assert len(sgd) == len(kfac) == 3
    assert kfac[-1] < 0.5 * kfac[0]
    # Preconditioning pays off on this problem at equal lr and epochs.
    assert kfac[-1] < sgd[-1]


def test_help_leads_to_the_swap_and_dir_lists_create_communicator():
    """``help(chainerkfac)`` showed no code line, and ``dir()`` lacked
    ``create_communicator`` (served on first use, to keep mpi4py's
    MPI_Init out of ``import chainerkfac``)."""
    import chainerkfac
    assert 'optimizer = chainerkfac.optimizers.KFAC()' in chainerkfac.__doc__
    assert 'create_communicator' in dir(chainerkfac)
