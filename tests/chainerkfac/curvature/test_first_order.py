"""First-order quantities against per-sample gradients by one backward pass
of each sample's loss, on every kind of graph."""
import numpy
import pytest

import chainer
import chainer.functions as F

from chainerkfac import curvature
from chainerkfac.curvature import adapters
from tests.chainerkfac.curvature import nets, oracles

FIRST = ('batch_grad', 'batch_l2', 'sum_grad_squared', 'variance')


def check_first_order(model, x, t, train=False):
    with chainer.using_config('train', train):
        expected = oracles.per_sample_gradients(model, x, t)
        got = curvature.extract(model, x, t, quantities=FIRST)
    assert set(got) == set(expected)
    n = len(x)
    for path, rows in expected.items():
        q = got[path]
        numpy.testing.assert_allclose(q['batch_grad'], rows, rtol=1e-9,
                                      atol=1e-13, err_msg=path)
        numpy.testing.assert_allclose(
            q['batch_l2'], (rows ** 2).reshape(n, -1).sum(1), rtol=1e-9,
            atol=1e-15, err_msg=path)
        numpy.testing.assert_allclose(q['sum_grad_squared'],
                                      (rows ** 2).sum(0), rtol=1e-9,
                                      atol=1e-15, err_msg=path)
        numpy.testing.assert_allclose(
            q['variance'], (rows ** 2).mean(0) - rows.mean(0) ** 2,
            rtol=1e-8, atol=1e-14, err_msg=path)
        numpy.testing.assert_allclose(dict(model.namedparams())[path].grad,
                                      rows.sum(0), rtol=1e-9, atol=1e-13,
                                      err_msg=path)


@pytest.mark.parametrize('graph', sorted(nets.GRAPHS))
def test_first_order_equals_per_sample_oracle(graph):
    model, x, t = nets.build(graph)
    check_first_order(model, x, t)


@pytest.mark.parametrize('stride,pad,dilate', [(2, 1, 1), (1, 2, 2)])
def test_convolution_geometry(stride, pad, dilate):
    model = nets.ConvPool(stride=stride, pad=pad, dilate=dilate)
    x, t = nets.data()
    check_first_order(model, x, t)


def test_batch_normalization_in_training_mode_by_per_sample_passes():
    model = nets.WithBN()
    x, t = nets.data(n=4)
    check_first_order(model, x, t, train=True)


def test_gradient_left_in_param_grad_equals_plain_backward():
    model, x, t = nets.build('residual')
    model.cleargrads()
    chainer.functions.softmax_cross_entropy(model(x), t).backward()
    plain = {path: p.grad.copy() for path, p in model.namedparams()}
    for p in model.params():
        p.grad[...] = 7.0            # extract starts from cleared gradients
    curvature.extract(model, x, t, quantities=('variance',))
    for path, p in model.namedparams():
        numpy.testing.assert_allclose(p.grad, plain[path], rtol=1e-12)


def test_only_the_quantities_asked_for():
    model, x, t = nets.build('conv_pool_linear')
    got = curvature.extract(model, x, t, quantities=('variance',))
    assert all(set(q) == {'variance'} for q in got.values())
    with pytest.raises(ValueError, match="'batch_gradient'"):
        curvature.extract(model, x, t, quantities=('batch_gradient',))


def test_convolution_sums_a_few_samples_at_a_time(monkeypatch):
    monkeypatch.setattr(adapters, 'CHUNK_ELEMENTS', 60)   # 2 of 5 samples
    model, x, t = nets.build('grouped_conv')
    check_first_order(model, x, t)


def test_embedding_and_several_batch_axes_by_per_sample_passes():
    model = nets.Embedding()
    x, t = nets.ids()
    check_first_order(model, x, t)


def test_a_loss_that_uses_parameters_itself_is_refused():
    model, x, t = nets.build('conv_pool_linear')

    def regularised(logits, t):
        return chainer.functions.softmax_cross_entropy(logits, t) + \
            1e-3 * chainer.functions.sum(model.fc.W ** 2)
    with pytest.raises(curvature.UnsupportedGraph,
                       match='/fc/W outside the predictor'):
        curvature.extract(model, x, t, lossfun=regularised)


def test_a_loss_summed_over_the_batch_is_refused():
    """The quantities are the batch mean's (BackPACK's): a summed loss
    would give per-sample gradients N times too large, silently. A sum
    over something else than the batch (as many terms as not samples)
    is not refused."""
    model, x, t = nets.build('conv_pool_linear')

    def summed(logits, t):
        return F.sum(F.softmax_cross_entropy(logits, t, reduce='no'))
    with pytest.raises(ValueError, match='sums over the batch'):
        curvature.extract(model, x, t, lossfun=summed)

    def scaled_mean(logits, t):         # was taken as a mean
        return F.softmax_cross_entropy(logits, t) * len(t)
    with pytest.raises(ValueError, match='sums over the batch'):
        curvature.extract(model, x, t, lossfun=scaled_mean)

    def two_terms(logits, t):
        return F.sum(F.stack([F.softmax_cross_entropy(logits, t)] * 2))
    curvature.extract(model, x, t, lossfun=two_terms,
                      quantities=('batch_grad',))
    assert len(x) != 2


@pytest.mark.parametrize('mc_samples', [0, 1.5, True, '2'])
def test_mc_samples_must_be_a_positive_integer(mc_samples):
    """1.5 was taken as 1, silently."""
    model, x, t = nets.build('conv_pool_linear')
    with pytest.raises(ValueError, match='mc_samples must be an integer'):
        curvature.extract(model, x, t, quantities=('diag_ggn_mc',),
                          mc_samples=mc_samples)


def test_lazily_sized_layers_before_their_first_call():
    """Chainer's MNIST example as written, ``L.Linear(None, n)``, not run
    yet, and an auxiliary lazy head the forward never calls: the
    per-sample gradients equal the loop over samples (a crash reading the
    unset gradients before)."""
    import chainer.links as L

    class TwoHeads(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.body = L.Linear(None, 8)
                self.head = L.Linear(None, 4)
                self.aux = L.Linear(None, 2)      # never called

        def forward(self, x):
            return self.head(F.relu(self.body(x)))
    numpy.random.seed(0)
    rng = numpy.random.RandomState(1)
    x = rng.randn(5, 7)
    t = rng.randint(0, 4, 5).astype(numpy.int32)
    with chainer.using_config('dtype', numpy.float64):   # W made at call
        model = TwoHeads()
        got = curvature.extract(model, x, t, quantities=('batch_grad',))
    assert sorted(got) == ['/body/W', '/body/b', '/head/W', '/head/b']
    assert model.aux.W.array is None and model.body.W.dtype == numpy.float64
    for n in range(len(x)):
        model.cleargrads()
        loss = F.softmax_cross_entropy(model(x[n:n + 1]), t[n:n + 1])
        loss.backward()
        params = dict(model.namedparams())
        for path in got:
            numpy.testing.assert_allclose(
                got[path]['batch_grad'][n], params[path].grad / len(x),
                rtol=1e-12, atol=1e-15, err_msg=path)


def test_ignored_labels_are_refused_for_every_quantity():
    """With ignored labels the loss is a mean over fewer than N samples:
    the first-order quantities were returned scaled by 1/N_valid (1.25×
    the documented ∇ℓₙ / N for one of five ignored) while the second-order
    ones were refused; now all are, alike."""
    model, x, t = nets.build('conv_pool_linear')
    t = t.copy()
    t[0] = -1
    for quantities in (('batch_grad',), ('variance',), ('diag_ggn',)):
        with pytest.raises(ValueError, match='ignore_label=-1'):
            curvature.extract(model, x, t, quantities=quantities)
    # the mean a gradient penalty's loss writes as a sum: refused with the
    # same reason (it was "the loss sums over the batch ... use a mean")

    def double_backprop(logits, t):
        return F.softmax_cross_entropy(logits, t,
                                       enable_double_backprop=True)
    with pytest.raises(ValueError, match="contain -1 .Chainer's "
                       "ignore_label.: the loss is then a mean over fewer"):
        curvature.extract(model, x, t, lossfun=double_backprop)


def test_no_graph_and_a_loss_that_is_no_scalar_are_named():
    """Under no_backprop_mode extract returned {} silently; a loss with
    reduce='no' failed inside Chainer's backward ('NoneType' object is
    not subscriptable)."""
    model, x, t = nets.build('conv_pool_linear')
    with chainer.no_backprop_mode():
        with pytest.raises(RuntimeError, match='backpropagation is off'):
            curvature.extract(model, x, t)

    def per_sample(logits, t):
        return F.softmax_cross_entropy(logits, t, reduce='no')
    with pytest.raises(ValueError, match=r'lossfun must return the scalar '
                       r'mean loss of the batch, got shape \({},\)'.format(
                           len(x))):
        curvature.extract(model, x, t, lossfun=per_sample)


def test_a_classifier_or_several_outputs_are_named():
    """Chainer's L.Classifier (it returns the loss) and a predictor that
    returns a tuple: errors that say what to pass, before any pass (they
    were a TypeError from inside the Classifier and an AttributeError)."""
    import chainer.links as L
    model, x, t = nets.build('conv_pool_linear')
    with pytest.raises(TypeError, match='pass model.predictor'):
        curvature.extract(L.Classifier(model), x, t)

    class TwoOutputs(chainer.Chain):
        def __init__(self):
            super().__init__()
            with self.init_scope():
                self.net = model

        def forward(self, x):
            y = self.net(x)
            return y, y
    with pytest.raises(TypeError, match='as one Variable, got a tuple'):
        curvature.extract(TwoOutputs(), x, t)
