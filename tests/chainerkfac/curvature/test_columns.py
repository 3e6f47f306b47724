"""Stacked backward passes (all columns of the root in one propagation)
against the reference: one backward pass of Chainer's autodiff per column
(``column_chunk=1``), on every kind of graph, in float64.

Tolerance: both paths form the same products per (pass, sample); they sum
them in other orders (the passes before the samples for a Linear weight's
squares, a derivative taken once and multiplied in, a residual
connection's two gradients added in another order), so results differ by
rounding of sums of O(100) terms: 1e-12 of the largest entry, far above
the ~1e-15 seen and far below any error of the mathematics.
"""
import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from chainerkfac import curvature
from chainerkfac.curvature import columns
from tests.chainerkfac.curvature import nets

EXACT = ('diag_ggn', 'kflr', 'diag_hessian', 'kfra', 'kfac', 'diag_ggn_mc')


def supported(model, x, t, names):
    """The quantities of ``names`` the graph supports (one extraction
    each, by the reference path)."""
    out = []
    for name in names:
        try:
            curvature.extract(model, x, t, quantities=(name,), seed=0,
                              column_chunk=1)
        except curvature.UnsupportedGraph:
            continue
        out.append(name)
    return out


def assert_same(got, expected):
    assert set(got) == set(expected)
    for path in expected:
        assert set(got[path]) == set(expected[path]), path
        for name, value in expected[path].items():
            scale = float(abs(value).max()) or 1.0
            numpy.testing.assert_allclose(
                got[path][name], value, rtol=0, atol=1e-12 * scale,
                err_msg='{} {}'.format(path, name))


MODELS = {name: (lambda name=name: nets.build(name)) for name in nets.GRAPHS}
MODELS['chain'] = lambda: (nets.Chain(),) + nets.data()
MODELS['bn_chain'] = lambda: (nets.BNChain(),) + nets.data()
MODELS['embedding'] = lambda: (nets.Embedding(),) + nets.ids()


@pytest.mark.parametrize('chunk', [None, 3])
@pytest.mark.parametrize('graph', sorted(MODELS))
def test_stacked_passes_equal_one_pass_per_column(graph, chunk):
    model, x, t = MODELS[graph]()
    with chainer.using_config('train', False):
        names = supported(model, x, t, EXACT)
        expected = curvature.extract(model, x, t, quantities=names, seed=0,
                                     column_chunk=1)
        got = curvature.extract(model, x, t, quantities=names, seed=0,
                                column_chunk=chunk)
    assert_same(got, expected)


def test_curved_activations_and_chunks_by_memory(monkeypatch):
    """A sigmoid (residual passes of the Hessian, stacked too) and chunks
    of one or two passes forced by the memory bound."""
    model, x, t = nets.build('conv_pool_linear')
    model.act = F.sigmoid
    names = ('diag_hessian', 'kflr', 'kfra')
    expected = curvature.extract(model, x, t, quantities=names,
                                 column_chunk=1)
    for limit in (1, 2 * 5 * 48):
        monkeypatch.setattr(columns, 'MAX_ELEMENTS', limit)
        got = curvature.extract(model, x, t, quantities=names)
        assert_same(got, expected)


class Transposed(chainer.Chain):
    """A variable without the sample axis first on the way (the channel
    axis swapped to the front and back): the passes cannot be stacked."""

    def __init__(self):
        super().__init__()

        def build():
            with self.init_scope():
                self.conv = L.Convolution2D(2, 3, 3, 1, 1)
                self.fc = L.Linear(48, nets.N_CLASS)
        nets.seeded(build)

    def forward(self, x):
        h = F.transpose(F.relu(self.conv(x)), (1, 0, 2, 3))
        return self.fc(F.transpose(h * 2.0, (1, 0, 2, 3)))


def test_graph_that_cannot_be_stacked_takes_one_pass_per_column(caplog):
    model = Transposed()
    x, t = nets.data()
    expected = curvature.extract(model, x, t, quantities=('diag_ggn',),
                                 column_chunk=1)
    with caplog.at_level('INFO', logger='chainerkfac.curvature.columns'):
        got = curvature.extract(model, x, t, quantities=('diag_ggn',))
    assert 'one backward pass per column' in caplog.text
    for path in expected:
        numpy.testing.assert_array_equal(got[path]['diag_ggn'],
                                         expected[path]['diag_ggn'])


def test_column_chunk_is_checked():
    model, x, t = nets.build('conv_pool_linear')
    for value in (0, 2.5, True):
        # 2.5 ran as 2 columns at a time, without a word
        with pytest.raises(ValueError,
                           match='column_chunk must be an integer >= 1'):
            curvature.extract(model, x, t, quantities=('kflr',),
                              column_chunk=value)


# -- the rules, one function at a time ----------------------------------------

def _function(build, shape, seed=0):
    """A function node built on a random input, its input and output."""
    rng = numpy.random.RandomState(seed)
    x = chainer.Variable(rng.randn(*shape))
    y = build(x)
    return y.creator, x, y


FUNCTIONS = {
    'relu': (F.relu, (4, 3, 5)),
    'leaky_relu': (F.leaky_relu, (4, 3, 5)),
    'sigmoid': (F.sigmoid, (4, 6)),
    'tanh': (F.tanh, (4, 6)),
    'elu': (F.elu, (4, 6)),
    'softplus': (F.softplus, (4, 6)),
    'square': (F.square, (4, 6)),
    'mul_constant': (lambda x: x * 0.3, (4, 6)),
    'neg': (lambda x: -x, (4, 6)),
    'reshape': (lambda x: F.reshape(x, (4, -1)), (4, 3, 2, 2)),
    'sum': (lambda x: F.sum(x, axis=(2, 3)), (4, 3, 2, 2)),
    'mean_keepdims': (lambda x: F.mean(x, axis=2, keepdims=True),
                      (4, 3, 5)),
    'max_pooling': (lambda x: F.max_pooling_2d(x, 3, 2, pad=1), (4, 2, 7, 6)),
    'max_pooling_cover_all': (
        lambda x: F.max_pooling_2d(x, 3, 2, cover_all=True), (4, 2, 6, 6)),
    'average_pooling': (lambda x: F.average_pooling_2d(x, 2, 1, pad=1),
                        (4, 2, 5, 5)),
    'average_pooling_nd': (lambda x: F.average_pooling_nd(x, 2),
                           (4, 2, 4, 6)),
    'transpose': (lambda x: F.transpose(x, (0, 2, 1)), (4, 3, 5)),
    'linear': (lambda x: F.linear(x, numpy.random.RandomState(3).randn(
        5, 6)), (4, 6)),
    'convolution': (lambda x: F.convolution_2d(
        x, numpy.random.RandomState(3).randn(6, 2, 3, 3), stride=2, pad=1,
        dilate=2, groups=2), (4, 4, 7, 7)),
}


#: Functions left to the per-pass fallback (the others have a rule).
PER_PASS = ('transpose',)


@pytest.mark.parametrize('name', sorted(FUNCTIONS))
def test_each_rule_equals_the_functions_own_backward_per_pass(
        name, monkeypatch):
    build, shape = FUNCTIONS[name]
    function, x, y = _function(build, shape)
    if name not in PER_PASS:
        def refused(*args):
            raise AssertionError('{} fell back to one pass per column'
                                 .format(name))
        monkeypatch.setattr(columns, '_per_pass', refused)
    passes = 3
    rng = numpy.random.RandomState(1)
    stacked = rng.randn(passes * shape[0], *y.shape[1:])
    got, = columns.transpose_jacobian(function, (0,), [stacked], passes,
                                      shape[0])
    for k in range(passes):
        rows = slice(k * shape[0], (k + 1) * shape[0])
        expected, = chainer.grad([y], [x], grad_outputs=[
            chainer.Variable(stacked[rows])])
        numpy.testing.assert_allclose(got[rows], expected.array, rtol=0,
                                      atol=1e-15, err_msg=name)


def test_sum_and_difference_of_branches():
    rng = numpy.random.RandomState(0)
    a = chainer.Variable(rng.randn(4, 3))
    b = chainer.Variable(rng.randn(4, 3))
    for y, signs in ((a + b, (1, 1)), (a - b, (1, -1))):
        stacked = rng.randn(8, 3)
        got = columns.transpose_jacobian(y.creator, (0, 1), [stacked], 2, 4)
        for gx, sign in zip(got, signs):
            numpy.testing.assert_array_equal(gx, sign * stacked)


def test_propagator_yields_each_slot_once_its_calls_are_done():
    """Shared weights: a slot is handed over when all three calls of the
    shared Linear have their gradients, each equal to the reference's."""
    model, x, t = nets.build('shared_weights')
    logits = model(x)
    from chainerkfac.curvature.graph import ModelGraph
    from chainerkfac.curvature.recorder import CallRecorder
    params = dict(model.namedparams())
    recorder = CallRecorder(params)
    loss = F.softmax_cross_entropy(logits, t)
    with recorder.recording():
        loss.backward()
    graph = ModelGraph(logits, loss, params, recorder.calls, len(x))
    propagator = columns.ColumnPropagator(graph, logits.node, len(x))
    rng = numpy.random.RandomState(2)
    stacked = rng.randn(2 * len(x), nets.N_CLASS)
    seen = {}
    for slot, grads in propagator.pull_back(stacked):
        assert slot.path not in seen
        seen[slot.path] = grads
        assert set(grads) == {use.call for use in slot.uses}
    assert sorted(seen) == sorted(s.path for s in graph.slots)
    calls = graph.slot_calls
    for k in range(2):
        rows = slice(k * len(x), (k + 1) * len(x))
        expected = chainer.grad([logits], [c.output_variable for c in calls],
                                grad_outputs=[chainer.Variable(stacked[rows])])
        for call, grad in zip(calls, expected):
            got = next(g[call] for g in seen.values() if call in g)
            numpy.testing.assert_allclose(got[rows], grad.array, rtol=0,
                                          atol=1e-15)
