"""Where Chainer's optimizer hooks act in a K-FAC step
(:mod:`chainerkfac.optimizers.hooks`): penalties on ∇L before the
preconditioning, clipping on the preconditioned direction, ``'post'``
hooks after the update. Each is compared with the same K-FAC step taken
by hand from a run without the hook (float64, momentum 0: the step is
``−η d``)."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import numpy
import pytest

import chainer.functions as F
from chainer import optimizer_hooks

from tests.chainerkfac import helpers

LR = 0.5


def _step(hooks=(), loss=None, rule_hooks=None, frozen=(), **options):
    """One K-FAC step of helpers.ConvNet(bn=True) with ``hooks`` (and
    ``rule_hooks(name)``: the hooks of that parameter's own rule), the
    links named in ``frozen`` disabled; returns the model before and
    after and the raw gradients left in it."""
    numpy.random.seed(0)
    model = helpers.ConvNet(bn=True)
    before = {n: p.array.copy() for n, p in model.namedparams()}
    x, t = helpers.data(n=6)
    optimizer = helpers.kfac(lr=LR, momentum=0.0, damping=1e-2,
                             skip_layers=['/fc/b'.rsplit('/', 1)[0]]
                             if options.pop('plain_fc', False) else (),
                             **options).setup(model)
    for name in frozen:
        getattr(model, name).disable_update()
    for hook in hooks:
        optimizer.add_hook(hook)
    for name, param in model.namedparams():
        for hook in (rule_hooks(name) if rule_hooks else ()):
            param.update_rule.add_hook(hook)

    def lossfun(x, t):
        value = F.softmax_cross_entropy(model(x), t)
        return value if loss is None else value + loss(model)
    optimizer.update(lossfun, x, t)
    after = {n: p.array.copy() for n, p in model.namedparams()}
    grads = {n: p.grad.copy() for n, p in model.namedparams()}
    return before, after, grads


def _directions(before, after):
    return {n: (before[n] - after[n]) / LR for n in before}


def _assert_same(a, b, rtol=1e-11):
    for name in a:
        numpy.testing.assert_allclose(a[name], b[name], rtol=rtol,
                                      atol=1e-13, err_msg=name)


def test_weight_decay_is_the_natural_gradient_of_the_penalised_loss():
    rate = 1e-2
    _, hooked, _ = _step([optimizer_hooks.WeightDecay(rate)])

    def penalty(model):
        return rate / 2 * sum(F.sum(p * p) for p in model.params())
    _, penalised, _ = _step(loss=penalty)
    _assert_same(hooked, penalised)


def test_a_parameters_own_weight_decay_penalises_that_parameter():
    """Weight decay on the weights only, through their own rules (the
    usual way to spare biases and BN): the step of the loss penalised on
    the weights only. K-FAC's step ignored such hooks."""
    rate = 1e-2
    _, hooked, _ = _step(rule_hooks=lambda name: [
        optimizer_hooks.WeightDecay(rate)] if name.endswith('/W') else [])

    def penalty(model):
        return rate / 2 * sum(F.sum(p * p) for n, p in model.namedparams()
                              if n.endswith('/W'))
    _, penalised, _ = _step(loss=penalty)
    _, plain, _ = _step()
    _assert_same(hooked, penalised)
    assert not numpy.allclose(hooked['/conv/W'], plain['/conv/W'])


def test_hard_clipping_on_every_rule_is_the_optimizers():
    """GradientHardClipping added to each parameter's rule clips each
    one's direction, as the optimizer's does all of them."""
    bound = 0.05
    _, own, _ = _step(rule_hooks=lambda name: [
        optimizer_hooks.GradientHardClipping(-bound, bound)])
    _, optimizers, _ = _step([optimizer_hooks.GradientHardClipping(
        -bound, bound)])
    _assert_same(own, optimizers)
    before, plain, _ = _step()
    assert max(abs(_directions(before, plain)[n]).max()
               for n in plain) > bound          # it clipped something


def test_a_rules_hook_runs_once_a_step():
    calls = []

    def hook(rule, param):
        calls.append(param.name)
    hook.name = 'count'
    hook.timing = 'pre'
    _step(rule_hooks=lambda name: [hook] if name == '/fc/W' else [])
    assert calls == ['W']


def test_lasso_is_the_natural_gradient_of_the_penalised_loss():
    rate = 1e-3
    _, hooked, _ = _step([optimizer_hooks.Lasso(rate)])

    def penalty(model):
        return rate * sum(F.sum(F.absolute(p)) for p in model.params())
    _, penalised, _ = _step(loss=penalty)
    _assert_same(hooked, penalised)


@pytest.mark.parametrize('plain_fc', [False, True])
def test_gradient_clipping_bounds_the_direction(plain_fc):
    """The update is η times the direction scaled to the threshold (the
    norm over all parameters, curved blocks and plain ones alike), and
    the raw gradients are left as the backward pass made them."""
    before, free, raw = _step(plain_fc=plain_fc)
    direction = _directions(before, free)
    norm = numpy.sqrt(sum(float((d * d).sum()) for d in direction.values()))
    threshold = norm / 3
    _, clipped, grads = _step([optimizer_hooks.GradientClipping(threshold)],
                              plain_fc=plain_fc)
    _assert_same(_directions(before, clipped),
                 {n: d * (threshold / norm) for n, d in direction.items()})
    _assert_same(grads, raw, rtol=0)
    # A threshold above the norm changes nothing.
    _, loose, _ = _step([optimizer_hooks.GradientClipping(2 * norm)],
                        plain_fc=plain_fc)
    _assert_same(loose, free)


def test_gradient_clipping_leaves_a_frozen_links_gradient_out():
    """The norm is over the directions of the parameters that train: a
    frozen link's raw gradient (other units, no direction) counted in it,
    and the others' steps were clipped too hard (0.036 for 0.05 in a
    reviewer's MLP)."""
    before, free, _ = _step(frozen=['conv'])
    direction = _directions(before, free)
    assert not any(direction[n].any() for n in ('/conv/W', '/conv/b'))
    norm = numpy.sqrt(sum(float((d * d).sum()) for d in direction.values()))
    threshold = norm / 3
    _, clipped, grads = _step([optimizer_hooks.GradientClipping(threshold)],
                              frozen=['conv'])
    assert float(numpy.abs(grads['/conv/W']).max()) > 0   # it has one
    _assert_same(_directions(before, clipped),
                 {n: d * (threshold / norm) for n, d in direction.items()})


def test_gradient_hard_clipping_clips_each_element_of_the_direction():
    before, free, _ = _step()
    direction = _directions(before, free)
    bound = 0.5 * max(float(numpy.abs(d).max()) for d in direction.values())
    _, clipped, _ = _step([optimizer_hooks.GradientHardClipping(-bound,
                                                                bound)])
    _assert_same(_directions(before, clipped),
                 {n: numpy.clip(d, -bound, bound)
                  for n, d in direction.items()})
    assert any((numpy.abs(d) > bound).any() for d in direction.values())


def test_clipping_applies_after_the_bounded_step():
    """kl_clip scales the curved blocks first; the clipping sees the
    scaled direction."""
    before, bounded, _ = _step(kl_clip=1e-4)
    direction = _directions(before, bounded)
    norm = numpy.sqrt(sum(float((d * d).sum()) for d in direction.values()))
    _, both, _ = _step([optimizer_hooks.GradientClipping(norm / 2)],
                       kl_clip=1e-4)
    _assert_same(_directions(before, both),
                 {n: d / 2 for n, d in direction.items()})


def test_other_pre_hooks_see_the_raw_gradient_and_post_hooks_the_update():
    seen = {}

    def pre(optimizer):
        seen['pre'] = {n: p.grad.copy()
                       for n, p in optimizer.target.namedparams()}
    pre.name, pre.timing = 'record_pre', 'pre'

    def post(optimizer):
        seen['post'] = {n: p.array.copy()
                        for n, p in optimizer.target.namedparams()}
    post.name, post.timing = 'record_post', 'post'
    _, after, grads = _step([pre, post])
    _assert_same(seen['pre'], grads, rtol=0)
    _assert_same(seen['post'], after, rtol=0)
