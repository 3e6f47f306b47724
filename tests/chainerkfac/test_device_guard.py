"""DeviceStepGuard on the CPU (its NumPy twin, through the same decisions
as on the GPU): in K-FAC and GuardedOptimizer, steps equal the host
guard's to the bit (the same operations: the update is launched, and
undone only where the flag is set); a non-finite step leaves weights,
velocities and BatchNormalization statistics as they were; the first step
(rules without state) and the agreed check decide on the host; forget();
arrays reallocated within a step are refused. The CUDA kernels run in
tests/gpu/test_kfac_graphs_gpu.py."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import numpy
import pytest

import chainer

from chainerkfac.device_guard import DeviceStepGuard
from chainerkfac.optimizers import GuardedOptimizer
from tests.chainerkfac import helpers


def _install(optimizer, target):
    guard = DeviceStepGuard()
    guard.checkpoint(target)
    optimizer.guard = guard
    return guard


def _kfac_pair(**kwargs):
    kwargs.setdefault('damping', 1e-2)
    runs = []
    for _ in range(2):
        numpy.random.seed(0)
        model = helpers.ConvNet(bn=True)
        optimizer = helpers.kfac(lr=0.05, momentum=0.9,
                                 **kwargs).setup(model)
        runs.append((model, optimizer))
    _install(runs[1][1], runs[1][0])
    return runs


def _state(model, optimizer):
    out = {n: p.array.copy() for n, p in model.namedparams()}
    out.update({n + '/v': p.update_rule.state['v'].copy()
                for n, p in model.namedparams()
                if p.update_rule.state is not None})
    out['avg_mean'] = model.bn.avg_mean.copy()
    out['avg_var'] = model.bn.avg_var.copy()
    return out


def _assert_same(a, b):
    assert sorted(a) == sorted(b)
    for key in a:
        numpy.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize('interval', [1, 3])
def test_kfac_steps_equal_the_host_guard(interval):
    x, t = helpers.data(n=6)
    runs = _kfac_pair(refresh_interval_a=interval,
                      refresh_interval_g=interval, weight_rescale=True,
                      damping=1e-1, damping_target=1e-2,
                      damping_warmup_steps=5)
    observed = []
    for model, optimizer in runs:
        lossfun = helpers.loss_of(model)
        observations = []
        for step in range(6):
            optimizer.lr = 0.05 / (1 + step)
            observation = {}
            with chainer.reporter.Reporter().scope(observation):
                optimizer.update(lossfun, x, t)
            observations.append(observation)
        observed.append(observations)
    _assert_same(_state(*runs[0]), _state(*runs[1]))
    assert observed[0] == observed[1]
    assert runs[0][1].damping == runs[1][1].damping
    assert not runs[1][1].last_step_skipped


def _bad(x):
    bad = x.copy()
    bad[0, 0, 0, 0] = numpy.nan
    return bad


def test_kfac_non_finite_step_changes_nothing():
    x, t = helpers.data(n=6)
    (_, _), (model, optimizer) = _kfac_pair()
    lossfun = helpers.loss_of(model)
    for _ in range(2):
        optimizer.update(lossfun, x, t)
    before = _state(model, optimizer)
    observation = {}
    with chainer.reporter.Reporter().scope(observation):
        optimizer.update(lossfun, _bad(x), t)
    assert optimizer.last_step_skipped
    assert observation['kfac/skipped_step'] == 1.0
    _assert_same(_state(model, optimizer), before)
    optimizer.update(lossfun, x, t)
    assert not optimizer.last_step_skipped
    assert optimizer.guard.skipped_steps == 1
    assert all(numpy.isfinite(v).all()
               for v in _state(model, optimizer).values())


def test_guarded_optimizer_equal_and_non_finite_skipped():
    x, t = helpers.data(n=4)
    runs = []
    for device_guard in (False, True):
        numpy.random.seed(0)
        model = helpers.ConvNet(bn=True)
        optimizer = GuardedOptimizer(chainer.optimizers.MomentumSGD(
            lr=0.1, momentum=0.9)).setup(model)
        if device_guard:
            _install(optimizer, model)
        lossfun = helpers.loss_of(model)
        optimizer.update(lossfun, x, t)
        optimizer.update(lossfun, x, t)
        before = _state(model, optimizer)
        observation = {}
        with chainer.reporter.Reporter().scope(observation):
            optimizer.update(lossfun, _bad(x), t)
        assert observation['skipped_step'] == 1.0
        assert optimizer.last_step_skipped
        _assert_same(_state(model, optimizer), before)
        optimizer.update(lossfun, x, t)
        assert optimizer.guard.skipped_steps == 1
        runs.append(_state(model, optimizer))
    _assert_same(*runs)


def test_first_step_decides_on_the_host():
    # The rules have no state yet: what the update would create has no
    # copy, so the host reads the flag and does not launch it.
    x, t = helpers.data(n=4)
    numpy.random.seed(0)
    model = helpers.ConvNet(bn=True)
    optimizer = GuardedOptimizer(chainer.optimizers.MomentumSGD(
        lr=0.1)).setup(model)
    guard = _install(optimizer, model)
    before = {n: p.array.copy() for n, p in model.namedparams()}
    mean = model.bn.avg_mean.copy()
    optimizer.update(helpers.loss_of(model), _bad(x), t)
    assert guard.skipped and guard.skipped_steps == 1
    for name, param in model.namedparams():
        numpy.testing.assert_array_equal(param.array, before[name])
        assert param.update_rule.state is None     # not launched
    numpy.testing.assert_array_equal(model.bn.avg_mean, mean)


def test_agree_is_read_on_the_host():
    x, t = helpers.data(n=4)
    numpy.random.seed(0)
    model = helpers.ConvNet(bn=True)
    guard = DeviceStepGuard()
    guard.checkpoint(model)
    asked = []

    def disagree(finite):
        asked.append(finite)
        return False
    assert guard.check([x], disagree) is False
    assert asked == [True] and guard.skipped


def test_forget_keeps_weights_but_not_statistics():
    x, t = helpers.data(n=6)
    (_, _), (model, optimizer) = _kfac_pair()
    lossfun = helpers.loss_of(model)
    optimizer.update(lossfun, x, t)
    optimizer.update(lossfun, x, t)
    before = _state(model, optimizer)
    optimizer.guard.forget()
    assert not optimizer.guard.ready
    # update() without a loss function does not take a checkpoint first
    model.cleargrads()
    lossfun(_bad(x), t).backward()
    optimizer.update()
    after = _state(model, optimizer)
    for key in before:
        if key.startswith('avg_'):
            assert not numpy.array_equal(after[key], before[key])
        else:
            numpy.testing.assert_array_equal(after[key], before[key])
    assert optimizer.guard.ready


def test_arrays_reallocated_within_a_step_are_refused():
    x, t = helpers.data(n=4)
    numpy.random.seed(0)
    model = helpers.ConvNet(bn=True)
    optimizer = GuardedOptimizer(chainer.optimizers.MomentumSGD(
        lr=0.1)).setup(model)
    guard = _install(optimizer, model)
    lossfun = helpers.loss_of(model)
    optimizer.update(lossfun, x, t)
    model.cleargrads()
    lossfun(x, t).backward()
    assert guard.check([p.grad for p in model.params()])
    model.fc.W.array = model.fc.W.array.copy()
    with pytest.raises(RuntimeError, match='reallocated'):
        guard.checkpoint(model)
