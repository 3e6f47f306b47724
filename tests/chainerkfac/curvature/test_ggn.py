"""The exact GGN quantities against explicit Jacobians (one backward pass
per logit of each sample), on every kind of graph."""
import math

import numpy
import pytest

import chainer
import chainer.functions as F

from chainerkfac import curvature
from tests.chainerkfac.curvature import nets, oracles


def close(actual, desired, msg=''):
    numpy.testing.assert_allclose(actual, desired, rtol=1e-9, atol=1e-14,
                                  err_msg=msg)


def exact_ggn(model, x, t, train=False, hessians=None):
    with chainer.using_config('train', train):
        return oracles.diagonal_blocks(model, oracles.ggn(model, x,
                                                          hessians))


#: Kronecker-factored parameters of each graph (the others get none).
KRONECKER = {
    'conv_pool_linear': ['/conv/W', '/conv/b', '/fc/W', '/fc/b'],
    'residual': ['/conv1/W', '/conv1/b', '/conv2/W', '/conv2/b', '/fc/W',
                 '/fc/b'],
    'shared_weights': ['/embed/W', '/embed/b', '/shared/W', '/shared/b',
                       '/fc/W', '/fc/b'],
    'grouped_conv': ['/fc/W', '/fc/b'],
    'bn_test_mode': ['/conv/W', '/fc/W', '/fc/b'],
    'unmodelled_params': ['/l1/W', '/l1/b', '/fc/W', '/fc/b'],
}


@pytest.mark.parametrize('graph', sorted(nets.GRAPHS))
def test_diag_ggn_and_bias_factor_equal_explicit_jacobians(graph):
    model, x, t = nets.build(graph)
    diag, blocks = exact_ggn(model, x, t)
    with chainer.using_config('train', False):
        got = curvature.extract(model, x, t, quantities=('diag_ggn', 'kflr'))
    assert set(got) == set(diag)
    for path in diag:
        close(got[path]['diag_ggn'], diag[path], path)
    assert sorted(p for p in got if 'kflr_B' in got[p]) == \
        sorted(KRONECKER[graph])
    for path in KRONECKER[graph]:
        if path.endswith('/b'):
            # BackPACK's B is the exact GGN of the bias.
            close(got[path]['kflr_B'], blocks[path], path)
            close(got[path[:-1] + 'W']['kflr_B'], blocks[path], path)
            assert 'kflr_A' not in got[path]


def test_linear_factors_for_one_sample_are_the_exact_block():
    model = nets.Shared()
    x, t = nets.data(n=1, shape=(32,))
    _, blocks = exact_ggn(model, x, t)
    got = curvature.extract(model, x, t, quantities=('kflr',))['/fc/W']
    close(numpy.kron(got['kflr_B'], got['kflr_A']), blocks['/fc/W'])


def test_input_factors_by_explicit_unfolding():
    model = nets.ConvPool(stride=2, pad=1, dilate=1)
    x, t = nets.data()
    got = curvature.extract(model, x, t, quantities=('kflr', 'kfac'))
    rows = oracles.patches(x, 3, stride=2, pad=1)
    expected = numpy.einsum('npi,npj->ij', rows, rows) / len(x)
    close(got['/conv/W']['kflr_A'], expected)
    close(got['/conv/W']['kfac_A'], expected)
    h = F.max_pooling_2d(F.relu(model.conv(x)), 2).array.reshape(len(x), -1)
    close(got['/fc/W']['kflr_A'], h.T.dot(h) / len(x))


def output_factors(model, x):
    """BackPACK's and KFC's B of the convolution weight from the explicit
    Jacobians of the logits w.r.t. its output."""
    def wrt(inputs):
        z = model.conv(inputs)
        return z, model.head(z)
    jac = oracles.jacobians(model, x, wrt)              # (n, C, n, O, h, w)
    n = len(x)
    jac = numpy.array([jac[i, :, i] for i in range(n)])  # (n, C, O, h, w)
    roots = oracles.symmetric_roots(oracles.softmax_hessians(
        model(x).array)) / math.sqrt(n)
    pulled = numpy.einsum('ncohw,nck->nkohw', jac, roots)
    summed = pulled.sum(axis=(3, 4))                     # (n, K, O)
    backpack = numpy.einsum('nko,nkp->op', summed, summed)
    positions = pulled.shape[3] * pulled.shape[4]
    kfc = numpy.einsum('nkohw,nkphw->op', pulled, pulled) / positions
    return backpack, kfc


def test_convolution_output_factor_backpack_and_kfc():
    model = nets.ConvPool()
    x, t = nets.data()
    backpack, kfc = output_factors(model, x)
    got = curvature.extract(model, x, t, quantities=('kflr',))['/conv/W']
    close(got['kflr_B'], backpack)
    got = curvature.extract(model, x, t, quantities=('kflr',),
                            conv_factors='kfc')
    close(got['/conv/W']['kflr_B'], kfc)
    # Biases keep BackPACK's B (their exact GGN).
    close(got['/conv/b']['kflr_B'], backpack)
    assert not numpy.allclose(kfc, backpack)


def test_batch_normalization_in_training_mode():
    model = nets.WithBN()
    x, t = nets.data(n=4)
    diag, _ = exact_ggn(model, x, t, train=True)
    with chainer.using_config('train', True):
        got = curvature.extract(model, x, t, quantities=('diag_ggn',))
        for name in ('kflr', 'kfac', 'kfra', 'diag_hessian'):
            with pytest.raises(curvature.UnsupportedGraph,
                               match=r"using_config\('train', False\)"):
                curvature.extract(model, x, t, quantities=(name,))
    for path in diag:
        close(got[path]['diag_ggn'], diag[path], path)


def test_a_refused_graph_leaves_the_model_as_it_was():
    """The coupling check needs the graph, so the forward and backward ran
    before the refusal: the running statistics and gradients are given
    back (they had moved: one training forward's worth)."""
    model = nets.WithBN()
    x, t = nets.data(n=4)
    model.cleargrads()
    grads = {}
    for name, param in model.namedparams():
        param.grad = numpy.full_like(param.array, 0.5)
        grads[name] = param.grad.copy()
    persistent = [(link, name, numpy.array(getattr(link, name)))
                  for link in model.links() for name in link._persistent]
    assert any(v.ndim for _, _, v in persistent)    # BN's statistics
    with chainer.using_config('train', True):
        with pytest.raises(curvature.UnsupportedGraph):
            curvature.extract(model, x, t, quantities=('kflr',))
    for link, name, value in persistent:
        numpy.testing.assert_array_equal(getattr(link, name), value,
                                         err_msg=name)
    for name, param in model.namedparams():
        numpy.testing.assert_array_equal(param.grad, grads[name], name)


def test_any_loss_by_double_backprop():
    """A mean squared error: its Hessian is 2/(N·C) I per sample."""
    model, x, _ = nets.build('residual')
    target = numpy.random.RandomState(3).randn(len(x), nets.N_CLASS)
    hessians = numpy.tile(2 / (len(x) * nets.N_CLASS) *
                          numpy.eye(nets.N_CLASS), (len(x), 1, 1)) * len(x)
    diag, blocks = exact_ggn(model, x, None, hessians=hessians)
    got = curvature.extract(model, x, target, lossfun=F.mean_squared_error,
                            quantities=('diag_ggn', 'kflr'))
    for path in diag:
        close(got[path]['diag_ggn'], diag[path], path)
    close(got['/fc/b']['kflr_B'], blocks['/fc/b'])


def test_float32_softmax_loss_by_double_backprop_is_convex():
    """A softmax loss's Hessian has a zero eigenvalue per sample, which
    float32 rounds to about -4e-10 relative: within float32's own rounding,
    not a sign of a concave loss (refused before at a fixed 1e-8). Its
    diagonal GGN equals the closed form's to float32 rounding."""
    import chainer.links as L
    rng = numpy.random.RandomState(0)
    numpy.random.seed(0)
    with chainer.using_config('dtype', numpy.float32):
        model = chainer.Sequential(L.Linear(20, 32), F.relu,
                                   L.Linear(32, 10))
    x = rng.randn(64, 20).astype(numpy.float32)
    t = rng.randint(0, 10, 64).astype(numpy.int32)
    reference = curvature.extract(model, x, t, quantities=('diag_ggn',))
    for lossfun in (
            lambda y, t: F.softmax_cross_entropy(
                y, t, enable_double_backprop=True),
            lambda y, t: -F.mean(F.select_item(F.log_softmax(y), t))):
        got = curvature.extract(model, x, t, quantities=('diag_ggn',),
                                lossfun=lossfun)
        for path in got:
            want = reference[path]['diag_ggn']
            assert got[path]['diag_ggn'].dtype == numpy.float32
            numpy.testing.assert_allclose(
                got[path]['diag_ggn'], want, rtol=0,
                atol=1e-5 * float(abs(want).max()), err_msg=path)


def test_indefinite_loss_hessian_is_refused():
    model, x, _ = nets.build('conv_pool_linear')

    def concave(logits, t):
        return -F.mean(F.sum(logits ** 2, axis=1))
    with pytest.raises(ValueError, match='convex'):
        curvature.extract(model, x, None, lossfun=concave,
                          quantities=('diag_ggn',))


def test_embedding_and_several_batch_axes_by_per_sample_passes():
    model = nets.Embedding()
    x, t = nets.ids()
    diag, blocks = exact_ggn(model, x, t)
    got = curvature.extract(model, x, t, quantities=('diag_ggn', 'kflr'))
    for path in diag:
        close(got[path]['diag_ggn'], diag[path], path)
    assert sorted(p for p in got if 'kflr_B' in got[p]) == ['/fc/W', '/fc/b']


def test_shared_weight_input_factor_sums_over_calls():
    model, x, t = nets.build('shared_weights')
    got = curvature.extract(model, x, t, quantities=('kflr',))['/shared/W']
    h = F.tanh(model.embed(x)).array
    inputs = [h, F.tanh(model.shared(h)).array, h * 0.5]
    expected = sum(a.T.dot(a) for a in inputs) / len(x)
    close(got['kflr_A'], expected)
