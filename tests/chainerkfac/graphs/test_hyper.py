"""Hyperparameters in device memory (chainerkfac/graphs/hyper.py), on the
CPU's NumPy twins: the views hold the value rounded to the dtype in which
the update rule computes, so a step reading them is the step with host
floats."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import numpy
import pytest

import chainer
import chainer.links as L

from chainerkfac.graphs import hyper
from chainerkfac.graphs import step as graphs_step
from tests.gpu import support


def _train(on_device: bool, fp32_update: bool, steps: int = 4,
           device: str = '@numpy'):
    numpy.random.seed(0)
    link = L.Linear(5, 3)
    for param in link.params():
        param.array = param.array.astype(numpy.float16)
    link.to_device(device)
    xp = link.xp
    optimizer = chainer.optimizers.MomentumSGD(lr=0.1, momentum=0.9)
    optimizer.setup(link)
    if fp32_update:
        optimizer.use_fp32_update()
    adapter = graphs_step.ChainerOptimizer(
        optimizer, hyperparameters_on_device=on_device)
    rng = numpy.random.RandomState(1)
    for step in range(steps):
        optimizer.lr = 0.1 * 0.7 ** step       # a schedule: new values
        for param in link.params():
            param.grad = xp.asarray(
                rng.randn(*param.shape).astype(numpy.float16))
        adapter.before_step()
        optimizer.update()
    return link, optimizer


@pytest.mark.parametrize('fp32_update', [True, False])
def test_float16_parameters_read_views_of_their_update_dtype(fp32_update):
    """Under ``use_fp32_update`` Chainer updates a float32 copy of a
    float16 parameter: its rule gets float32 views (a float16 view would
    round η and m to float16, and a CuPy kernel typed ``T lr`` refuses a
    float16 scalar beside float32 arrays). Without it the views are
    float16, as the parameter."""
    link, optimizer = _train(True, fp32_update)
    expected = numpy.float32 if fp32_update else numpy.float16
    for param in link.params():
        for name in ('lr', 'momentum'):
            view = param.update_rule.hyperparam.__dict__[name]
            assert view.dtype == expected, (param.name, name)
        assert hyper.update_dtype(param) == expected
    host, _ = _train(False, fp32_update)
    for (name, a), (_, b) in zip(sorted(link.namedparams()),
                                 sorted(host.namedparams())):
        numpy.testing.assert_array_equal(a.array, b.array, err_msg=name)
        if fp32_update:
            numpy.testing.assert_array_equal(
                a.update_rule._fp32_param.array,
                b.update_rule._fp32_param.array, err_msg=name)


@pytest.mark.gpu
def test_gpu_float16_parameters_with_fp32_update_take_device_values():
    """Chainer's MomentumSGD kernel (``T grad, T lr, T momentum``) on the
    float32 copies, with the device views: it refused a float16 view."""
    support.cupy_or_skip()
    link, _ = _train(True, True, device='@cupy:0')
    host, _ = _train(False, True, device='@cupy:0')
    for (name, a), (_, b) in zip(sorted(link.namedparams()),
                                 sorted(host.namedparams())):
        numpy.testing.assert_array_equal(
            chainer.backend.CpuDevice().send(a.array),
            chainer.backend.CpuDevice().send(b.array), err_msg=name)


def test_views_round_as_a_kernel_of_their_dtype_would():
    scalars = hyper.DeviceScalars(('lr',), chainer.get_device('@numpy'))
    scalars.write({'lr': 0.1})
    for dtype in (numpy.float16, numpy.float32, numpy.float64):
        view = scalars.view('lr', dtype)
        assert view.shape == () and view.dtype == dtype
        assert view == dtype(0.1)
        assert scalars.view('lr', dtype) is view     # the same object
    scalars.write({'lr': 0.25})                      # in place
    assert scalars.view('lr', numpy.float16) == 0.25


def test_a_layers_own_lr_stays_its_own():
    """A parameter's own learning rate (``update_rule.hyperparam.lr``)
    was replaced by the view of the optimizer's: under CUDA graphs a
    layer-wise lr was lost, silently. It stays, the steps equal the
    host's, it counts among the values a capture bakes (a change of it
    captures again), and the bounded step reads it as the parameter's."""
    from chainerkfac import step_bound

    def train(on_device):
        numpy.random.seed(0)
        link = L.Linear(5, 3)
        optimizer = chainer.optimizers.MomentumSGD(lr=0.1, momentum=0.9)
        optimizer.setup(link)
        link.b.update_rule.hyperparam.lr = 0.5
        adapter = graphs_step.ChainerOptimizer(
            optimizer, hyperparameters_on_device=on_device)
        rng = numpy.random.RandomState(1)
        for step in range(3):
            optimizer.lr = 0.1 * 0.7 ** step
            for param in link.params():
                param.grad = rng.randn(*param.shape).astype(numpy.float32)
            adapter.before_step()
            optimizer.update()
        return link, adapter

    link, adapter = train(True)
    assert link.b.update_rule.hyperparam.lr == 0.5
    assert link.b.update_rule.device_hyperparameters == {'momentum'}
    assert link.W.update_rule.device_hyperparameters == {'lr', 'momentum'}
    assert step_bound.own_lr(link.b) == 0.5
    assert step_bound.own_lr(link.W) is None
    host, _ = train(False)
    for (name, a), (_, b) in zip(sorted(link.namedparams()),
                                 sorted(host.namedparams())):
        numpy.testing.assert_array_equal(a.array, b.array, err_msg=name)
    baked = adapter.baked()
    link.b.update_rule.hyperparam.lr = 0.25
    assert adapter.baked() != baked


def test_a_layers_own_lr_set_after_the_first_binding_stays_its_own():
    """An lr of its own given to a layer after the rules were bound (a
    graphed run's first step: the rule held the view of the optimizer's)
    was replaced by that view again at the next step, silently. It stays,
    and counts among the baked values; a view of an earlier binding
    (another graph's scalars) is the optimizer's and is replaced."""
    link = L.Linear(5, 3)
    optimizer = chainer.optimizers.MomentumSGD(lr=0.1, momentum=0.9)
    optimizer.setup(link)
    adapter = graphs_step.ChainerOptimizer(optimizer,
                                           hyperparameters_on_device=True)
    adapter.before_step()
    assert link.b.update_rule.device_hyperparameters == {'lr', 'momentum'}
    baked = adapter.baked()
    link.b.update_rule.hyperparam.lr = 0.5
    adapter.before_step()
    assert link.b.update_rule.hyperparam.lr == 0.5
    assert link.b.update_rule.device_hyperparameters == {'momentum'}
    assert adapter.baked() != baked
    # another adapter (a new graph): its own views replace the old ones
    old_view = link.W.update_rule.hyperparam.lr
    other = graphs_step.ChainerOptimizer(optimizer,
                                         hyperparameters_on_device=True)
    other.before_step()
    assert link.W.update_rule.hyperparam.lr is not old_view
    assert other._scalars.holds(link.W.update_rule.hyperparam.lr)
    assert link.b.update_rule.hyperparam.lr == 0.5
