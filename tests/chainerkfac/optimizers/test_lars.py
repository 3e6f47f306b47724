"""LARS (seed 002, Figures 5 and 6) against a by-hand NumPy implementation
in float64, several steps, with the default exclusions.

The oracle takes its gradients from a second copy of the model set to the
oracle's own weights, so both sides run the same backward pass and differ
only in the update; they agree to a few ulps per step (rtol 1e-12 after
five steps: norms and axpys of arrays of O(1) values, no cancellation).
"""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import numpy
import pytest

import chainer

from chainerkfac.optimizers import GuardedOptimizer, LARS
from chainerkfac.optimizers import lars as lars_module
from tests.chainerkfac import helpers

STEPS = 5
HYPER = dict(lr=0.5, momentum=0.9, weight_decay=5e-3, eta=0.02)


def oracle_step(weights, velocities, grads, form, lr, momentum,
                weight_decay, eta, excluded):
    """One step of Figure 5 ('scaled') or Figure 6 ('unscaled') by hand,
    in place, for every parameter (MLPerf's rule: trust ratio 1 where a
    norm is zero; excluded parameters: λ = lr, no weight decay)."""
    for name, w in weights.items():
        g, v = grads[name], velocities[name]
        if name in excluded:
            lam, beta = lr, 0.0
        else:
            beta = weight_decay
            w_norm = numpy.sqrt(numpy.sum(w * w))
            g_norm = numpy.sqrt(numpy.sum(g * g))
            ratio = (eta * w_norm / (g_norm + beta * w_norm)
                     if w_norm > 0 and g_norm > 0 else 1.0)
            lam = lr * ratio
        if form == 'scaled':
            v[...] = momentum * v + (g + beta * w)
            w[...] = w - lam * v
        else:
            v[...] = momentum * v + lam * (g + beta * w)
            w[...] = w - v


def _grads_at(model, weights, x, t):
    for name, param in model.namedparams():
        param.array[...] = weights[name]
    model.cleargrads()
    helpers.loss_of(model)(x, t).backward()
    return {name: p.grad.copy() for name, p in model.namedparams()}


@pytest.mark.parametrize('form', ['scaled', 'unscaled'])
def test_lars_equals_the_figures_by_hand(form):
    numpy.random.seed(0)
    model = helpers.ConvNet(bn=True)
    probe = model.copy('copy')
    optimizer = LARS(momentum_form=form, **HYPER).setup(model)
    weights = {n: p.array.copy() for n, p in model.namedparams()}
    velocities = {n: numpy.zeros_like(w) for n, w in weights.items()}
    excluded = {'/conv/b', '/bn/gamma', '/bn/beta', '/fc/b'}
    for step in range(STEPS):
        x, t = helpers.data(n=6, seed=step)
        grads = _grads_at(probe, weights, x, t)
        optimizer.update(helpers.loss_of(model), x, t)
        oracle_step(weights, velocities, grads, form, excluded=excluded,
                    **HYPER)
        for name, param in model.namedparams():
            numpy.testing.assert_allclose(
                param.array, weights[name], rtol=1e-12, atol=1e-14,
                err_msg='{} step {}'.format(name, step))
    assert set(optimizer.excluded_params()) == excluded
    for name, param in model.namedparams():
        numpy.testing.assert_allclose(param.update_rule.state['v'],
                                      velocities[name], rtol=1e-12,
                                      atol=1e-14, err_msg=name)


def test_the_two_forms_differ_and_agree_without_momentum():
    """With momentum the forms give other weights (λ changes every step);
    without, both are ``w ← w − λ (g + βw)``."""
    def run(form, momentum):
        numpy.random.seed(0)
        model = helpers.ConvNet(bn=True)
        options = dict(HYPER, momentum=momentum)
        optimizer = LARS(momentum_form=form, **options).setup(model)
        for step in range(3):
            optimizer.update(helpers.loss_of(model),
                             *helpers.data(seed=step))
        return numpy.concatenate([p.array.ravel() for _, p in
                                  sorted(model.namedparams())])
    assert not numpy.allclose(run('scaled', 0.9), run('unscaled', 0.9),
                              rtol=1e-6)
    numpy.testing.assert_allclose(run('scaled', 0.0), run('unscaled', 0.0),
                                  rtol=1e-13, atol=1e-15)


def test_unscaled_without_exclusions_equals_chainers_gradient_lars_hook():
    """Figure 6 is Chainer's MomentumSGD with its GradientLARS hook once
    the hook's threshold and ε are 0 and its learning rate is lr · eta (an
    independent implementation). Where ‖w‖ = 0 the hook's rate is 1 (a
    step of lr · eta), MLPerf's trust ratio 1 (a step of lr): no weight
    starts at zero here, and no BN precedes the convolution's bias (whose
    gradient would be 0)."""
    numpy.random.seed(1)
    model = helpers.ConvNet(bn=False)
    for param in model.params():
        param.array[...] = numpy.random.randn(*param.shape)
    reference = model.copy('copy')
    optimizer = LARS(momentum_form='unscaled', exclude=None,
                     **HYPER).setup(model)
    sgd = chainer.optimizers.MomentumSGD(
        lr=HYPER['lr'] * HYPER['eta'], momentum=HYPER['momentum'])
    sgd.setup(reference)
    sgd.add_hook(chainer.optimizer_hooks.GradientLARS(
        threshold=0.0, weight_decay=HYPER['weight_decay'], eps=0.0))
    for step in range(STEPS):
        x, t = helpers.data(seed=step)
        optimizer.update(helpers.loss_of(model), x, t)
        sgd.update(helpers.loss_of(reference), x, t)
    assert optimizer.excluded_params() == []
    for name, param in reference.namedparams():
        numpy.testing.assert_allclose(
            dict(model.namedparams())[name].array, param.array,
            rtol=1e-12, atol=1e-14, err_msg=name)


@pytest.mark.parametrize('form', ['scaled', 'unscaled'])
def test_a_zero_norm_gives_the_plain_learning_rate(form):
    """MLPerf's rule: ‖w‖ = 0 (a zero-initialised weight) gives a trust
    ratio of 1, λ = lr (and no NaN); ‖g‖ = 0 throughout is no gradient, no
    step (TensorFlow leaves a variable without gradient alone)."""
    lr, beta = 0.3, 0.1
    grad = numpy.array([[1.0, -2.0], [0.5, 0.25]])
    param = chainer.Parameter(numpy.zeros((2, 2)))
    param.grad = grad.copy()
    link = chainer.Link()
    with link.init_scope():
        link.W = param
    LARS(lr=lr, momentum=0.9, weight_decay=beta, eta=1e-3,
         momentum_form=form).setup(link).update()
    numpy.testing.assert_allclose(param.array, -lr * grad, rtol=1e-15)

    weight = numpy.array([[1.0, 2.0], [3.0, -4.0]])
    param.array[...] = weight
    param.grad = numpy.zeros((2, 2))
    param.update_rule.state['v'][...] = 0
    param.update()
    numpy.testing.assert_array_equal(param.array, weight)
    assert not param.update_rule.state['v'].any()


def test_exclusion_is_configurable():
    numpy.random.seed(0)
    model = helpers.ConvNet(bn=True)
    by_name = LARS(exclude=lambda name, p: name.startswith('/bn/'))
    by_name.setup(model)
    assert sorted(by_name.excluded_params()) == ['/bn/beta', '/bn/gamma']
    everything = LARS(exclude=None).setup(helpers.ConvNet(bn=True))
    assert everything.excluded_params() == []
    with pytest.raises(TypeError, match='exclude'):
        LARS(exclude='bias')


@pytest.mark.parametrize('kwargs, match', [
    ({'momentum_form': 'nesterov'}, 'momentum_form'),
    ({'momentum': 1.0}, 'momentum'),
    ({'eta': 0.0}, 'eta'),
    ({'lr': -1.0}, 'lr'),
    ({'weight_decay': -1e-4}, 'weight_decay'),
    # inf passed ">= 0" and gave non-finite weights at the first update
    ({'lr': float('inf')}, r"lr=inf must be a finite number >= 0"),
    ({'eta': float('inf')}, r"eta=inf must be a finite number > 0"),
    ({'weight_decay': float('inf')}, 'weight_decay=inf'),
    ({'momentum': float('nan')}, 'momentum=nan'),
    ({'lr': 10 ** 400}, 'must be a finite number'),     # was a TypeError
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LARS(**kwargs)


@pytest.mark.parametrize('where', ['optimizer', 'rule'])
def test_a_bad_form_set_later_is_refused_before_anything_moves(where):
    """``momentum_form`` set after the constructor (on the optimizer or on
    one rule) is refused before the update: no step counted, no state made
    (it was refused inside the rule, after Chainer had advanced ``t`` and
    made ``v``)."""
    model = helpers.ConvNet(bn=False)
    optimizer = LARS().setup(model)
    if where == 'optimizer':
        optimizer.momentum_form = 'Scaled'
    else:
        model.fc.W.update_rule.hyperparam.momentum_form = 'Scaled'
    weights = {n: p.array.copy() for n, p in model.namedparams()}
    with pytest.raises(ValueError, match="momentum_form='Scaled'"):
        optimizer.update(helpers.loss_of(model), *helpers.data())
    assert optimizer.t == 0
    for name, param in model.namedparams():
        assert param.update_rule.t == 0 and param.update_rule.state is None
        numpy.testing.assert_array_equal(param.array, weights[name])


def test_lazily_initialised_links_are_decided_at_their_first_update():
    numpy.random.seed(0)
    model = helpers.ConvNet(bn=False)
    with helpers.float64_links():
        model.fc = chainer.links.Linear(None, 4)
    optimizer = LARS().setup(model)
    optimizer.update(helpers.loss_of(model), *helpers.data())
    assert model.fc.W.update_rule.excluded is False
    assert model.fc.b.update_rule.excluded is True


@pytest.mark.parametrize('form', ['scaled', 'unscaled'])
def test_gpu_kernel_text_is_the_cpu_expressions(form):
    """The GPU kernel's body, read as NumPy statements on whole arrays
    (elementwise, in the same order), gives the CPU path's step."""
    rng = numpy.random.RandomState(0)
    w, v, g = rng.randn(3, 4), rng.randn(3, 4), rng.randn(3, 4)
    lr, eta, decay, momentum = 0.7, 0.1, 0.01, 0.9
    lam = lars_module.trust_lambda(w, g, lr, eta, decay)
    names = dict(grad=g, lam=lam, decay=decay, momentum=momentum,
                 param=w.copy(), v=v.copy())
    exec(lars_module._KERNEL_BODIES[form], {}, names)   # active: g != 0

    param = chainer.Parameter(w.copy())
    param.grad = g.copy()
    param.update_rule = lars_module.LARSRule(
        lr=lr, eta=eta, momentum=momentum, weight_decay=decay,
        momentum_form=form)
    param.update()       # v = 0: the first step's velocity
    param.update_rule.state['v'][...] = v
    param.array[...] = w
    param.update()
    numpy.testing.assert_allclose(names['param'], param.array, rtol=1e-15)
    numpy.testing.assert_allclose(names['v'], param.update_rule.state['v'],
                                  rtol=1e-15)


def test_accumulated_through_the_guarded_optimizer():
    """LARS behind GuardedOptimizer (acc_iters=2) equals LARS on the mean
    gradient of the two micro-batches."""
    numpy.random.seed(0)
    model = helpers.ConvNet(bn=True)
    reference = model.copy('copy')
    guarded = GuardedOptimizer(LARS(**HYPER), acc_iters=2).setup(model)
    plain = LARS(**HYPER).setup(reference)
    for step in range(3):
        x, t = helpers.data(n=8, seed=step)
        guarded.update(helpers.loss_of(model), x[:4], t[:4])
        guarded.update(helpers.loss_of(model), x[4:], t[4:])
        reference.cleargrads()
        ((helpers.loss_of(reference)(x[:4], t[:4]) +
          helpers.loss_of(reference)(x[4:], t[4:])) / 2).backward()
        plain.update()
    for name, param in reference.namedparams():
        numpy.testing.assert_allclose(
            dict(model.namedparams())[name].array, param.array,
            rtol=1e-12, atol=1e-14, err_msg=name)


class _WithUnusedBranch(chainer.Chain):
    def __init__(self):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.used = chainer.links.Linear(5, 3)
            self.unused = chainer.links.Linear(5, 3)

    def forward(self, x):
        return self.used(x)


@pytest.mark.parametrize('form', ['scaled', 'unscaled'])
def test_a_parameter_without_gradient_is_left_as_it_is(form):
    """Chainer fills a missing gradient with zeros: the trust ratio 1 then
    decayed an unused branch at the full η with momentum (at Table 1's
    lr 29 and momentum 0.929, a weight of ones fell below 0 in 100
    steps). TensorFlow's LARSOptimizer leaves such a variable alone."""
    model = _WithUnusedBranch()
    before = {n: p.array.copy() for n, p in model.namedparams()}
    optimizer = LARS(lr=29.0, momentum=0.929, weight_decay=1e-4,
                     momentum_form=form).setup(model)
    x, t = helpers.data(n=4, shape=(5,), n_class=3)
    for _ in range(5):
        optimizer.update(helpers.loss_of(model), x, t)
    for name, param in model.namedparams():
        if name.startswith('/unused'):
            numpy.testing.assert_array_equal(param.array, before[name])
            assert not param.update_rule.state['v'].any()
        else:
            assert not numpy.array_equal(param.array, before[name])


@pytest.mark.parametrize('where', ['optimizer', 'rule'])
@pytest.mark.parametrize('name, value', [
    ('lr', float('inf')), ('lr', float('nan')), ('eta', float('inf')),
    ('eta', 0.0), ('momentum', 1.5), ('weight_decay', -1.0),
    ('lr', numpy.array(float('inf'))), ('eta', numpy.float32('nan'))])
def test_a_bad_value_set_later_is_refused_before_anything_moves(
        where, name, value):
    """A value the constructor refuses, set since (by hand, a trainer
    extension's shift, a rule's own): an lr or eta of inf gave non-finite
    weights, then every step was skipped; a momentum of 1.5 ran on."""
    model = helpers.ConvNet(bn=False)
    optimizer = LARS().setup(model)
    target = optimizer if where == 'optimizer' else \
        model.fc.W.update_rule.hyperparam
    setattr(target, name, value)
    weights = {n: p.array.copy() for n, p in model.namedparams()}
    with pytest.raises(ValueError, match=name):
        optimizer.update(helpers.loss_of(model), *helpers.data())
    assert optimizer.t == 0
    for n, param in model.namedparams():
        numpy.testing.assert_array_equal(param.array, weights[n])


def test_exclusion_set_after_setup_is_taken():
    """``optimizer.exclude`` set after ``setup`` (and after a step) was
    never read: the biases stayed excluded. Each rule decides again."""
    numpy.random.seed(0)
    model = helpers.ConvNet(bn=True)
    optimizer = LARS().setup(model)
    optimizer.update(helpers.loss_of(model), *helpers.data())
    assert '/fc/b' in optimizer.excluded_params()
    optimizer.exclude = None
    assert optimizer.excluded_params() == []
    optimizer.update(helpers.loss_of(model), *helpers.data())
    assert all(not p.update_rule.excluded for p in model.params())
    optimizer.exclude = lambda name, p: name.startswith('/bn/')
    assert sorted(optimizer.excluded_params()) == ['/bn/beta', '/bn/gamma']
    with pytest.raises(TypeError, match='exclude'):
        optimizer.exclude = 'bias'
