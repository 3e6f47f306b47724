"""ResidualODE's per-layer array methods against Chainer's autodiff of one
layer, and the smoothed ReLU against the seed's formula."""
import numpy
import pytest

import chainer
from chainer import gradient_check

from chainerkfac import layer_parallel as lp
from chainerkfac.layer_parallel import activations
from tests.chainerkfac.layer_parallel import common


def test_smooth_relu_is_the_seed_formula():
    eta = activations.SMOOTH_RELU_ETA
    x = numpy.linspace(-0.3, 0.3, 601)
    expected = numpy.where(numpy.abs(x) < eta,
                           x ** 2 / (4 * eta) + x / 2 + eta / 4,
                           numpy.maximum(x, 0))
    numpy.testing.assert_allclose(lp.smooth_relu(x).array, expected,
                                  rtol=0, atol=1e-15)
    slope = activations.get('smooth_relu').slope(x)
    expected_slope = numpy.where(numpy.abs(x) < eta, x / (2 * eta) + 0.5,
                                 x > 0)
    numpy.testing.assert_allclose(slope, expected_slope, rtol=0, atol=1e-15)


@pytest.mark.parametrize('name', sorted(activations.ACTIVATIONS))
def test_activation_backward_and_slope_agree(name):
    activation = activations.get(name)
    rng = numpy.random.RandomState(0)
    # Away from ReLU's kink, where finite differences are meaningless.
    x = rng.uniform(0.02, 0.5, (5, 3)) * rng.choice([-1, 1], (5, 3))
    gy = rng.standard_normal((5, 3))
    gradient_check.check_backward(activation.function, x, gy, eps=1e-6,
                                  atol=1e-7, rtol=1e-7)
    variable = chainer.Variable(x)
    y = activation.function(variable)
    y.grad = gy
    y.backward()
    numpy.testing.assert_array_equal(variable.grad,
                                     gy * activation.slope(x.copy()))
    numpy.testing.assert_array_equal(activation.values(x.copy()), y.array)


@pytest.mark.parametrize('make', [common.dense_net, common.conv_net])
def test_layer_methods_match_chainer_autodiff_of_one_layer(make):
    net = make(n_layers=3)
    x, _ = common.batch(net)
    u = net.open(x).array
    n, dt = 1, 0.37
    rng = numpy.random.RandomState(4)
    ubar = rng.standard_normal(u.shape)
    # Autodiff of Φ(u) = u + dt σ(K u + b).
    net.cleargrads()
    variable = chainer.Variable(u)
    out = variable + dt * net.residual(n, variable)
    out.grad = ubar
    out.backward()
    link = net.layers[n]
    numpy.testing.assert_array_equal(net.step(n, u, dt), out.array)
    slope = net.slope(n, u)
    numpy.testing.assert_allclose(net.step_adjoint(n, slope, ubar, dt),
                                  variable.grad, rtol=1e-14, atol=1e-14)
    expected = {'W': link.W.grad.copy(), 'b': link.b.grad.copy()}
    link.cleargrads()
    net.accumulate_layer_grad(n, u, slope, ubar, dt)
    for name, grad in expected.items():
        numpy.testing.assert_allclose(getattr(link, name).grad, grad,
                                      rtol=1e-14, atol=1e-14)
    # Grads accumulate like Chainer's.
    net.accumulate_layer_grad(n, u, slope, ubar, dt)
    numpy.testing.assert_allclose(link.W.grad, 2 * expected['W'],
                                  rtol=1e-14, atol=1e-14)


def test_bad_arguments():
    with pytest.raises(ValueError, match='layer must be'):
        lp.ResidualODE(2, 4, 8, 3, layer='lstm')
    with pytest.raises(ValueError, match='image_size'):
        lp.ResidualODE(1, 4, 8, 3, layer='conv')
    with pytest.raises(ValueError, match='activation must be'):
        lp.ResidualODE(2, 4, 8, 3, activation='swish')
    for t_final in (0, -1.0, float('inf'), float('nan')):
        with pytest.raises(ValueError, match='t_final must be a finite'):
            lp.ResidualODE(2, 4, 8, 3, t_final=t_final)


class _Seen(chainer.FunctionHook):
    name = 'seen'

    def __init__(self):
        self.calls = []

    def backward_preprocess(self, function, in_data, out_grad):
        self.calls.append((type(function).__name__, in_data[0],
                           out_grad[0]))


def test_layer_grad_with_a_hook_is_the_links_call_and_the_same_bits():
    """A function hook (K-FAC's capture) sees the dense layer's call: its
    input u and dt σ' ⊙ ū as the gradient w.r.t. K u + b; the gradients
    are bitwise those of the route without hooks."""
    net = common.dense_net(n_layers=3, width=5)
    x, _ = common.batch(net)
    u = net.open(x).array
    rng = numpy.random.RandomState(4)
    ubar = rng.standard_normal(u.shape)
    slope = net.slope(1, u)
    link = net.layers[1]
    net.cleargrads()
    net.accumulate_layer_grad(1, u, slope, ubar, 0.3)
    expected = [link.W.grad.copy(), link.b.grad.copy()]
    net.cleargrads()
    hook = _Seen()
    with hook:
        net.accumulate_layer_grad(1, u, slope, ubar, 0.3)
    assert [c[0] for c in hook.calls] == ['LinearFunction']
    numpy.testing.assert_array_equal(hook.calls[0][1], u)
    numpy.testing.assert_array_equal(hook.calls[0][2], ubar * 0.3 * slope)
    numpy.testing.assert_array_equal(link.W.grad, expected[0])
    numpy.testing.assert_array_equal(link.b.grad, expected[1])
