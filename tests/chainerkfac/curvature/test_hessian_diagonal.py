"""The Hessian diagonal against double backprop, one pass per parameter
entry."""
import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from chainerkfac import curvature
from tests.chainerkfac.curvature import nets, oracles


def close(actual, desired, msg=''):
    numpy.testing.assert_allclose(actual, desired, rtol=1e-8, atol=1e-13,
                                  err_msg=msg)


@pytest.mark.parametrize('graph,act', [
    ('conv_pool_linear', F.sigmoid),
    ('residual', None),
    ('bn_test_mode', None),
    ('grouped_conv', None),
])
def test_hessian_diagonal_equals_double_backprop(graph, act):
    model, x, t = nets.build(graph)
    if act is not None:
        model.act = act
    with chainer.using_config('train', False):
        expected = oracles.hessian_diagonal(model, x, t)
        got = curvature.extract(model, x, t,
                                quantities=('diag_hessian', 'diag_ggn'))
    differs = False
    for path, diagonal in expected.items():
        close(got[path]['diag_hessian'], diagonal, path)
        differs |= not numpy.allclose(got[path]['diag_ggn'], diagonal)
    # The curved activations make the Hessian differ from the GGN.
    assert differs == (graph in ('conv_pool_linear', 'residual'))


def test_piecewise_linear_network_hessian_is_its_ggn():
    model, x, t = nets.build('conv_pool_linear')
    got = curvature.extract(model, x, t,
                            quantities=('diag_hessian', 'diag_ggn'))
    for path, q in got.items():
        numpy.testing.assert_array_equal(q['diag_hessian'], q['diag_ggn'])


class PiecewiseLinear(chainer.Chain):
    """A conv net through the piecewise linear array and pooling functions
    (global max pooling, N-d average pooling, unpooling, stack, swapaxes,
    tile, flip, rollaxis, maximum / minimum), with a curved tanh."""

    def __init__(self):
        super().__init__()
        with chainer.using_config('dtype', numpy.float64), self.init_scope():
            self.conv = L.Convolution2D(2, 3, 3, pad=1)
            self.fc = L.Linear(12, nets.N_CLASS)

    def forward(self, x):
        h = F.tanh(self.conv(x))                               # (N, 3, 4, 4)
        h = F.unpooling_2d(F.average_pooling_nd(h, 2), 2, outsize=(4, 4))
        h = F.maximum(h, F.minimum(h * 0.5, F.flip(h, 2)))
        h = F.swapaxes(F.rollaxis(h, 3, 1), 2, 3)              # (N, 4, 4, 3)
        pooled = F.stack([F.max(h, axis=(1, 2)),
                          F.min(h, axis=(1, 2))], axis=1)      # (N, 2, 3)
        return self.fc(F.tile(pooled, (1, 2, 1)))


def test_piecewise_linear_functions_add_no_curvature():
    """Their second derivatives vanish almost everywhere: the diagonal
    Hessian through them equals double backprop's (it refused them
    before, though the docs promised 'pooling, reshapes, sums')."""
    numpy.random.seed(2)
    model = PiecewiseLinear()
    rng = numpy.random.RandomState(5)
    x = rng.randn(3, 2, 4, 4)
    t = rng.randint(0, nets.N_CLASS, 3).astype(numpy.int32)
    expected = oracles.hessian_diagonal(model, x, t)
    got = curvature.extract(model, x, t, quantities=('diag_hessian',))
    for path, diagonal in expected.items():
        close(got[path]['diag_hessian'], diagonal, path)


class Rearranged(chainer.Chain):
    """A conv net through Chainer's other linear rearrangements
    (space2depth / depth2space, moveaxis, permutate, repeat, im2col,
    upsampling / N-d unpooling, fliplr / flipud, h/v/dstack,
    separate, diagonal, where, cumsum), with a curved sigmoid before them."""

    def __init__(self):
        super().__init__()
        with chainer.using_config('dtype', numpy.float64), self.init_scope():
            self.conv = L.Convolution2D(2, 4, 3, pad=1)
            self.fc = L.Linear(66, nets.N_CLASS)

    def forward(self, x):
        h = F.sigmoid(self.conv(x))                            # (N, 4, 4, 4)
        h = F.depth2space(F.space2depth(h, 2), 2)
        h = F.moveaxis(F.permutate(h, numpy.array([2, 0, 3, 1],
                                                  numpy.int32), axis=1), 1, 3)
        h = F.fliplr(F.flipud(F.moveaxis(h, 3, 1)))
        h = F.repeat(h, 2, axis=3)[:, :, :, ::2]
        h, indices = F.max_pooling_2d(h, 2, return_indices=True)
        h = F.upsampling_2d(h, indices, 2, outsize=(4, 4))
        h = F.unpooling_nd(F.average_pooling_nd(h, 2), 2, cover_all=False)
        h = F.im2col(h, 2, stride=2)                           # (N, 16, 2, 2)
        h = F.cumsum(h, axis=1)
        parts = F.separate(h, axis=2)                          # 2 of (N,16,2)
        h = F.hstack([F.vstack([parts[0]]), F.dstack([parts[1]])])
        h = F.where(numpy.arange(h.size).reshape(h.shape) % 3 == 0,
                    h, -0.5 * h)
        diagonal = F.diagonal(h[:, :2, :2], axis1=1, axis2=2)
        return self.fc(F.concat([F.reshape(h, (len(h), -1)), diagonal]))


def test_linear_rearrangements_add_no_curvature():
    """Linear in their inputs: refused before (Space2Depth among them),
    now passed through; the diagonal Hessian through them equals double
    backprop's, the sigmoid's residual included."""
    numpy.random.seed(3)
    model = Rearranged()
    rng = numpy.random.RandomState(6)
    x = rng.randn(3, 2, 4, 4)
    t = rng.randint(0, nets.N_CLASS, 3).astype(numpy.int32)
    expected = oracles.hessian_diagonal(model, x, t)
    got = curvature.extract(model, x, t,
                            quantities=('diag_hessian', 'diag_ggn'))
    for path, diagonal in expected.items():
        close(got[path]['diag_hessian'], diagonal, path)
    assert not numpy.allclose(got['/conv/W']['diag_ggn'],
                              expected['/conv/W'])


class Softmaxed(chainer.Chain):
    def __init__(self):
        super().__init__()
        with chainer.using_config('dtype', numpy.float64), self.init_scope():
            self.l1 = L.Linear(32, 5)
            self.l2 = L.Linear(5, nets.N_CLASS)

    def forward(self, x):
        return self.l2(F.softmax(self.l1(x)))


def test_unsupported_graphs_are_clear_errors():
    x, t = nets.data(shape=(32,))
    with pytest.raises(curvature.UnsupportedGraph, match='Softmax'):
        curvature.extract(Softmaxed(), x, t, quantities=('diag_hessian',))
    model, x, t = nets.build('shared_weights')
    with pytest.raises(curvature.UnsupportedGraph,
                       match='/shared/W is used by 3 calls'):
        curvature.extract(model, x, t, quantities=('diag_hessian',))
    model, x, t = nets.build('unmodelled_params')
    with pytest.raises(curvature.UnsupportedGraph, match='/act/W'):
        curvature.extract(model, x, t, quantities=('diag_hessian',))
