"""MGRIT against the layer-serial network, on one process: the converged
solves reproduce Chainer's forward and backprop; one level *is* serial; the
two-level exactness property; warm starts; the stopping rules."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import numpy
import pytest

import chainer

from chainerkfac import layer_parallel as lp
from tests.chainerkfac.layer_parallel import common

CASES = [
    # (net, coarsening, levels, relax)
    ('dense', 4, None, 'FCF'),
    ('dense', 4, None, 'F'),
    ('dense', 2, 4, 'FCF'),
    ('dense', 3, 2, 'F'),         # 24 layers: 8 coarse steps, serial solve
    ('conv', 2, None, 'FCF'),     # 9 layers: a trailing F-point
]


def _net(kind, **kwargs):
    if kind == 'dense':
        return common.dense_net(n_layers=kwargs.pop('n_layers', 26), **kwargs)
    return common.conv_net(**kwargs)


@pytest.mark.parametrize('kind,coarsening,levels,relax', CASES)
def test_converged_mgrit_is_serial_forward_and_backprop(kind, coarsening,
                                                        levels, relax):
    net = _net(kind)
    x, t = common.batch(net)
    logits_ref, loss_ref, grads_ref = common.serial_gradients(net, x, t)
    mgrit = lp.MGRIT(net, coarsening=coarsening, levels=levels, relax=relax,
                     tol=1e-14, max_iter=60)
    logits, loss, history, adjoint_history, grads = \
        common.mgrit_gradients(mgrit, x, t)
    assert mgrit.forward_solver.n_levels > 1
    assert len(history) > 2 and len(adjoint_history) > 2   # it iterated
    assert history[-1] <= 1e-14 and adjoint_history[-1] <= 1e-14
    numpy.testing.assert_allclose(logits, logits_ref, rtol=0, atol=1e-12)
    assert abs(loss - loss_ref) <= 1e-12
    assert set(grads) == set(grads_ref)          # every parameter
    assert common.max_relative_error(grads, grads_ref) <= 1e-12


def test_one_level_is_serial_exactly():
    for net in (_net('dense'), _net('conv')):
        x, t = common.batch(net)
        logits_ref, loss_ref, grads_ref = common.serial_gradients(net, x, t)
        mgrit = lp.MGRIT(net, levels=1)
        logits, loss, history, adjoint_history, grads = \
            common.mgrit_gradients(mgrit, x, t)
        assert history == [0.0] and adjoint_history == [0.0]
        assert numpy.array_equal(logits, logits_ref)
        assert loss == loss_ref
        for name, grad in grads.items():
            assert numpy.array_equal(grad, grads_ref[name]), name


def test_a_second_backward_accumulates_as_chainer_does():
    """Two backward calls after one forward: every gradient twice the
    serial one, as two ``loss.backward()`` in Chainer (the second adjoint
    solve started from the seed accumulated by the first: 3× in the layers
    and the opening, 2× in the classifier)."""
    net = _net('dense')
    x, t = common.batch(net)
    _, _, grads_ref = common.serial_gradients(net, x, t)
    mgrit = lp.MGRIT(net, levels=1)
    net.cleargrads()
    mgrit.forward(x)
    mgrit.backward(t)
    mgrit.backward(t)
    grads = {name: param.grad for name, param in mgrit.owned_params()}
    assert set(grads) == set(grads_ref)
    for name, grad in grads.items():
        numpy.testing.assert_allclose(grad, 2 * grads_ref[name], rtol=1e-13,
                                      atol=0, err_msg=name)


@pytest.mark.parametrize('relax,reach', [('FCF', lambda k, c: (2 * k + 1) * c),
                                         ('F', lambda k, c: (k + 1) * c)])
def test_two_level_exactness_property(relax, reach):
    """After k two-level iterations the states u_1 .. u_{(2k+1)c-1} (FCF;
    (k+1)c - 1 for F) are exact — and the next one is not."""
    c, n_layers = 3, 36
    net = common.dense_net(n_layers=n_layers)
    x, _ = common.batch(net)
    serial = lp.MGRIT(net, levels=1)
    serial.forward(x)
    exact = serial.forward_solver.u[0][1:].copy()    # u_0 .. u_N
    for k in (1, 2, 3):
        mgrit = lp.MGRIT(net, coarsening=c, levels=2, relax=relax, tol=0,
                         max_iter=k, warm_start=False)
        mgrit.forward(x)
        states = mgrit.forward_solver.u[0][1:]
        errors = abs(states - exact).reshape(n_layers + 1, -1).max(axis=1)
        first_inexact = reach(k, c)
        assert first_inexact < n_layers
        assert errors[:first_inexact].max() <= 1e-13, (k, errors)
        assert errors[first_inexact] > 1e-8, (k, errors)


def test_warm_start_lowers_the_first_residual():
    net = common.dense_net(n_layers=64, width=6)
    x, t = common.batch(net, size=20)
    warm = lp.MGRIT(net, tol=1e-12, warm_start=True)
    cold = lp.MGRIT(net, tol=1e-12, warm_start=False)
    for mgrit in (warm, cold):
        common.mgrit_gradients(mgrit, x, t)
    # A small optimizer-like step changes every weight a little.
    rng = numpy.random.RandomState(3)
    for param in net.params():
        param.array += 1e-3 * rng.standard_normal(param.shape)
    first = {}
    for name, mgrit in (('warm', warm), ('cold', cold)):
        _, _, history, adjoint_history, _ = common.mgrit_gradients(
            mgrit, x, t)
        first[name] = (history[0], adjoint_history[0])
    # The cold start is the same solver from zero states / adjoints.
    assert first['warm'][0] < 0.1 * first['cold'][0]
    assert first['warm'][1] < 0.1 * first['cold'][1]


def test_stopping_rules():
    net = common.dense_net(n_layers=64)
    x, t = common.batch(net)
    mgrit = lp.MGRIT(net, tol=0, max_iter=3, warm_start=False)
    _, history = mgrit.forward(x)
    assert len(history) == 3
    _, history = mgrit.forward(x, max_iter=5)
    assert len(history) == 5
    relative = lp.MGRIT(net, tol=0, rtol=1e-3, max_iter=50, warm_start=False)
    _, history = relative.forward(x)
    assert history[-1] <= 1e-3 * history[0] < min(history[:-1])
    absolute = lp.MGRIT(net, tol=1e-6, max_iter=50, warm_start=False)
    _, history = absolute.forward(x)
    assert history[-1] <= 1e-6 < min(history[:-1])


def test_a_solve_stopped_by_its_cap_says_so_once(caplog):
    """A cap reached above the tolerance: the logits are MGRIT's iterate
    (18 % off serial after one iteration), which was said nowhere but in
    the history."""
    net = common.dense_net(n_layers=64)
    x, t = common.batch(net)
    mgrit = lp.MGRIT(net, coarsening=2, max_iter=1, warm_start=False)
    caplog.set_level('WARNING', logger='chainerkfac')
    for _ in range(2):
        mgrit.forward(x)
        mgrit.backward(t)
    assert mgrit.converged == {'forward': False, 'adjoint': False}
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 2
    assert 'the forward solve stopped after 1 iteration(s)' in warned[0]
    assert 'the adjoint solve stopped after 1 iteration(s)' in warned[1]
    caplog.clear()
    mgrit.forward(x, max_iter=50)
    assert mgrit.converged['forward'] and not caplog.records
    # tol=0 and rtol=0 ask for max_iter iterations (a fixed-iteration
    # history, experiments.layer_parallel.convergence): nothing to say
    fixed = lp.MGRIT(net, coarsening=2, tol=0, max_iter=2, warm_start=False)
    fixed.forward(x)
    fixed.backward(t)
    assert fixed.converged == {'forward': False, 'adjoint': False}
    assert not caplog.records


def test_errors_name_the_problem():
    net = common.dense_net(n_layers=8)
    with pytest.raises(RuntimeError, match='forward first'):
        lp.MGRIT(net).backward(numpy.zeros(2, numpy.int32))
    with pytest.raises(ValueError, match='relax'):
        lp.MGRIT(net, relax='FF')
    with pytest.raises(ValueError, match='coarsening'):
        lp.MGRIT(net, coarsening=1)
    # before any work: 0 divided by zero, a negative tolerance ran every
    # solve to its cap
    for options, message in [
            (dict(coarsening=0), 'coarsening must be an integer >= 2'),
            (dict(coarsening=2.5), 'coarsening must be an integer >= 2'),
            (dict(tol=-1), 'tol must be a finite number >= 0'),
            (dict(tol=float('nan')), 'tol must be a finite number >= 0'),
            (dict(rtol=-0.1), r'rtol must be a number in \[0, 1\)'),
            # 1 stopped every solve after its first iteration, "converged"
            (dict(rtol=1.0), r'rtol must be a number in \[0, 1\)'),
            (dict(levels=2.5), 'levels must be an integer >= 1'),
            (dict(max_iter=0), 'max_iter must be positive')]:
        with pytest.raises(ValueError, match=message):
            lp.MGRIT(net, **options)
    with pytest.raises(ValueError, match='3 levels with coarsening 4'):
        lp.MGRIT(net, levels=3)
    with pytest.raises(TypeError, match='comm'):
        lp.MGRIT(net, comm=object())


def test_the_default_tolerance_follows_the_dtype():
    """``tol=None``: 1e-10 in float64; in float32, whose residuals stop
    falling far above 1e-10, 1e-5 — the float64 tolerance there ran every
    solve to ``max_iter`` without a word. The float32 solve stops early
    and its logits are the float64 network's to float32's accuracy."""
    import chainer
    net64 = common.dense_net(n_layers=64)
    x, t = common.batch(net64)
    logits64, history64 = lp.MGRIT(net64, warm_start=False).forward(x)
    assert history64[-1] <= 1e-10 < min(history64[:-1])
    numpy.random.seed(0)
    with chainer.using_config('dtype', numpy.float32):
        net32 = lp.ResidualODE(n_in=2, width=4, n_layers=64, n_out=3)
    net32.copyparams(net64)
    logits32, history32 = lp.MGRIT(net32, warm_start=False).forward(
        x.astype(numpy.float32))
    assert len(history32) < 50 and history32[-1] <= 1e-5
    numpy.testing.assert_allclose(logits32, logits64, rtol=0, atol=1e-4)
    assert lp.MGRIT(net32, tol=1e-3)._tol(numpy.float32) == 1e-3


def test_a_non_finite_residual_ends_the_solve_at_once():
    net = common.dense_net(n_layers=64)
    x, t = common.batch(net)
    x[0, 0] = numpy.nan
    mgrit = lp.MGRIT(net, max_iter=50)
    with pytest.raises(FloatingPointError, match='the residual is nan at '
                       'iteration 1'):
        mgrit.forward(x)


def test_a_cap_of_zero_iterations_is_refused_not_the_default():
    net = common.dense_net(n_layers=16)
    x, t = common.batch(net)
    with pytest.raises(ValueError, match='max_iter must be positive'):
        lp.MGRIT(net).forward(x, max_iter=0)
    import chainer
    with pytest.raises(ValueError, match='m1 must be an integer >= 1'):
        lp.SimultaneousTraining(lp.MGRIT(net), chainer.optimizers.SGD(),
                                m1=0)


def test_images_of_another_size_are_refused_before_the_solve(monkeypatch):
    """A conv network's classifier is sized by its image_size: a batch of
    another size failed only after the whole forward solve."""
    net = common.conv_net()
    x, _ = common.batch(net)
    wrong = numpy.zeros(x.shape[:2] + (x.shape[2] + 2, x.shape[3]))
    mgrit = lp.MGRIT(net)

    def solve(*args, **kwargs):
        pytest.fail('the solve ran')
    monkeypatch.setattr(mgrit.forward_solver, 'solve', solve)
    message = 'images of 6x4 but the network was built for image_size=4x4'
    with pytest.raises(ValueError, match=message):
        mgrit.forward(wrong)
    with pytest.raises(ValueError, match=message):
        net(wrong)


def test_options_set_later_are_checked_or_refused():
    """``tol``, ``rtol`` and ``max_iter`` set after construction are
    checked as the constructor checks them (a ``tol`` of -1 ran every
    solve to its cap); ``coarsening``, ``levels`` and ``relax``, from
    which the hierarchy is built, are refused (setting ``coarsening``
    changed nothing: the solvers kept their own)."""
    mgrit = lp.MGRIT(_net('dense', n_layers=16))
    for name, value in [('tol', -1), ('tol', float('nan')), ('rtol', 1.0),
                        ('max_iter', 0), ('max_iter', True)]:
        with pytest.raises(ValueError, match=name):
            setattr(mgrit, name, value)
    mgrit.tol, mgrit.rtol, mgrit.max_iter = 1e-8, 0.5, 7
    assert (mgrit.tol, mgrit.rtol, mgrit.max_iter) == (1e-8, 0.5, 7)
    for name, value in [('coarsening', 2), ('levels', 1), ('relax', 'F')]:
        with pytest.raises(AttributeError, match='new MGRIT'):
            setattr(mgrit, name, value)
    assert (mgrit.coarsening, mgrit.levels, mgrit.relax) == (4, None,
                                                             'FCF')


def test_the_networks_time_and_activation_set_later_are_taken():
    """``t_final`` and ``activation`` set after construction were copied
    at it (the step ``h`` and σ kept the first values): now the network
    computes as one built with them."""
    x = numpy.random.RandomState(0).randn(4, 2)
    numpy.random.seed(0)
    with chainer.using_config('dtype', numpy.float64):
        changed = lp.ResidualODE(2, 8, 16, 5, t_final=5.0)
        numpy.random.seed(0)
        built = lp.ResidualODE(2, 8, 16, 5, t_final=10.0, activation='tanh')
    changed.t_final = 10.0
    changed.activation = 'tanh'
    assert changed.h == built.h == 10.0 / 16
    numpy.testing.assert_array_equal(changed(x).array, built(x).array)
    for value in (-1.0, numpy.complex128(1), float('inf')):
        with pytest.raises(ValueError, match='t_final'):
            changed.t_final = value
    bare = lp.ResidualODE.__new__(lp.ResidualODE)
    assert getattr(bare, 't_final', None) is None
    with pytest.raises(ValueError):
        changed.activation = 'bogus'


def test_the_grid_takes_an_integer_count():
    """``layer_procs=2.0`` made a grid of 1.0 replicas, ``True`` one of
    one process a group, without a word."""
    for value in (1.0, True, 0, 2):
        with pytest.raises(ValueError, match='layer_procs'):
            lp.ProcessGrid(None, layer_procs=value)
    assert lp.ProcessGrid(None, layer_procs=1).n_replicas == 1
