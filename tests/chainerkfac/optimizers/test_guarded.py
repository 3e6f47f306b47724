"""GuardedOptimizer: a Chainer optimizer driven like K-FAC (accumulation,
skipped-step guard) — against the same optimizer driven by hand."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import numpy
import pytest

import chainer

from chainerkfac.optimizers import GuardedOptimizer
from tests.chainerkfac import helpers


def _sgd():
    return chainer.optimizers.MomentumSGD(lr=0.1, momentum=0.9)


@pytest.mark.parametrize('manual', [False, True])
def test_accumulated_steps_equal_plain_sgd_on_the_whole_batch(manual):
    x, t = helpers.data(n=8)
    numpy.random.seed(0)
    model = helpers.ConvNet(bn=True)
    reference = model.copy('copy')
    initial = {n: p.array.copy() for n, p in model.namedparams()}
    optimizer = GuardedOptimizer(_sgd(), acc_iters=2).setup(model)
    plain = _sgd().setup(reference)
    lossfun = helpers.loss_of(model)
    for _ in range(3):
        for chunk in (slice(0, 4), slice(4, 8)):
            helpers.update(optimizer, model, lossfun, x[chunk], t[chunk],
                           manual)
        assert optimizer.pending_micro_batches == 0
        # The reference: the mean of the two chunks' gradients by hand.
        reference.cleargrads()
        loss = (helpers.loss_of(reference)(x[:4], t[:4]) +
                helpers.loss_of(reference)(x[4:], t[4:])) / 2
        loss.backward()
        plain.update()
    for name, param in reference.namedparams():
        got = dict(model.namedparams())[name].array
        numpy.testing.assert_allclose(got, param.array, rtol=1e-12,
                                      atol=1e-14, err_msg=name)
        assert not numpy.array_equal(got, initial[name]), name


def test_a_non_finite_gradient_skips_the_step_and_restores_statistics():
    x, t = helpers.data(n=4)
    numpy.random.seed(0)
    model = helpers.ConvNet(bn=True)
    optimizer = GuardedOptimizer(_sgd()).setup(model)
    optimizer.update(helpers.loss_of(model), x, t)
    before = {n: p.array.copy() for n, p in model.namedparams()}
    mean = model.bn.avg_mean.copy()
    bad = x.copy()
    bad[0, 0, 0, 0] = numpy.nan
    optimizer.update(helpers.loss_of(model), bad, t)
    assert optimizer.last_step_skipped
    for name, param in model.namedparams():
        numpy.testing.assert_array_equal(param.array, before[name])
    numpy.testing.assert_array_equal(model.bn.avg_mean, mean)
    optimizer.update(helpers.loss_of(model), x, t)
    assert not optimizer.last_step_skipped
    assert optimizer.guard.skipped_steps == 1


def test_attributes_reach_the_wrapped_optimizer_and_flush_steps():
    model = helpers.MLP()
    optimizer = GuardedOptimizer(_sgd(), acc_iters=3).setup(model)
    optimizer.lr = 0.05              # as a Trainer extension sets it
    assert optimizer.actual_optimizer.lr == 0.05
    x, t = helpers.data(n=4, shape=(5,), n_class=3)
    optimizer.update(helpers.loss_of(model), x, t)
    assert optimizer.flush_accumulation() == 1
    assert optimizer.actual_optimizer.t == 1
    assert optimizer.flush_accumulation() == 0
    # told the micro-batches over all processes (here its own): the same
    assert optimizer.flush_accumulation(global_micro_batches=0) == 0
    assert optimizer.actual_optimizer.t == 1
    with pytest.raises(ValueError, match='GuardedOptimizer: acc_iters=0'):
        GuardedOptimizer(_sgd(), acc_iters=0)


class _ScaledMLP(helpers.MLP):
    """An MLP with a 0-d parameter (a learned scalar gain)."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.gain = chainer.Parameter(numpy.array(1.5))

    def forward(self, x):
        return super().forward(x) * self.gain


@pytest.mark.parametrize('kfac', [False, True])
@pytest.mark.parametrize('manual', [False, True])
def test_a_scalar_parameter_accumulates(kfac, manual):
    """NumPy's sum of two 0-d gradients is a scalar, not an array: the
    accumulated step failed (``Type of grad is invalid``)."""
    x, t = helpers.data(n=8, shape=(5,), n_class=3)
    model = _ScaledMLP()
    reference = model.copy('copy')
    optimizer = helpers.kfac(lr=0.1, acc_iters=2) if kfac else \
        GuardedOptimizer(_sgd(), acc_iters=2)
    optimizer.setup(model)
    lossfun = helpers.loss_of(model)
    for chunk in (slice(0, 4), slice(4, 8)):
        helpers.update(optimizer, model, lossfun, x[chunk], t[chunk], manual)
    assert isinstance(model.gain.array, numpy.ndarray)
    assert model.gain.array.shape == ()
    reference.cleargrads()
    ((helpers.loss_of(reference)(x[:4], t[:4]) +
      helpers.loss_of(reference)(x[4:], t[4:])) / 2).backward()
    if not kfac:
        _sgd().setup(reference).update()
        numpy.testing.assert_allclose(model.gain.array, reference.gain.array,
                                      rtol=1e-12)
    else:
        assert model.gain.array != 1.5


def test_a_skipped_step_halves_a_dynamic_loss_scale():
    """The step GuardedOptimizer skips never reaches the optimizer's
    update, which follows a dynamic scale: the scale stayed where it
    overflowed, and every later step was skipped."""
    x, t = helpers.data(n=8)
    numpy.random.seed(0)
    model = helpers.ConvNet(bn=True)
    inner = _sgd()
    optimizer = GuardedOptimizer(inner).setup(model)
    inner.loss_scaling(interval=1000)
    for _ in range(3):
        optimizer.update(helpers.loss_of(model), x, t)
    assert inner._loss_scale == 8.0 and not optimizer.last_step_skipped
    inner._loss_scale = float('inf')            # the backward overflows
    optimizer.update(helpers.loss_of(model), x, t)
    assert optimizer.last_step_skipped
    assert inner._loss_scale == 65504           # halved, Chainer's cap
    optimizer.update(helpers.loss_of(model), x, t)
    assert not optimizer.last_step_skipped


@pytest.mark.parametrize('wrapped, match', [
    (lambda: helpers.kfac(), 'KFAC accumulates micro-batches'),
    (lambda: 'sgd', "actual_optimizer='sgd' is not a Chainer optimizer"),
    (lambda: None, 'actual_optimizer=None is not a Chainer optimizer'),
    (lambda: chainer.optimizers.MomentumSGD,
     'is not a Chainer optimizer instance'),
])
def test_what_it_cannot_drive_is_refused_at_construction(wrapped, match):
    """GuardedOptimizer(KFAC(...)) was accepted: its accumulation clears
    the gradients at each micro-batch, so K-FAC's factors saw the last
    micro-batch only (a step 37 % off KFAC(acc_iters=2)'s); a string, None
    or a class failed at setup with an AttributeError."""
    with pytest.raises(TypeError, match=match):
        GuardedOptimizer(wrapped(), 2)


def test_its_own_arguments_are_checked_where_they_are_set():
    sgd = chainer.optimizers.MomentumSGD
    with pytest.raises(TypeError, match="comm='naive' is not a ChainerMN "
                       'communicator'):
        GuardedOptimizer(sgd(), 1, 'naive')
    # NumPy's bool as KFAC takes it (the message said "shard_update=True
    # must be True or False")
    assert GuardedOptimizer(sgd(), 1, None,
                            shard_update=numpy.bool_(True)).shard_update \
        is True
    with pytest.raises(ValueError, match='shard_update'):
        GuardedOptimizer(sgd(), 1, None, shard_update='yes')
    optimizer = GuardedOptimizer(sgd(), 2)
    with pytest.raises(ValueError, match=r'acc_iters=-3.*int >= 1'):
        optimizer.acc_iters = -3
    optimizer.acc_iters = 3
    assert optimizer.acc_iters == 3
    optimizer.acc_iters = numpy.float64(2.0)     # StepShift's value
    assert optimizer.acc_iters == 2 and type(optimizer.acc_iters) is int
    with pytest.raises(ValueError, match=r'acc_iters=2\.5'):
        optimizer.acc_iters = 2.5


def test_a_snapshot_inside_an_accumulation_loads_the_step_so_far(tmp_path):
    """Saved after 1 of 2 micro-batches, before any step: it loads (the
    rules had no state yet: ``KeyError: 'l1/W/v'``) with the micro-batch
    pending (it was dropped, with a warning at the save); nothing is
    said."""
    import warnings
    x, t = helpers.data(n=4, shape=(5,), n_class=3)
    model = helpers.MLP()
    optimizer = GuardedOptimizer(_sgd(), acc_iters=2).setup(model)
    optimizer.update(helpers.loss_of(model), x, t)
    path = str(tmp_path / 'first.npz')
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        chainer.serializers.save_npz(path, optimizer)
    # saving changed nothing: the rules have their state from their first
    # update, as before
    assert all(p.update_rule.state is None for p in model.params())
    other = GuardedOptimizer(_sgd(), acc_iters=2).setup(helpers.MLP())
    chainer.serializers.load_npz(path, other)
    assert other.pending_micro_batches == 1
    optimizer.update(helpers.loss_of(model), x, t)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        chainer.serializers.save_npz(str(tmp_path / 'end.npz'), optimizer)
