"""A Trainer's snapshot at an iteration that ends no step (``acc_iters``
2, snapshot after iteration 7): the resumed run equals the uninterrupted
one. The snapshot holds the step so far (the gradients' sums, K-FAC's
capture); before 2026-11-28 it was dropped, and since the iterator had
gone past that micro-batch it was lost and every later step began one
micro-batch off (an auditor: K-FAC 0.135 off after 18 iterations,
GuardedOptimizer 0.049).

The resumed run redoes the same arithmetic on the same numbers (the sums
are stored as held, a low-rank sum as its columns), so the weights are
equal bit for bit in float64; the tolerance 0 says so.
"""
import numpy
import pytest

import chainer
import chainer.links as L
from chainer import training
from chainer.training import extensions

import chainerkfac
from tests.chainerkfac import helpers

ITERATIONS, KILLED_AT = 12, 7


def _optimizers():
    return {
        # the defaults: stale factors, low-rank sums, the bounded step
        'kfac': lambda: chainerkfac.optimizers.KFAC(
            lr=0.05, acc_iters=2, verbose=False),
        'kfac-mc-dense': lambda: helpers.kfac(
            lr=0.05, acc_iters=2, fisher='mc', low_rank=False, seed=3),
        'guarded': lambda: chainerkfac.optimizers.GuardedOptimizer(
            chainer.optimizers.MomentumSGD(0.05), 2),
    }


def _run(out, make, net, stop, autoload):
    numpy.random.seed(0)
    model = L.Classifier(net())
    optimizer = make()
    optimizer.setup(model)
    x, t = helpers.data(n=40, shape=net.in_shape, n_class=3, seed=1)
    iterator = chainer.iterators.SerialIterator(
        chainer.datasets.TupleDataset(x, t), 4, shuffle=False)
    updater = training.updaters.StandardUpdater(iterator, optimizer)
    trainer = training.Trainer(updater, (stop, 'iteration'), out=str(out))
    if autoload:
        trainer.extend(extensions.snapshot(autoload=True),
                       trigger=(KILLED_AT, 'iteration'))
    trainer.run()
    return {name: p.array.copy() for name, p in model.namedparams()}, \
        optimizer


class _MLP(helpers.MLP):
    in_shape = (5,)


class _ConvBN(helpers.ConvNet):
    in_shape = (2, 5, 5)

    def __init__(self):
        super().__init__(bn=True)


@pytest.mark.parametrize('net', [_MLP, _ConvBN], ids=['mlp', 'conv-bn'])
@pytest.mark.parametrize('name', sorted(_optimizers()))
def test_a_resume_inside_a_step_is_the_uninterrupted_run(tmp_path, name,
                                                          net):
    make = _optimizers()[name]
    uninterrupted, _ = _run(tmp_path / 'a', make, net, ITERATIONS, False)
    _, killed = _run(tmp_path / 'b', make, net, KILLED_AT, True)
    assert killed.pending_micro_batches == 1       # saved inside a step
    resumed, optimizer = _run(tmp_path / 'b', make, net, ITERATIONS, True)
    assert optimizer.t == ITERATIONS // 2
    for key, value in uninterrupted.items():
        numpy.testing.assert_array_equal(resumed[key], value, key)


def _saved_inside_a_step(tmp_path, make, name):
    model = L.Classifier(_MLP())
    optimizer = make()
    optimizer.setup(model)
    x, t = helpers.data(n=4, shape=(5,), n_class=3)
    optimizer.update(model, x, t)
    path = str(tmp_path / name)
    chainer.serializers.save_npz(path, optimizer)
    return path


@pytest.mark.parametrize('name', ['kfac', 'guarded'])
def test_an_earlier_versions_snapshot_inside_a_step_starts_a_new_one(
        tmp_path, name):
    """Without the step's gradients (a file of an earlier version): the
    micro-batches are dropped, as they were, and said."""
    make = _optimizers()[name]
    path = _saved_inside_a_step(tmp_path, make, 'new.npz')
    with numpy.load(path) as stored:
        kept = {k: v for k, v in stored.items()
                if 'accumulation/' not in k}
    old = str(tmp_path / 'old.npz')
    numpy.savez(old, **kept)
    optimizer = make()
    optimizer.setup(L.Classifier(_MLP()))
    with pytest.warns(UserWarning, match='after 1 of 2 accumulated '
                      'micro-batches by an earlier version'):
        chainer.serializers.load_npz(old, optimizer)
    assert optimizer.pending_micro_batches == 0


@pytest.mark.parametrize('name', ['kfac', 'guarded'])
def test_several_files_inside_a_step_start_a_new_one(tmp_path, name):
    """Every old process's file loaded into one optimizer (a resume on
    another number of processes): their partial steps are other
    processes'; the step starts again, said."""
    make = _optimizers()[name]
    paths = [_saved_inside_a_step(tmp_path, make, 'rank{}.npz'.format(r))
             for r in range(2)]
    for rank, path in enumerate(paths):      # as two processes saved them
        with numpy.load(path) as stored:
            arrays = dict(stored.items())
        arrays['accumulation/origin'] = numpy.array([rank, 2])
        numpy.savez(path, **arrays)
    optimizer = make()
    optimizer.setup(L.Classifier(_MLP()))
    chainer.serializers.load_npz(paths[0], optimizer, strict=False)
    assert optimizer.pending_micro_batches == 1
    with pytest.warns(UserWarning, match='in several files'):
        chainer.serializers.load_npz(paths[1], optimizer, strict=False)
    assert optimizer.pending_micro_batches == 0
    assert not optimizer.accumulator._sums


@pytest.mark.parametrize('name', ['kfac', 'guarded'])
def test_the_same_file_loaded_twice_gives_its_step_once(tmp_path, name):
    """A file loaded again (``load_npz(path, trainer)`` before ``run()``
    beside a snapshot's autoload) replaces the step it gave: it was taken
    for another process's file and the step dropped."""
    make = _optimizers()[name]
    path = _saved_inside_a_step(tmp_path, make, 'once.npz')
    optimizer = make()
    optimizer.setup(L.Classifier(_MLP()))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        for _ in range(2):
            chainer.serializers.load_npz(path, optimizer)
    assert optimizer.pending_micro_batches == 1


@pytest.mark.parametrize('name', ['kfac', 'guarded'])
def test_an_earlier_versions_file_loads_with_strict_false(tmp_path, name):
    """``strict=False`` (the elastic resume's load) gives the default for
    a key a file lacks instead of raising ``KeyError``: an earlier
    version's file raised ``TypeError`` (``int()`` of None)."""
    make = _optimizers()[name]
    path = _saved_inside_a_step(tmp_path, make, 'new.npz')
    with numpy.load(path) as stored:
        kept = {k: v for k, v in stored.items()
                if 'accumulation/' not in k and
                (name == 'kfac' or k != 'micro_batch')}
    old = str(tmp_path / 'old.npz')
    numpy.savez(old, **kept)
    optimizer = make()
    optimizer.setup(L.Classifier(_MLP()))
    if name == 'kfac':          # its earlier files said how many were done
        with pytest.warns(UserWarning, match='by an earlier version'):
            chainer.serializers.load_npz(old, optimizer, strict=False)
    else:
        chainer.serializers.load_npz(old, optimizer, strict=False)
    assert optimizer.pending_micro_batches == 0


@pytest.mark.parametrize('net', [_MLP, _ConvBN], ids=['mlp', 'conv-bn'])
@pytest.mark.parametrize('name', sorted(_optimizers()))
def test_a_flush_right_after_a_resume_inside_a_step(tmp_path, name, net):
    """``flush_accumulation()`` straight after the load (a run ending at
    the snapshot's iteration): the step of the micro-batch saved, as the
    uninterrupted run's flush takes it. It added the fresh parameters'
    gradient (Chainer fills it with NaN) and skipped the step; and with
    eq. (20) 'auto' (conv-BN), whose decision needs a step's graph, the
    flush went without it (the conv's W 0.147 off): the snapshot keeps the
    decision."""
    make = _optimizers()[name]
    results = []
    for resumed in (False, True):
        numpy.random.seed(0)
        model = L.Classifier(net())
        optimizer = make()
        optimizer.setup(model)
        x, t = helpers.data(n=8, shape=net.in_shape, n_class=3, seed=1)
        optimizer.update(model, x[:4], t[:4])
        optimizer.update(model, x[4:], t[4:])
        optimizer.update(model, x[:4], t[:4])
        if resumed:
            path = str(tmp_path / 'mid.npz')
            chainer.serializers.save_npz(path, optimizer)
            chainer.serializers.save_npz(path + '.model', model)
            numpy.random.seed(5)
            model = L.Classifier(net())
            optimizer = make()
            optimizer.setup(model)
            chainer.serializers.load_npz(path, optimizer)
            chainer.serializers.load_npz(path + '.model', model)
        assert optimizer.flush_accumulation() == 1
        assert not optimizer.last_step_skipped
        results.append({k: p.array.copy() for k, p in model.namedparams()})
    for key, value in results[0].items():
        numpy.testing.assert_array_equal(results[1][key], value, key)


class _LazyMLP(chainer.Chain):
    in_shape = (5,)

    def __init__(self):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.l1 = L.Linear(None, 4)
            self.l2 = L.Linear(None, 3)

    def forward(self, x):
        return self.l2(chainer.functions.tanh(self.l1(x)))


def test_a_lazy_models_step_saved_again_before_its_next_update(tmp_path):
    """Loaded into lazily sized links (the optimizer first, Chainer's
    order), the factors' sums wait for the links' arrays; saved again
    before the next update (ChainerMN's snapshot writes right after its
    autoload) they were lost (an auditor: 0.467 off)."""
    def make():
        return helpers.kfac(lr=0.05, acc_iters=2)

    def fresh():
        with helpers.float64_links():
            model = L.Classifier(_LazyMLP())
        optimizer = make()
        optimizer.setup(model)
        return model, optimizer
    x, t = helpers.data(n=12, shape=(5,), n_class=3, seed=1)
    batches = [(x[i:i + 4], t[i:i + 4]) for i in (0, 4, 8)]
    numpy.random.seed(0)
    model, optimizer = fresh()
    optimizer.update(model, *batches[0])
    first = str(tmp_path / 'first.npz')
    chainer.serializers.save_npz(first, optimizer)
    chainer.serializers.save_npz(first + '.model', model)
    for batch in batches[1:]:
        optimizer.update(model, *batch)
    uninterrupted = {k: p.array.copy() for k, p in model.namedparams()}
    model, optimizer = fresh()
    chainer.serializers.load_npz(first, optimizer)
    chainer.serializers.load_npz(first + '.model', model)
    again = str(tmp_path / 'again.npz')
    chainer.serializers.save_npz(again, optimizer)
    chainer.serializers.save_npz(again + '.model', model)
    model, optimizer = fresh()
    chainer.serializers.load_npz(again, optimizer)
    chainer.serializers.load_npz(again + '.model', model)
    for batch in batches[1:]:
        optimizer.update(model, *batch)
    for key, value in uninterrupted.items():
        numpy.testing.assert_array_equal(
            dict(model.namedparams())[key].array, value, key)
