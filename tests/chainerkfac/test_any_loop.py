"""K-FAC in any training loop: capture that does not depend on who runs
the loss (issue 16).

The loops are those of Chainer's examples, written here with the same
calling pattern: a hand-written ``cleargrads(); loss.backward();
update()``, BPTT over several time steps, a GAN updater that runs the
discriminator on real and fake batches before ``update(lossfun)`` and
backpropagates the generator's loss through the discriminator after the
discriminator's update. Factors are checked against per-sample, per-call
oracles in float64.
"""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import gc
import logging

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from tests.chainerkfac import helpers


def _weights(model):
    return {n: p.array.copy() for n, p in model.namedparams()}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        numpy.testing.assert_array_equal(a[name], b[name], err_msg=name)


def _moved(before, after):
    return all(not numpy.array_equal(before[n], after[n]) for n in before)


# -- the hand-written loop -------------------------------------------------------
@pytest.mark.parametrize('acc_iters', [1, 2])
@pytest.mark.parametrize('bn', [False, True])
def test_manual_loop_equals_update_with_the_loss(acc_iters, bn):
    x, t = helpers.data(n=8)
    results = []
    for manual in (False, True):
        numpy.random.seed(0)
        model = helpers.ConvNet(bn=bn)
        initial = _weights(model)
        optimizer = helpers.kfac(lr=0.05, damping=1e-2, acc_iters=acc_iters,
                                 weight_rescale='auto')
        optimizer.setup(model)
        lossfun = helpers.loss_of(model)
        for step in range(3):
            for micro in range(acc_iters):
                chunk = slice(4 * micro, 4 * micro + 8 // acc_iters)
                helpers.update(optimizer, model, lossfun, x[chunk],
                               t[chunk], manual)
        results.append(_weights(model))
        assert optimizer.t == 3
        assert _moved(initial, results[-1])
    _assert_same(*results)


def test_manual_loop_without_cleargrads_between_micro_batches():
    # The loop clears the gradients once per step and lets param.grad
    # accumulate over the micro-batches: the optimizer holds each
    # micro-batch's gradient, so the step is the same.
    x, t = helpers.data(n=8)
    results = []
    for clear in (True, False):
        numpy.random.seed(0)
        model = helpers.ConvNet()
        optimizer = helpers.kfac(lr=0.05, damping=1e-2, acc_iters=2)
        optimizer.setup(model)
        lossfun = helpers.loss_of(model)
        for step in range(2):
            for chunk in (slice(0, 4), slice(4, 8)):
                if clear or chunk.start == 0:
                    model.cleargrads()
                lossfun(x[chunk], t[chunk]).backward()
                optimizer.update()
        results.append(_weights(model))
    _assert_same(*results)


def test_forward_before_update_is_captured():
    # DCGAN's updater: the model runs before update, whose loss function
    # only combines the outputs. A is captured all the same.
    model = helpers.MLP(sizes=(5, 4, 3))
    x, t = helpers.data(n=6, shape=(5,), n_class=3)
    optimizer = helpers.kfac(lr=0.0, momentum=0.0).setup(model)
    y = model(x)
    optimizer.update(lambda y, t: F.softmax_cross_entropy(y, t), y, t)
    block = helpers.block_named(optimizer, '/l1')
    ones = numpy.ones((6, 1))
    a = numpy.hstack([x, ones])
    numpy.testing.assert_allclose(block.factors['A'], a.T.dot(a) / 6,
                                  rtol=1e-12)
    assert block.has_inverses()


def test_evaluation_between_steps_changes_nothing():
    x, t = helpers.data(n=6)
    xv, _ = helpers.data(n=5, seed=1)
    results = []
    for evaluate in (False, True):
        numpy.random.seed(0)
        model = helpers.ConvNet(bn=True)
        optimizer = helpers.kfac(lr=0.05, damping=1e-2).setup(model)
        for _ in range(3):
            if evaluate:
                with chainer.using_config('train', False), \
                        chainer.no_backprop_mode():
                    model(xv)
                model(xv)     # a forward no loss uses: no backward
            model.cleargrads()
            helpers.loss_of(model)(x, t).backward()
            optimizer.update()
        results.append(_weights(model))
    for name in results[0]:
        if name.startswith('/bn'):
            continue          # the second forward moved BN's statistics
        numpy.testing.assert_array_equal(results[0][name],
                                         results[1][name], err_msg=name)


# -- several calls of a link: the convention, by per-sample oracles --------------
class SharedLinear(chainer.Chain):
    """One Linear called on three inputs (BPTT's pattern: x_t + h_{t−1}
    through the same weights), a loss summed over the steps."""

    def __init__(self, steps=3):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.cell = L.Linear(4, 4)
            self.out = L.Linear(4, 3)
        self.steps = steps

    def forward(self, xs, ts, outputs=None):
        h = chainer.Variable(numpy.zeros((xs.shape[1], 4)))
        loss = 0
        for k in range(self.steps):
            y = self.cell(xs[k] + h)
            if outputs is not None:
                outputs.append(y)
            h = F.tanh(y)
            loss += F.softmax_cross_entropy(self.out(h), ts[k])
        return loss


def _per_sample_oracle(model, xs, ts):
    """A and G of ``/cell`` by the convention of
    :mod:`chainerkfac.fisher_blocks.base` from per-sample backward passes:
    A = Σ_calls (1/N) Σ_n a aᵀ, G = mean_calls (1/N) Σ_n g gᵀ with g the
    per-sample loss's gradient w.r.t. that call's output."""
    steps, n = xs.shape[:2]
    a_sum = numpy.zeros((5, 5))
    g_sum = numpy.zeros((4, 4))
    for i in range(n):
        outputs = []
        loss = model(xs[:, i:i + 1], ts[:, i:i + 1], outputs)
        model.cleargrads()
        loss.backward(retain_grad=True)
        inputs = []
        h = numpy.zeros((1, 4))
        for k in range(steps):
            inputs.append(numpy.hstack([xs[k, i:i + 1] + h, [[1.0]]]))
            h = numpy.tanh(outputs[k].array)
        for k in range(steps):
            a_sum += inputs[k].T.dot(inputs[k])
            g = outputs[k].grad       # the per-sample loss's gradient
            g_sum += g.T.dot(g)
    return a_sum / n, g_sum / (n * steps)


@pytest.mark.parametrize('manual', [False, True])
def test_bptt_factors_follow_the_multi_call_convention(manual):
    model = SharedLinear()
    rng = numpy.random.RandomState(3)
    xs = rng.randn(3, 5, 4)
    ts = rng.randint(0, 3, size=(3, 5)).astype(numpy.int32)
    optimizer = helpers.kfac(lr=0.0, momentum=0.0).setup(model)
    if manual:       # PTB's BPTTUpdater
        loss = model(xs, ts)
        model.cleargrads()
        loss.backward()
        loss.unchain_backward()
        optimizer.update()
    else:
        optimizer.update(model, xs, ts)
    # The batch loss is a sum over steps of batch means: its per-sample
    # gradients are N times the backward's, as for one call.
    a, g = _per_sample_oracle(model, xs, ts)
    block = helpers.block_named(optimizer, '/cell')
    numpy.testing.assert_allclose(block.factors['A'], a, rtol=1e-10)
    numpy.testing.assert_allclose(block.factors['G'], g, rtol=1e-10)


# -- a GAN ------------------------------------------------------------------------
class _BiaslessSecondCall(chainer.Chain):
    def __init__(self, conv):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.layer = L.Convolution2D(2, 2, 1) if conv else \
                L.Linear(4, 4)
        self.conv = conv

    def forward(self, x):
        h = F.tanh(self.layer(x))
        # the link's W again, without its bias (a tied second use)
        return F.convolution_2d(h, self.layer.W) if self.conv else \
            F.linear(h, self.layer.W)


@pytest.mark.parametrize('conv', [False, True])
@pytest.mark.parametrize('low_rank', [False, True])
def test_a_call_without_the_bias_adds_zeros_to_its_row(conv, low_rank):
    """``F.linear(h, link.W)`` on a link with a bias: that call's input
    has a 0 where the link's call has the bias's 1 (it adds nothing to the
    bias's gradient); it had a 1."""
    model = _BiaslessSecondCall(conv)
    rng = numpy.random.RandomState(0)
    x = rng.randn(6, 2, 1, 2) if conv else rng.randn(6, 4)
    t = rng.randint(0, 2, size=(6, 2) if conv else 6).astype(numpy.int32)
    optimizer = helpers.kfac(lr=0.0, momentum=0.0,
                             low_rank=low_rank).setup(model)

    def lossfun(x, t):
        y = model(x)
        if conv:
            y = F.reshape(F.transpose(y, (0, 2, 3, 1)), (-1, 2))
            t = t.ravel()
        return F.softmax_cross_entropy(y, t)
    optimizer.update(lossfun, x, t)
    layer = model.layer
    rows_x = x.transpose(0, 2, 3, 1).reshape(-1, 2) if conv else x
    h = numpy.tanh(layer(x).array)
    rows_h = h.transpose(0, 2, 3, 1).reshape(-1, 2) if conv else h
    first = numpy.hstack([rows_x, numpy.ones((len(rows_x), 1))])
    second = numpy.hstack([rows_h, numpy.zeros((len(rows_h), 1))])
    expected = (first.T.dot(first) + second.T.dot(second)) / len(x)
    block = helpers.block_named(optimizer, '/layer')
    numpy.testing.assert_allclose(helpers.dense(block.factors['A']),
                                  expected, rtol=1e-12, atol=1e-14)


class Generator(chainer.Chain):
    def __init__(self):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.l1 = L.Linear(2, 3)

    def forward(self, z):
        return F.tanh(self.l1(z))


class Discriminator(chainer.Chain):
    def __init__(self):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.l1 = L.Linear(3, 4)
            self.l2 = L.Linear(4, 1)

    def forward(self, x):
        return self.l2(F.tanh(self.l1(x)))


def _loss_dis(y_fake, y_real):
    n = y_fake.shape[0]
    return (F.sum(F.softplus(-y_real)) + F.sum(F.softplus(y_fake))) / n


def _loss_gen(y_fake):
    return F.sum(F.softplus(-y_fake)) / y_fake.shape[0]


def _gan_iteration(gen, dis, opt_gen, opt_dis, x_real, z, manual):
    y_real = dis(x_real)
    x_fake = gen(z)
    y_fake = dis(x_fake)
    if manual:
        loss = _loss_dis(y_fake, y_real)
        dis.cleargrads()
        loss.backward()
        opt_dis.update()
        loss = _loss_gen(y_fake)
        gen.cleargrads()
        loss.backward()
        opt_gen.update()
    else:           # Chainer's DCGAN example updater
        opt_dis.update(_loss_dis, y_fake, y_real)
        opt_gen.update(_loss_gen, y_fake)
    return x_fake


def _call_oracle(inputs, out_grads):
    """A = Σ_calls (1/N) Σ_n a aᵀ and G = mean_calls N Σ_n gy gyᵀ from the
    inputs and (batch-mean) output gradients of each call of a Linear."""
    a = 0
    for x in inputs:
        rows = numpy.hstack([x, numpy.ones((len(x), 1))])
        a = a + rows.T.dot(rows) / len(x)
    g = sum(len(gy) * gy.T.dot(gy) for gy in out_grads) / len(out_grads)
    return a, g


class _Replay:
    """The last GAN iteration replayed on copies, by hand, keeping every
    call's input and output: the discriminator's loss on the weights the
    iteration starts from; the generator's loss backpropagated through the
    same graph after the discriminator's weights were updated in place (as
    the optimizer does)."""

    def __init__(self, gen, dis, x_real, z):
        self.gen, self.dis = gen.copy('copy'), dis.copy('copy')
        self.z = z
        self.h = self.gen.l1(z)
        x_fake = F.tanh(self.h)
        self.d_in = [x_real, x_fake.array]
        self.d_out = [self.dis.l1(x_real), self.dis.l1(x_fake)]
        y_real, self.y_fake = [self.dis.l2(F.tanh(h)) for h in self.d_out]
        loss = _loss_dis(self.y_fake, y_real)
        loss.backward(retain_grad=True)
        self.dis_factors = _call_oracle(self.d_in,
                                        [y.grad for y in self.d_out])

    def generator_factors(self, updated_dis):
        for mine, theirs in zip(self.dis.params(), updated_dis.params()):
            mine.array[...] = theirs.array
        self.h.grad = None
        self.gen.cleargrads()
        _loss_gen(self.y_fake).backward(retain_grad=True)
        return _call_oracle([self.z], [self.h.grad])


@pytest.mark.parametrize('manual', [False, True])
def test_gan_each_optimizer_takes_only_its_own_loss(manual):
    numpy.random.seed(0)
    gen, dis = Generator(), Discriminator()
    opt_gen = helpers.kfac(lr=0.05, damping=1e-2).setup(gen)
    opt_dis = helpers.kfac(lr=0.05, damping=1e-2).setup(dis)
    rng = numpy.random.RandomState(1)
    for iteration in range(3):
        x_real = rng.randn(6, 3)
        z = rng.randn(6, 2)
        if iteration == 2:
            replay = _Replay(gen, dis, x_real, z)
        _gan_iteration(gen, dis, opt_gen, opt_dis, x_real, z, manual)
    # The discriminator's factors: its two calls in its own loss, not the
    # generator's loss backpropagated through it after its update (the
    # iteration before).
    block = helpers.block_named(opt_dis, '/l1')
    numpy.testing.assert_allclose(block.factors['A'], replay.dis_factors[0],
                                  rtol=1e-10)
    numpy.testing.assert_allclose(block.factors['G'], replay.dis_factors[1],
                                  rtol=1e-10)
    # The generator's: its own loss, not the discriminator's loss
    # backpropagated through it.
    a_gen, g_gen = replay.generator_factors(dis)
    block = helpers.block_named(opt_gen, '/l1')
    numpy.testing.assert_allclose(block.factors['A'], a_gen, rtol=1e-10)
    numpy.testing.assert_allclose(block.factors['G'], g_gen, rtol=1e-10)
    assert opt_gen.t == opt_dis.t == 3


# -- no block loses its curvature silently ------------------------------------------
class WithHead(chainer.Chain):
    def __init__(self):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.body = L.Linear(5, 4)
            self.head = L.Linear(4, 3)
            self.unused = L.Linear(4, 2)

    def forward(self, x):
        return self.head(F.relu(self.body(x)))


def test_a_due_factor_not_captured_is_named_and_counted(caplog):
    model = WithHead()
    unused = model.unused.W.array.copy()
    x, t = helpers.data(n=6, shape=(5,), n_class=3)
    optimizer = helpers.kfac(verbose=True).setup(model)
    reports = []
    for _ in range(3):
        reporter = chainer.Reporter()
        with reporter.scope(reporter.observation):
            with caplog.at_level(logging.INFO, logger='chainerkfac'):
                optimizer.update(helpers.loss_of(model), x, t)
        reports.append(dict(reporter.observation))
    warned = [r.getMessage() for r in caplog.records
              if 'not captured' in r.getMessage()]
    assert len(warned) == 1 and '/unused' in warned[0], warned
    assert 'no backward pass ran through it' in warned[0]
    # Said as it is: no gradient, no update (it said "the plain gradient").
    assert 'is not updated while it has no gradient' in warned[0]
    assert 'plain gradient' not in warned[0]
    numpy.testing.assert_array_equal(model.unused.W.array, unused)
    # The registration table comes before the warning about its links.
    messages = [r.getMessage() for r in caplog.records]
    assert any('K-FAC registration' in m
               for m in messages[:messages.index(warned[0])]), messages
    for report in reports:
        assert report['kfac/preconditioned_blocks'] == 2.0
        assert report['kfac/plain_blocks'] == 1.0


def test_a_block_captured_later_is_counted_once_refreshed():
    model = WithHead()
    x, t = helpers.data(n=6, shape=(5,), n_class=3)
    optimizer = helpers.kfac().setup(model)
    optimizer.update(helpers.loss_of(model), x, t)
    reporter = chainer.Reporter()
    with reporter.scope(reporter.observation):
        model.cleargrads()
        loss = helpers.loss_of(model)(x, t) + F.mean(
            model.unused(F.relu(model.body(x))))
        loss.backward()
        optimizer.update()
    assert reporter.observation['kfac/preconditioned_blocks'] == 3.0
    assert helpers.block_named(optimizer, '/unused').has_inverses()


# -- summed losses ------------------------------------------------------------------
def test_summed_loss_in_a_manual_loop_is_refused_at_update():
    model = helpers.MLP()
    x, t = helpers.data(n=4, shape=(5,), n_class=3)
    optimizer = helpers.kfac().setup(model)
    F.sum(F.softmax_cross_entropy(model(x), t, reduce='no')).backward()
    with pytest.raises(ValueError, match="loss_reduction='sum'"):
        optimizer.update()


def test_a_summed_pass_that_the_update_does_not_use_is_fine():
    # E.g. input gradients of a summed score, then the loss of the update.
    model = helpers.MLP()
    x, t = helpers.data(n=4, shape=(5,), n_class=3)
    optimizer = helpers.kfac().setup(model)
    x_var = chainer.Variable(x)
    F.sum(model(x_var)).backward()
    model.cleargrads()
    helpers.loss_of(model)(x, t).backward()
    optimizer.update()
    assert optimizer.t == 1


# -- the hook's life ----------------------------------------------------------------
def test_two_optimizers_coexist_and_a_dropped_one_leaves_no_hook():
    before = set(chainer.get_function_hooks())
    a, b = helpers.MLP(), helpers.MLP()
    opt_a = helpers.kfac().setup(a)
    opt_b = helpers.kfac().setup(b)
    hooks = set(chainer.get_function_hooks()) - before
    assert len(hooks) == 2
    x, t = helpers.data(n=4, shape=(5,), n_class=3)
    opt_a.update(helpers.loss_of(a), x, t)
    opt_b.update(helpers.loss_of(b), x, t)
    del opt_a, opt_b
    gc.collect()
    helpers.kfac().setup(helpers.MLP())   # an install purges dead hooks
    assert len(set(chainer.get_function_hooks()) - before) == 1


def test_a_stale_step_runs_without_the_hook():
    model = helpers.MLP()
    x, t = helpers.data(n=4, shape=(5,), n_class=3)
    optimizer = helpers.kfac(refresh_interval_a=3, refresh_interval_g=3,
                             refresh_interval_f=3).setup(model)
    name = optimizer.estimator._capture.name
    installed = []
    for _ in range(4):
        installed.append(name in chainer.get_function_hooks())
        optimizer.update(helpers.loss_of(model), x, t)
    # Steps 0 and 3 refresh; 1 and 2 capture nothing.
    assert installed == [True, False, False, True]


# -- ChainerMN's double-buffering wrapper ------------------------------------------
def test_chainermn_double_buffering_is_refused_with_the_reason():
    optimizers = pytest.importorskip('chainermn.optimizers')

    class DoubleBuffering(optimizers._DoubleBufferingOptimizer):
        """Calls ``KFAC.update()`` as ChainerMN's double-buffering wrapper
        does (its real ``__init__`` needs a GPU stream)."""

        def __init__(self, actual):
            object.__setattr__(self, 'actual_optimizer', actual)

        def update(self):
            self.actual_optimizer.update(None)

    model = helpers.MLP()
    kfac = helpers.kfac().setup(model)
    x, t = helpers.data(n=4, shape=(5,), n_class=3)
    helpers.loss_of(model)(x, t).backward()
    with pytest.raises(ValueError, match='double_buffering=False'):
        DoubleBuffering(kfac).update()


# -- the logits of the Fisher passes ------------------------------------------------
@pytest.mark.parametrize('fisher', ['mc', 'exact'])
@pytest.mark.parametrize('extra', ['test mode', 'no_backprop_mode'])
def test_the_fisher_passes_take_the_logits_the_loss_comes_from(fisher,
                                                               extra):
    """A loss function that also runs another forward pass of the model
    (a validation batch, after its loss): fisher='mc' / 'exact' draw from
    the loss's own logits, so the steps are those of the loss function
    without it. They drew from the last call (the other batch's logits),
    or, under no_backprop_mode, said the loss applied no logits function."""
    x, t = helpers.data(n=6, shape=(5,), n_class=3)
    other = helpers.data(n=10, shape=(5,), n_class=3, seed=1)[0]
    base = helpers.MLP()
    trained = []
    for with_extra in (False, True):
        model = base.copy(mode='copy')
        classifier = L.Classifier(model)
        optimizer = helpers.kfac(fisher=fisher, seed=3).setup(classifier)

        def loss(x, t, classifier=classifier, with_extra=with_extra):
            value = classifier(x, t)
            if with_extra:
                scope = (chainer.no_backprop_mode() if extra ==
                         'no_backprop_mode' else
                         chainer.using_config('train', False))
                with scope:
                    classifier(other, numpy.zeros(10, numpy.int32))
            return value
        for _ in range(3):
            optimizer.update(loss, x, t)
        trained.append(model)
    for a, b in zip(trained[0].params(), trained[1].params()):
        numpy.testing.assert_array_equal(a.array, b.array)


def test_an_empty_micro_batch_captures_nothing_and_warns_nothing(caplog):
    """A refresh step on an empty micro-batch (a process's share of an
    epoch's end) raised ``cannot reshape array of size 0 into shape
    (0,newaxis)`` in the capture; a stale step took it. Now it captures
    nothing: the factors keep their values and stay due (refreshed at the
    next step with samples), no 'due but not captured' warning, weights
    finite; as the same run with the empty step left out but for eq. 13's
    term (lr 0 there; momentum 0)."""
    x, t = helpers.data(n=4, shape=(5,), n_class=3)

    def run(empty):
        numpy.random.seed(0)
        model = helpers.MLP()
        optimizer = helpers.kfac(momentum=0.0)
        optimizer.setup(model)

        def lossfun(x, t):
            y = model(x)
            return F.mean(F.sum(y * y, axis=1)) if len(x) else F.sum(y) * 0
        optimizer.update(lossfun, x, t)
        if empty:
            optimizer.lr = 0.0
            optimizer.update(lossfun, x[:0], t[:0])
            assert {b.name: b.inverse_count['A'] for b in optimizer.blocks} \
                == {'/l1': 1, '/l2': 1}
            optimizer.lr = 0.01
        optimizer.update(lossfun, x, t)
        return model, optimizer

    with caplog.at_level(logging.WARNING, logger='chainerkfac'):
        model, optimizer = run(empty=True)
    assert 'not captured' not in caplog.text
    assert {b.name: b.inverse_count['A'] for b in optimizer.blocks} == {
        '/l1': 2, '/l2': 2}
    reference, _ = run(empty=False)
    for (name, got), (_, expected) in zip(sorted(model.namedparams()),
                                          sorted(reference.namedparams())):
        assert numpy.isfinite(got.array).all()
        numpy.testing.assert_allclose(got.array, expected.array, rtol=1e-12,
                                      atol=1e-14, err_msg=name)


@pytest.mark.parametrize('reduction', ['mean', 'sum'])
def test_an_empty_micro_batch_inside_an_accumulation_adds_nothing(
        reduction):
    """Micro-batches of 8, 0 and 8 samples (acc_iters=3) step as 8 and 8
    (acc_iters=2): the empty one counted in the mean's average (a step
    0.663x as long), and with loss_reduction='sum' it raised 'the loss
    called none'."""
    x, t = helpers.data(n=16, shape=(5,), n_class=3)

    def run(parts):
        numpy.random.seed(0)
        model = helpers.MLP()
        optimizer = helpers.kfac(lr=0.05, momentum=0.0,
                                 acc_iters=len(parts),
                                 loss_reduction=reduction).setup(model)

        def loss(x, t):
            per = -F.select_item(F.log_softmax(model(x)), t)
            return F.sum(per) if reduction == 'sum' else \
                F.sum(per) / max(len(t), 1)
        for a, b in parts:
            optimizer.update(loss, x[a:b], t[a:b])
        return model
    got = run([(0, 8), (8, 8), (8, 16)])
    expected = run([(0, 8), (8, 16)])
    for (name, a), (_, b) in zip(sorted(got.namedparams()),
                                 sorted(expected.namedparams())):
        numpy.testing.assert_allclose(a.array, b.array, rtol=1e-13,
                                      atol=1e-15, err_msg=name)
