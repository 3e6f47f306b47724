"""KFRA against its recursion written out with explicit per-sample
Jacobians of every function of a chain."""
import numpy
import pytest

import chainer
import chainer.links as L

from chainerkfac import curvature
from chainerkfac.curvature import kfra
from tests.chainerkfac.curvature import nets, oracles


def step_jacobian(step, z):
    """(n, h_out, h_in): the Jacobian of ``step`` at each sample alone."""
    out = []
    for i in range(len(z)):
        x = chainer.Variable(z[i:i + 1])
        y = step(x)
        rows = []
        for j in range(y.size):
            unit = numpy.zeros(y.shape)
            unit.flat[j] = 1
            grad, = chainer.grad([y], [x], grad_outputs=[unit])
            rows.append(grad.array.ravel())
        out.append(rows)
    return numpy.array(out)


@pytest.mark.parametrize('net', [nets.Chain, nets.BNChain])
def test_kfra_equals_the_written_out_recursion(net):
    model = net()
    x, t = nets.data()
    activations = [x]
    with chainer.using_config('train', False):
        for step in model.steps:
            activations.append(step(activations[-1]).array)
    curvature_ = oracles.softmax_hessians(activations[-1]).mean(axis=0)
    factors = {}
    inputs = {}     # A: the unfolded layer inputs' second moment
    for k in reversed(range(len(model.steps))):
        step = model.steps[k]
        if step is model.conv:
            factors['conv'] = curvature_.reshape(3, 16, 3, 16).sum((1, 3))
            rows = oracles.patches(activations[k], 3, stride=1, pad=1)
            inputs['conv'] = numpy.einsum('npi,npj->ij', rows,
                                          rows) / len(x)
        elif isinstance(step, L.Linear):
            factors[step.name] = curvature_
            h = activations[k].reshape(len(x), -1)
            inputs[step.name] = h.T.dot(h) / len(x)
        with chainer.using_config('train', False):
            jac = step_jacobian(step, activations[k])
        curvature_ = numpy.einsum('nji,jk,nkl->il', jac, curvature_,
                                  jac) / len(x)
    with chainer.using_config('train', False):
        got = curvature.extract(model, x, t, quantities=('kfra', 'kflr'))
    last = model.steps[-1].name
    for name, factor in factors.items():
        for param in ('W', 'b'):
            numpy.testing.assert_allclose(
                got['/{}/{}'.format(name, param)]['kfra_B'], factor,
                rtol=1e-9, atol=1e-14, err_msg=name)
        # float64 Gram products of at most 75 terms per entry
        numpy.testing.assert_allclose(got['/' + name + '/W']['kfra_A'],
                                      inputs[name], rtol=1e-12,
                                      atol=1e-14, err_msg=name)
    # At the last layer KFRA and KFLR agree: both are the mean Hessian.
    numpy.testing.assert_allclose(got['/{}/W'.format(last)]['kfra_B'],
                                  got['/{}/W'.format(last)]['kflr_B'],
                                  rtol=1e-12)
    assert not numpy.allclose(got['/conv/W']['kfra_B'],
                              got['/conv/W']['kflr_B'])


@pytest.mark.parametrize('graph,match', [
    ('residual', 'joins 2 branches'),
    ('shared_weights', 'used by 3 calls'),
    ('unmodelled_params', '/act/W'),
])
def test_off_a_chain_is_a_clear_error(graph, match, monkeypatch):
    """Refused once the gradient pass has shown the graph, before any of
    the exact passes of the other quantities asked with it (seconds on a
    real network), and the gradients are given back."""
    from chainerkfac.curvature import extraction

    def forbidden(*args, **kwargs):
        pytest.fail('an exact pass ran before the refusal')
    monkeypatch.setattr(extraction._Extraction, 'ggn_passes', forbidden)
    model, x, t = nets.build(graph)
    for param in model.params():
        param.grad = None
    with pytest.raises(curvature.UnsupportedGraph, match=match):
        curvature.extract(model, x, t,
                          quantities=('diag_ggn', 'kflr', 'kfra'))
    assert all(p.grad is None for p in model.params())


def test_too_many_features_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(kfra, 'MAX_FEATURES', 40)
    model = nets.Chain()
    x, t = nets.data()
    with pytest.raises(curvature.UnsupportedGraph, match='48 features'):
        curvature.extract(model, x, t, quantities=('kfra',))


def test_a_nan_input_is_named():
    """A NaN in the input reached NumPy's eigensolver as 'Eigenvalues did
    not converge'."""
    model = nets.Chain()
    x, t = nets.data()
    x = x.copy()
    x[0, 0] = numpy.nan
    with pytest.raises(FloatingPointError, match='kfra: the curvature '
                       'reaching .* is not finite'):
        curvature.extract(model, x, t, quantities=('kfra',))
