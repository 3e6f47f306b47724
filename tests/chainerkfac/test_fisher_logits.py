"""The logits that ``fisher='mc'`` and ``'exact'`` sample from: the
logits-function calls of the loss on the model's outputs, each row
weighted by its weight in the loss (a head's coefficient, a mean's count,
an ignored label, a class weight): the factors of the loss's generalised
Gauss-Newton matrix, against float64 oracles written out here."""
import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from tests.chainerkfac import helpers

LOSSES = {
    'softmax_cross_entropy': lambda y, t: F.softmax_cross_entropy(y, t),
    'log_softmax': lambda y, t: -F.mean(F.select_item(F.log_softmax(y), t)),
    'softmax': lambda y, t: -F.mean(F.log(F.select_item(F.softmax(y), t))),
}


def _step(loss, fisher, model_seed=0):
    x, t = helpers.data(n=8, shape=(5,), n_class=3)
    numpy.random.seed(model_seed)
    model = helpers.MLP()
    optimizer = helpers.kfac(fisher=fisher, seed=1)
    optimizer.setup(model)
    optimizer.update(lambda x, t: loss(model(x), t), x, t)
    return model, optimizer


@pytest.mark.parametrize('fisher', ['exact', 'mc'])
@pytest.mark.parametrize('loss', ['log_softmax', 'softmax'])
def test_log_softmax_and_softmax_losses_sample_as_softmax_cross_entropy(
        loss, fisher):
    """F.log_softmax and F.softmax (registered logits functions) keep
    their output, not the logits: the passes raised ``'NoneType' object
    has no attribute 'astype'``. Their logits are now taken from that
    output (up to a constant per sample): the factors and the step equal
    those of F.softmax_cross_entropy on the same logits, in float64 (the
    exact Fisher to rounding; the sampled one draws the same labels from
    probabilities equal to rounding)."""
    model, optimizer = _step(LOSSES[loss], fisher)
    reference, expected = _step(LOSSES['softmax_cross_entropy'], fisher)
    for got, want in zip(optimizer.blocks, expected.blocks):
        for name in want.factors:
            numpy.testing.assert_allclose(
                helpers.dense(got.factors[name]),
                helpers.dense(want.factors[name]), rtol=1e-10, atol=1e-14)
    for (name, a), (_, b) in zip(sorted(model.namedparams()),
                                 sorted(reference.namedparams())):
        numpy.testing.assert_allclose(a.array, b.array, rtol=1e-10,
                                      atol=1e-14, err_msg=name)


class TwoHeads(chainer.Chain):
    def __init__(self, coefficient=0.3):
        super().__init__()
        self.coefficient = coefficient
        with helpers.float64_links(), self.init_scope():
            self.trunk = L.Linear(5, 6)
            self.main = L.Linear(6, 3)
            self.aux = L.Linear(6, 3)

    def loss(self, x, t):
        h = F.tanh(self.trunk(x))
        return (F.softmax_cross_entropy(self.main(h), t) +
                self.coefficient * F.softmax_cross_entropy(self.aux(h), t))


class Gate(chainer.Chain):
    """A softmax inside the model, a regression loss on its output."""

    def __init__(self):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.l1 = L.Linear(5, 6)
            self.l2 = L.Linear(6, 3)

    def forward(self, x):
        return self.l2(F.softmax(self.l1(x)) * 6.0)


def _softmax(z):
    e = numpy.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _hessians(z):
    """diag(p_n) − p_n p_nᵀ per row (the NLL's Hessian in the logits)."""
    p = _softmax(z)
    return numpy.einsum('nc,cd->ncd', p, numpy.eye(p.shape[1])) - \
        numpy.einsum('nc,nd->ncd', p, p)


def _factors(optimizer):
    return {block.name: {n: helpers.dense(f)
                         for n, f in block.factors.items()}
            for block in optimizer.blocks}


def _two_heads_step(fisher, coefficient=0.3, n=6, mc_samples=1):
    x, t = helpers.data(n=n, shape=(5,), n_class=3, seed=3)
    numpy.random.seed(2)
    model = TwoHeads(coefficient)
    optimizer = helpers.kfac(fisher=fisher, lr=0.0, momentum=0.0, seed=4,
                             mc_samples=mc_samples)
    optimizer.setup(model)
    drawn = []
    sample = optimizer.estimator.label_sampler.sample

    def recorded(logits):
        labels = sample(logits)
        drawn.append(labels)
        return labels
    optimizer.estimator.label_sampler.sample = recorded
    optimizer.update(model.loss, x, t)
    return model, x, _factors(optimizer), drawn


def _trunk_jacobians(model, x):
    """Per row, ``d logits_k / d trunk output`` for the main and the
    auxiliary head: ``W_k diag(1 − tanh²)``."""
    h = numpy.tanh(model.trunk(x).array)
    d = 1.0 - h ** 2
    return [numpy.einsum('cj,nj->ncj', head.W.array, d)
            for head in (model.main, model.aux)], h


def test_two_heads_exact_fisher_is_the_weighted_losss_ggn():
    """Main + 0.3 auxiliary head were refused (before, the auxiliary head
    alone was sampled). Now each layer's G is that of the loss's GGN,
    ``(1/N) Σ_n Σ_k c_k J_knᵀ H_kn J_kn``: the main head's alone with
    coefficient 1, the auxiliary head's with 0.3, the trunk's both."""
    model, x, factors, _ = _two_heads_step('exact')
    (j_main, j_aux), h = _trunk_jacobians(model, x)
    h_main = _hessians(model.main(h).array)
    h_aux = _hessians(model.aux(h).array)
    n = len(x)
    expected = {
        '/main': h_main.sum(0) / n,
        '/aux': 0.3 * h_aux.sum(0) / n,
        '/trunk': (numpy.einsum('nci,ncd,ndj->ij', j_main, h_main, j_main) +
                   0.3 * numpy.einsum('nci,ncd,ndj->ij', j_aux, h_aux,
                                      j_aux)) / n,
    }
    for name, want in expected.items():
        numpy.testing.assert_allclose(factors[name]['G'], want, rtol=1e-10,
                                      atol=1e-15, err_msg=name)


def test_two_heads_sampled_fisher_samples_every_head_with_its_weight():
    """One pass draws a label per row of each head; each head's residual
    ``p − e_y`` enters with ``√c_k``, so the trunk's G holds the products
    across heads of this draw (of mean zero over draws)."""
    model, x, factors, drawn = _two_heads_step('mc')
    assert len(drawn) == 2
    (j_main, j_aux), h = _trunk_jacobians(model, x)
    eye = numpy.eye(3)
    r_main = _softmax(model.main(h).array) - eye[drawn[0]]
    r_aux = numpy.sqrt(0.3) * (_softmax(model.aux(h).array) - eye[drawn[1]])
    g = numpy.einsum('nci,nc->ni', j_main, r_main) + \
        numpy.einsum('nci,nc->ni', j_aux, r_aux)
    n = len(x)
    expected = {'/main': r_main.T @ r_main / n, '/aux': r_aux.T @ r_aux / n,
                '/trunk': g.T @ g / n}
    for name, want in expected.items():
        numpy.testing.assert_allclose(factors[name]['G'], want, rtol=1e-10,
                                      atol=1e-15, err_msg=name)


def test_sampled_heads_average_to_the_exact_fisher():
    """Over many draws the sampled G tends to the exact one (a check of
    the weights' square roots: with ``c_k`` in place of ``√c_k`` the
    auxiliary head's G would be 0.3² / 0.3 = 0.3 times too small)."""
    _, _, exact, _ = _two_heads_step('exact', n=4)
    _, _, sampled, _ = _two_heads_step('mc', n=4, mc_samples=4000)
    for name in ('/main', '/aux', '/trunk'):
        scale = numpy.abs(exact[name]['G']).max()
        numpy.testing.assert_allclose(sampled[name]['G'], exact[name]['G'],
                                      atol=0.1 * scale, err_msg=name)


@pytest.mark.parametrize('fisher', ['mc', 'exact'])
def test_a_loss_that_rewards_a_heads_likelihood_is_refused(fisher):
    """A negative coefficient is no Gauss-Newton matrix (and has no square
    root): refused, naming the call; fisher='emp' takes the loss."""
    x, t = helpers.data(n=8, shape=(5,), n_class=3)
    model = TwoHeads(-0.5)
    optimizer = helpers.kfac(fisher=fisher)
    optimizer.setup(model)
    with pytest.raises(RuntimeError, match=r"weights of at least 0.*"
                       r"SoftmaxCrossEntropy call's rows \(weight -0\.0625\)"
                       r".*fisher='emp'"):
        optimizer.update(model.loss, x, t)
    optimizer = helpers.kfac(fisher='emp')
    optimizer.setup(model)
    optimizer.update(model.loss, x, t)
    assert all(block.has_inverses() for block in optimizer.blocks)


def _mlp_factors(loss, fisher='exact', n=8, seed=0, **kwargs):
    x, t = helpers.data(n=n, shape=(5,), n_class=3, seed=seed)
    numpy.random.seed(0)
    model = helpers.MLP()
    optimizer = helpers.kfac(fisher=fisher, lr=0.0, momentum=0.0, seed=1,
                             **kwargs)
    optimizer.setup(model)
    optimizer.update(lambda x, t: loss(model, x, t), x, t)
    return model, x, t, _factors(optimizer)


def test_ignored_labels_and_class_weights_weigh_their_rows():
    """``softmax_cross_entropy`` with ignored labels (padding) and class
    weights: the GGN is ``Σ_n w_n H_n`` with ``w_n = cw[t_n] / count`` on
    the counted rows and 0 on the ignored ones (before, every row was
    sampled as a counted one of weight 1/N)."""
    class_weight = numpy.array([0.5, 2.0, 1.0])

    def loss(model, x, t):
        t = t.copy()
        t[[1, 4]] = -1
        return F.softmax_cross_entropy(model(x), t, class_weight=class_weight)
    model, x, t, factors = _mlp_factors(loss)
    valid = numpy.ones(len(t), bool)
    valid[[1, 4]] = False
    weights = valid * class_weight[t] / valid.sum()
    z = model(x).array
    numpy.testing.assert_allclose(
        factors['/l2']['G'],
        numpy.einsum('n,ncd->cd', weights, _hessians(z)), rtol=1e-10,
        atol=1e-15)


def test_distillation_loss_with_a_teachers_softmax():
    """``0.5 CE(z, t) + 0.5 CE(z, softmax(teacher(x)))`` on the same
    logits: the soft target's weight is its total (1), so the GGN is the
    plain loss's; the teacher's softmax (a logits call of the loss whose
    logits no modelled layer computes, and which gets no gradient) is no
    output of the model. Before, the two calls were refused."""
    with helpers.float64_links():
        teacher = L.Linear(5, 3)

    def distilled(model, x, t):
        z = model(x)
        q = F.softmax(teacher(x))
        return 0.5 * F.softmax_cross_entropy(z, t) + \
            0.5 * F.softmax_cross_entropy(z, q)

    def plain(model, x, t):
        return F.softmax_cross_entropy(model(x), t)
    _, _, _, got = _mlp_factors(distilled)
    _, _, _, want = _mlp_factors(plain)
    for name in want:
        numpy.testing.assert_allclose(got[name]['G'], want[name]['G'],
                                      rtol=1e-10, atol=1e-15, err_msg=name)


def test_a_loss_scale_is_not_a_coefficient():
    """Chainer's loss scaling multiplies every output's gradient; the
    weights divide it out."""
    def loss(model, x, t):
        return F.softmax_cross_entropy(model(x), t)
    x, t = helpers.data(n=8, shape=(5,), n_class=3)
    got = []
    for scale in (None, 64.0):
        numpy.random.seed(0)
        model = helpers.MLP()
        optimizer = helpers.kfac(fisher='exact', lr=0.0, momentum=0.0)
        optimizer.setup(model)
        if scale is not None:
            optimizer._loss_scale = scale
        optimizer.update(lambda x, t: loss(model, x, t), x, t)
        got.append(_factors(optimizer))
    for name in got[0]:
        numpy.testing.assert_allclose(got[1][name]['G'], got[0][name]['G'],
                                      rtol=1e-12, err_msg=name)


class Recurrent(chainer.Chain):
    """An Elman network over T steps, a loss at every step (BPTT)."""

    def __init__(self):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.inp = L.Linear(5, 6)
            self.rec = L.Linear(6, 6, nobias=True)
            self.out = L.Linear(6, 3)

    def loss(self, xs, ts):
        h, total = None, 0
        for x, t in zip(xs, ts):
            a = self.inp(x) if h is None else self.inp(x) + self.rec(h)
            h = F.tanh(a)
            total += F.softmax_cross_entropy(self.out(h), t)
        return total / len(xs)


@pytest.mark.parametrize('fisher', ['mc', 'exact'])
def test_a_sequence_loss_trains(fisher):
    """A BPTT loss (a softmax cross-entropy at each time step, averaged)
    was refused; each step's rows are now sampled with weight 1/T."""
    rng = numpy.random.RandomState(0)
    xs = [rng.randn(8, 5) for _ in range(4)]
    ts = [(x[:, :3].argmax(axis=1)).astype(numpy.int32) for x in xs]
    numpy.random.seed(1)
    model = Recurrent()
    optimizer = helpers.kfac(fisher=fisher, lr=0.05, seed=0)
    optimizer.setup(model)
    first = float(model.loss(xs, ts).array)
    for _ in range(30):
        optimizer.update(model.loss, xs, ts)
    assert float(model.loss(xs, ts).array) < 0.8 * first
    for block in optimizer.blocks:
        for name, factor in block.factors.items():
            assert numpy.isfinite(helpers.dense(factor)).all(), name


@pytest.mark.parametrize('fisher', ['mc', 'exact'])
def test_a_softmax_inside_the_model_is_refused(fisher):
    """A regression loss on a model with a softmax gate: the gate's
    softmax was taken for the logits (the 'exact' Fisher of a categorical
    distribution the model does not predict), or the passes crashed."""
    x = numpy.random.RandomState(0).randn(8, 5)
    y = numpy.random.RandomState(1).randn(8, 3)
    model = Gate()
    optimizer = helpers.kfac(fisher=fisher)
    optimizer.setup(model)
    with pytest.raises(RuntimeError, match=r"Softmax call is inside the "
                       r"model.*through LinearFunction"):
        optimizer.update(lambda x, y: F.mean_squared_error(model(x), y),
                         x, y)


def test_a_softmax_beside_the_loss_is_not_its_logits():
    """A softmax the loss function computes for a report (not part of the
    loss) is no logits call of the loss."""
    x, t = helpers.data(n=8, shape=(5,), n_class=3)
    numpy.random.seed(0)
    model = helpers.MLP()
    optimizer = helpers.kfac(fisher='exact')
    optimizer.setup(model)

    def loss(x, t):
        y = model(x)
        F.softmax(y)                              # e.g. for a confidence
        return F.softmax_cross_entropy(y, t)
    optimizer.update(loss, x, t)
    reference, expected = _step(LOSSES['softmax_cross_entropy'], 'exact')
    for (name, a), (_, b) in zip(sorted(model.namedparams()),
                                 sorted(reference.namedparams())):
        numpy.testing.assert_array_equal(a.array, b.array, err_msg=name)


def test_sequence_exact_fisher_is_the_sampled_ones_mean():
    """The exact Fisher's passes go one output at a time, each reaching the
    shared layers' calls up to its time step only; the factor is still
    the sum over passes divided by the layer's calls in the loss's pass,
    as the sampled passes (every output at once) average to. Before the
    per-block count, the shared layers' G came out 2/(T+1) of it."""
    rng = numpy.random.RandomState(0)
    xs = [rng.randn(6, 5) for _ in range(3)]
    ts = [(x[:, :3].argmax(axis=1)).astype(numpy.int32) for x in xs]
    got = {}
    for fisher, samples in (('exact', 1), ('mc', 3000)):
        numpy.random.seed(1)
        model = Recurrent()
        optimizer = helpers.kfac(fisher=fisher, lr=0.0, momentum=0.0,
                                 seed=0, mc_samples=samples)
        optimizer.setup(model)
        optimizer.update(model.loss, xs, ts)
        got[fisher] = _factors(optimizer)
    for name in ('/inp', '/rec', '/out'):
        exact = got['exact'][name]['G']
        numpy.testing.assert_allclose(got['mc'][name]['G'], exact,
                                      atol=0.1 * numpy.abs(exact).max(),
                                      err_msg=name)


class SharedEncoder(chainer.Chain):
    """An encoder called twice: once under the classifier's logits, once
    under a regression term (no logits)."""

    def __init__(self):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.enc = L.Linear(5, 6)
            self.head = L.Linear(6, 3)

    def loss(self, x, t, regression=0.1):
        logits = self.head(F.tanh(self.enc(x)))
        loss = F.softmax_cross_entropy(logits, t)
        if regression:
            loss += regression * F.mean(self.enc(x[::-1] * 0.5) ** 2)
        return loss


@pytest.mark.parametrize('fisher', ['exact', 'mc'])
def test_a_call_that_reaches_no_logits_counts_in_no_estimate(fisher):
    """A shared encoder's second call feeds a regression term only: no
    Fisher pass reaches it. The exact G was divided by the encoder's 2
    calls in the loss's pass (half the sampled one's, and half what it was
    before multi-output losses); now by the 1 the passes reach, as the
    sampled passes average, so the regression term changes neither."""
    x, t = helpers.data(n=6, shape=(5,), n_class=3, seed=5)
    got = []
    for regression in (0.1, 0.0):
        numpy.random.seed(3)
        model = SharedEncoder()
        optimizer = helpers.kfac(fisher=fisher, lr=0.0, momentum=0.0,
                                 seed=2)
        optimizer.setup(model)
        optimizer.update(lambda x, t: model.loss(x, t, regression), x, t)
        got.append(_factors(optimizer)['/enc']['G'])
    numpy.testing.assert_allclose(got[0], got[1], rtol=1e-12, atol=1e-16)


@pytest.mark.parametrize('fisher', ['exact', 'mc'])
def test_an_empty_micro_batch_under_a_log_softmax_loss(fisher):
    """A rank's empty share at an epoch's end, the loss written with
    F.log_softmax: its row weights were taken by ``reshape(0, -1)``
    (``cannot reshape array of size 0``). It captures nothing; the step
    is that of the other micro-batch."""
    x, t = helpers.data(n=6, shape=(5,), n_class=3, seed=1)
    results = []
    for chunks in ((slice(0, 6), slice(0, 0)), (slice(0, 6),)):
        numpy.random.seed(0)
        model = helpers.MLP()
        optimizer = helpers.kfac(fisher=fisher, acc_iters=len(chunks),
                                 seed=1, lr=0.05)
        optimizer.setup(model)

        def loss(x, t):
            return -F.sum(F.select_item(F.log_softmax(model(x)), t)) / \
                max(len(t), 1)
        for chunk in chunks:
            optimizer.update(loss, x[chunk], t[chunk])
        assert optimizer.t == 1
        results.append({n: p.array.copy() for n, p in model.namedparams()})
    for name in results[1]:
        numpy.testing.assert_allclose(results[0][name], results[1][name],
                                      rtol=1e-12, atol=1e-15, err_msg=name)


class ClassifyAndReconstruct(chainer.Chain):
    """A classifier with a decoder whose only term is a squared error."""

    def __init__(self):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.enc = L.Linear(5, 6)
            self.head = L.Linear(6, 3)
            self.dec = L.Linear(6, 5)

    def loss(self, x, t):
        h = F.tanh(self.enc(x))
        return F.softmax_cross_entropy(self.head(h), t) + \
            F.mean_squared_error(self.dec(h), x)


@pytest.mark.parametrize('fisher', ['exact', 'mc', 'emp'])
def test_a_layer_under_a_regression_term_only_is_said_so(fisher, caplog):
    """Under the sampled or exact Fisher the decoder gets no G (its output
    reaches the loss outside the logits, as the docs say). The warning
    said a backward pass had not reached the hook ("used by another
    function, or run in another thread?"); it now names the reason and
    the fix (fisher='emp', under which nothing is said)."""
    import logging
    x, t = helpers.data(n=6, shape=(5,), n_class=3, seed=5)
    numpy.random.seed(3)
    model = ClassifyAndReconstruct()
    optimizer = helpers.kfac(fisher=fisher, seed=2).setup(model)
    with caplog.at_level(logging.WARNING, logger='chainerkfac'):
        optimizer.update(model.loss, x, t)
    said = [r.getMessage() for r in caplog.records
            if 'not captured' in r.getMessage()]
    if fisher == 'emp':
        assert said == []
        return
    assert len(said) == 1 and '/dec (' in said[0], said
    assert "fisher='{}' takes the output gradients from passes from the " \
        "model's logits".format(fisher) in said[0]
    assert "fisher='emp' takes every term" in said[0]
    assert 'another thread' not in said[0]


@pytest.mark.parametrize('fisher', ['exact', 'mc'])
def test_a_regression_loss_under_a_sampled_fisher_names_it_and_the_fix(
        fisher):
    """A squared error alone has no logits to sample from: refused, now
    naming the loss's last operation and fisher='emp'."""
    x, _ = helpers.data(n=6, shape=(5,), n_class=3, seed=5)
    numpy.random.seed(3)
    model = ClassifyAndReconstruct()
    optimizer = helpers.kfac(fisher=fisher, seed=2).setup(model)
    with pytest.raises(RuntimeError, match=r"needs the logits: the loss "
                       r"\(its last operation MeanSquaredError\).*"
                       r"fisher='emp'"):
        optimizer.update(lambda x: F.mean_squared_error(
            model.dec(F.tanh(model.enc(x))), x), x)
