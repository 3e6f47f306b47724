"""A skipped step (a non-finite direction) leaves the running statistics
as the step's forward found them, as its warning says: also where the
model was copied or loaded into between steps, and after an optimizer
snapshot was loaded into a loop that runs its own forward.

Found by a stranger's run (2026-11-27): a skipped step put back the
statistics of ``setup`` or of the end of the last step (a model loaded
since was undone), and after ``load_npz(optimizer)`` a hand-written loop's
skipped step left NaN in them."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import chainer
import numpy
import pytest

from chainerkfac.optimizers import GuardedOptimizer
from tests.chainerkfac import helpers


def _optimizer(kind):
    if kind == 'kfac':
        return helpers.kfac()
    return GuardedOptimizer(chainer.optimizers.MomentumSGD(lr=0.1))


def _statistics(model):
    return {name: numpy.array(getattr(link, key))
            for name, link in model.namedlinks()
            for key in ('avg_mean', 'avg_var')
            if isinstance(link, chainer.links.BatchNormalization)
            for name in [name + '/' + key]}


def _bad(x):
    x = x.copy()
    x[0] = numpy.nan
    return x


def _manual(optimizer, model, x, t):
    model.cleargrads()
    helpers.loss_of(model)(x, t).backward()
    optimizer.update()


@pytest.mark.parametrize('kind', ['kfac', 'guarded'])
@pytest.mark.parametrize('steps_before', [0, 2])
def test_statistics_changed_between_steps_are_kept(kind, steps_before):
    """``update(lossfun)``: the statistics set after the last step
    (``copyparams`` of a pretrained model, here by hand) stay."""
    x, t = helpers.data(n=4)
    numpy.random.seed(0)
    model = helpers.ConvNet(bn=True)
    optimizer = _optimizer(kind)
    optimizer.setup(model)
    for _ in range(steps_before):
        optimizer.update(helpers.loss_of(model), x, t)
    for link in model.links():
        if isinstance(link, chainer.links.BatchNormalization):
            link.avg_mean[...] = 5.0
            link.avg_var[...] = 3.0
    before = _statistics(model)
    optimizer.update(helpers.loss_of(model), _bad(x), t)
    assert optimizer.last_step_skipped
    after = _statistics(model)
    for name, value in before.items():
        numpy.testing.assert_array_equal(after[name], value, err_msg=name)


@pytest.mark.parametrize('kind', ['kfac', 'guarded'])
def test_a_loaded_optimizer_in_a_hand_written_loop(kind, tmp_path):
    """``loss.backward(); optimizer.update()`` after ``load_npz`` of the
    optimizer: a skipped step leaves the statistics as they were, finite
    (it left NaN: the load dropped the guard's copy, and only
    ``update(lossfun)`` took a new one)."""
    x, t = helpers.data(n=4)
    numpy.random.seed(0)
    model = helpers.ConvNet(bn=True)
    optimizer = _optimizer(kind)
    optimizer.setup(model)
    for _ in range(3):
        _manual(optimizer, model, x, t)
    path = str(tmp_path / 'optimizer.npz')
    chainer.serializers.save_npz(path, optimizer)
    loaded = _optimizer(kind)
    loaded.setup(model)
    chainer.serializers.load_npz(path, loaded)
    before = _statistics(model)
    _manual(loaded, model, _bad(x), t)
    assert loaded.last_step_skipped
    after = _statistics(model)
    for name, value in before.items():
        assert numpy.isfinite(after[name]).all(), name
        numpy.testing.assert_array_equal(after[name], value, err_msg=name)
