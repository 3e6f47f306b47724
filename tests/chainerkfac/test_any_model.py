"""K-FAC swapped into models written without it in mind: every stock link
type, links not called, BN-free models, sum losses, stock training scripts."""
import io
import re
import tempfile

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import training
from chainer.training import extensions

import chainerkfac
from tests.chainerkfac import helpers
# Chainer's MNIST example network (examples/mnist/train_mnist.py).
from tests.chainerkfac.stock.nets import MLP as StockMLP


def weights(model):
    return {n: p.array.copy() for n, p in model.namedparams()}


def assert_moved(after, before):
    """Every parameter changed (runs compared with each other must not both
    have done nothing): by 0.08 or more in these tests' steps."""
    for name in before:
        assert numpy.abs(after[name] - before[name]).max() > 1e-3, name


def test_lr_zero_leaves_a_bn_free_model_bit_identical():
    x = numpy.random.RandomState(0).rand(8, 12).astype(numpy.float32)
    t = numpy.arange(8, dtype=numpy.int32) % 3
    model = L.Classifier(StockMLP(10, 3))
    model(x, t)                       # materialise the lazy links
    before = weights(model)
    optimizer = chainerkfac.optimizers.KFAC(lr=0, momentum=0, verbose=False)
    optimizer.setup(model)
    for _ in range(3):
        optimizer.update(model, x, t)
    assert optimizer.rescaled_params() == []
    for name, value in weights(model).items():
        numpy.testing.assert_array_equal(value, before[name], name)
    # The paper's rule (every FC rescaled) changes this model at lr = 0.
    paper = L.Classifier(StockMLP(10, 3))
    paper(x, t)
    start = weights(paper)
    chainerkfac.optimizers.KFAC(lr=0, momentum=0, weight_rescale=True,
                                verbose=False).setup(paper).update(paper, x, t)
    assert not numpy.array_equal(paper.predictor.l1.W.array,
                                 start['/predictor/l1/W'])


class ConvBN(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(2, 4, 3, pad=1)
            self.bn = L.BatchNormalization(4)
            self.fc = L.Linear(4 * 5 * 5, 3)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))))


@pytest.mark.parametrize('modes', [(True,), (False,), (False, False, True)],
                         ids=['train', 'test', 'test-then-train'])
def test_eq20_auto_rescales_only_behind_batch_statistics(modes):
    """'auto' rescales a convolution followed by BatchNormalization in
    train mode (batch statistics remove W's scale). In test mode (running
    statistics: a frozen-BN fine-tuning) they do not, and a step at lr = 0
    must leave the network's function as it was: the conv's W was
    rescaled to √8 and the output moved by 0.62. Steps in test mode first
    (a frozen-BN warm-up) leave the decision to the first step in train
    mode (it was decided, for good, from the first step)."""
    rng = numpy.random.RandomState(0)
    x = rng.randn(8, 2, 5, 5).astype(numpy.float32)
    t = rng.randint(0, 3, 8).astype(numpy.int32)
    model = L.Classifier(ConvBN())
    for _ in range(5):                # running statistics of a trained net
        model.predictor(x)
    before = weights(model)
    optimizer = chainerkfac.optimizers.KFAC(lr=0, momentum=0, verbose=False)
    optimizer.setup(model)
    for train in modes:
        with chainer.using_config('train', train):
            optimizer.update(model, x, t)
    if train:
        assert optimizer.rescaled_params() == ['/predictor/conv/W']
        numpy.testing.assert_allclose(
            numpy.linalg.norm(model.predictor.conv.W.array), numpy.sqrt(8),
            rtol=1e-6)
        return
    assert optimizer.rescaled_params() == []
    for name, value in weights(model).items():
        numpy.testing.assert_array_equal(value, before[name], name)


class EveryLink(chainer.Chain):
    """One of each kind of link a stock Chainer model may contain."""

    def __init__(self):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.conv = L.Convolution2D(2, 4, 3, pad=1)
            self.bn = L.BatchNormalization(4)
            self.grouped = L.Convolution2D(4, 4, 3, pad=1, groups=2)
            self.renorm = L.BatchRenormalization(4)
            self.no_gamma = L.BatchNormalization(4, use_gamma=False)
            self.deconv = L.Deconvolution2D(4, 2, 3, pad=1)
            self.depthwise = L.DepthwiseConvolution2D(2, 2, 3, pad=1)
            self.layer_norm = L.LayerNormalization(4 * 5 * 5)
            self.prelu = L.PReLU()
            self.embed = L.EmbedID(3, 4 * 5 * 5)
            self.fc = L.Linear(4 * 5 * 5, 3)
            self.branch = L.Linear(4 * 5 * 5, 3)   # every other step
            self.unused = L.Linear(4 * 5 * 5, 3)   # never called

    def forward(self, x, t, step):
        h = F.relu(self.bn(self.conv(x)))
        h = self.renorm(self.grouped(h))
        h = self.no_gamma(h)
        h = self.depthwise(self.deconv(h))      # 2 -> 4 channels
        h = F.reshape(h, (len(x), -1))
        h = self.prelu(self.layer_norm(h)) + self.embed(t % 3)
        y = self.fc(h)
        if step % 2 == 0:
            y = y + self.branch(h)
        return F.softmax_cross_entropy(y, t)


def test_every_stock_link_type_trains_and_says_what_it_got(caplog):
    caplog.set_level('INFO', logger='chainerkfac')
    model = EveryLink()
    rng = numpy.random.RandomState(0)
    x, t = rng.randn(6, 2, 5, 5), rng.randint(0, 3, 6).astype(numpy.int32)
    # Every step refreshed (the bookkeeping below counts the calls).
    optimizer = chainerkfac.optimizers.KFAC(
        lr=0.05, damping=1e-2, refresh_interval_a=1, refresh_interval_g=1,
        refresh_interval_f=1)
    optimizer.setup(model)
    unused_before = model.unused.W.array.copy()
    for step in range(5):
        optimizer.update(model, x, t, step)
    assert optimizer.t == 5
    for name, param in model.namedparams():
        assert numpy.isfinite(param.array).all(), name
    numpy.testing.assert_array_equal(model.unused.W.array, unused_before)
    table = caplog.text
    rows = {line.split()[0]: line for line in table.splitlines()
            if line.startswith('/')}
    assert 'Conv2D (K-FAC)' in rows['/conv']
    assert 'BN (full Fisher)' in rows['/bn']
    assert 'Linear (K-FAC)' in rows['/fc']
    expected_reasons = {
        '/grouped': 'grouped convolution (groups=2)',
        '/renorm': 'batch renormalization',
        '/no_gamma': 'without gamma',
        '/deconv': 'no Fisher block for Deconvolution2D',
        '/depthwise': 'no Fisher block for DepthwiseConvolution2D',
        '/layer_norm': 'no Fisher block for LayerNormalization',
        '/prelu': 'no Fisher block for PReLU',
        '/embed': 'no Fisher block for EmbedID',
    }
    for name, reason in expected_reasons.items():
        assert 'plain gradient' in rows[name] and reason in rows[name], \
            rows[name]
    # conv feeds BN (rescaled); grouped feeds BatchRenormalization (not a
    # BN: not rescaled); the classifiers feed the loss.
    assert re.search(r'\byes\b', rows['/conv'])
    for name in ('/grouped', '/fc', '/branch', '/unused'):
        assert re.search(r'\bno\b', rows[name]), rows[name]
    # The branch is refreshed on the steps that call it only.
    branch = helpers.block_named(optimizer, '/branch')
    assert branch.refresh_count == {'A': 3, 'G': 3}
    assert branch.last_refresh == {'A': 4, 'G': 4}
    unused = helpers.block_named(optimizer, '/unused')
    assert unused.refresh_count == {'A': 0, 'G': 0} and not unused.factors


def test_a_due_factor_of_a_link_not_called_stays_due():
    """Stale interval 3: the branch misses its refresh at step 3 (not
    called), keeps its inverse, and is refreshed at step 4 when called."""
    model = EveryLink()
    rng = numpy.random.RandomState(1)
    x, t = rng.randn(4, 2, 5, 5), rng.randint(0, 3, 4).astype(numpy.int32)
    optimizer = chainerkfac.optimizers.KFAC(
        lr=0.05, damping=1e-2, refresh_interval_a=3, refresh_interval_g=3,
        verbose=False).setup(model)
    branch = helpers.block_named(optimizer, '/branch')
    inverse_a = lambda: helpers.dense(branch.inverses['A'])  # NOQA
    fc = helpers.block_named(optimizer, '/fc')
    for step in range(4):
        optimizer.update(model, x, t, step)
    kept = inverse_a().copy()
    assert branch.last_refresh['A'] == 0 and fc.last_refresh['A'] == 3
    optimizer.update(model, x, t, 4)
    assert branch.last_refresh['A'] == 4 and branch.refresh_count['A'] == 2
    assert not numpy.array_equal(inverse_a(), kept)


@pytest.mark.parametrize('skip,conv_skipped', [
    (['/fc'], False), ('fc', False), ([re.compile(r'/(fc|conv)')], True),
    (['.*c'], False), ([L.Linear], False), ([L.Linear, 'conv'], True)])
def test_skip_layers_by_name_regex_and_class(skip, conv_skipped):
    model = helpers.ConvNet(bn=True)
    x, t = helpers.data(n=6)
    optimizer = helpers.kfac(lr=0.1, momentum=0.0, skip_layers=skip)
    optimizer.setup(model)
    block = helpers.block_named(optimizer, '/fc')
    assert not block.factor_names and 'skip_layers' in block.note
    conv = helpers.block_named(optimizer, '/conv')
    assert bool(conv.factor_names) != conv_skipped
    assert helpers.block_named(optimizer, '/bn').factor_names
    # The skipped layer's step is the plain gradient (eq. 19, m = 0).
    before = model.fc.W.array.copy()
    model.cleargrads()
    F.softmax_cross_entropy(model(x), t).backward()
    grad = model.fc.W.grad.copy()
    optimizer.update(helpers.loss_of(model), x, t)
    numpy.testing.assert_allclose(model.fc.W.array, before - 0.1 * grad,
                                  rtol=1e-12)


def test_skip_layers_matching_nothing_warns():
    with pytest.warns(UserWarning, match='matches no link'):
        helpers.kfac(skip_layers=['/nope']).setup(helpers.MLP())
    with pytest.raises(TypeError, match='skip_layers'):
        helpers.kfac(skip_layers=[3])


# -- a user's own block, registered from outside the package -----------------
class GainFunction(chainer.FunctionNode):
    """y = x * g with g of shape (C,), g the second input."""

    def forward(self, inputs):
        self.retain_inputs((0, 1))
        x, g = inputs
        return x * g,

    def backward(self, indexes, grad_outputs):
        x, g = self.get_retained_inputs()
        gy, = grad_outputs
        return gy * F.broadcast_to(g, gy.shape), F.sum(gy * x, axis=0)


class Gain(chainer.Link):
    def __init__(self, size):
        super().__init__()
        with self.init_scope():
            self.g = chainer.Parameter(
                numpy.linspace(0.5, 1.5, size), (size,))

    def forward(self, x):
        return GainFunction().apply((x, self.g))[0]


class GainBlock(chainerkfac.FisherBlock):
    """Diagonal empirical Fisher of the per-sample gradients of g."""

    kind = 'Gain (diagonal)'
    factor_kinds = {'D': chainerkfac.FactorKind.PARAM_GRADS}
    function_types = (GainFunction,)

    @property
    def params(self):
        return [self.link.g]

    def factor_shapes(self):
        return {'D': self.link.g.shape}

    def capture_gradients(self, function, in_data, out_grad):
        x, gy = in_data[0], out_grad[0]
        n = len(x)
        # Per-sample gradient of g for a batch-mean loss: N * gy_n * x_n.
        self._accumulate('D', ((n * gy * x) ** 2).mean(axis=0))

    def inverse_requests(self, candidates, damping):
        return {name: (value, damping) for name, value in candidates.items()}

    def precondition(self, grads, damping):
        direction = chainerkfac.fisher_blocks.regularized_grad(
            grads[0], self.link.g.array, damping)
        if self.has_inverses():
            direction = direction * self.inverses['D']
        return [direction]


class GainNet(chainer.Chain):
    def __init__(self):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.l1 = L.Linear(4, 5)
            self.gain = Gain(5)
            self.l2 = L.Linear(5, 3)

    def forward(self, x):
        return self.l2(F.tanh(self.gain(self.l1(x))))


@pytest.fixture
def gain_registered():
    from chainerkfac.fisher_blocks import registry
    saved = dict(registry._REGISTRY)
    chainerkfac.register_block(Gain, GainBlock)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


def test_custom_block_changes_the_direction_as_its_oracle(gain_registered):
    model = GainNet()
    rng = numpy.random.RandomState(3)
    x, t = rng.randn(7, 4), rng.randint(0, 3, 7).astype(numpy.int32)
    damping = 1e-2
    optimizer = helpers.kfac(lr=1.0, momentum=0.0, damping=damping)
    optimizer.setup(model)
    assert helpers.block_named(optimizer, '/gain').kind == 'Gain (diagonal)'
    expected = helpers.diagonal_fisher_step(model, model.gain.g, x, t,
                                            damping)
    optimizer.update(helpers.loss_of(model), x, t)
    numpy.testing.assert_allclose(model.gain.g.array, expected, rtol=1e-10)


def test_custom_factor_follows_the_interval_of_its_kind(gain_registered):
    model = GainNet()
    rng = numpy.random.RandomState(4)
    x, t = rng.randn(5, 4), rng.randint(0, 3, 5).astype(numpy.int32)
    optimizer = helpers.kfac(refresh_interval_a=1, refresh_interval_g=1,
                             refresh_interval_f=3).setup(model)
    for _ in range(4):
        optimizer.update(helpers.loss_of(model), x, t)
    # PARAM_GRADS factors are scheduled by refresh_interval_f: 0 and 3.
    assert helpers.block_named(optimizer, '/gain').refresh_count == {'D': 2}
    assert helpers.block_named(optimizer, '/l1').refresh_count == \
        {'A': 4, 'G': 4}


class Dense(chainer.Link):
    """A user's own fully connected link (not a chainer.links.Linear)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        with self.init_scope():
            self.W = chainer.Parameter(
                numpy.random.RandomState(n_in).randn(n_out, n_in), None)
            self.b = chainer.Parameter(numpy.zeros(n_out), None)
        self.out_size = n_out

    def forward(self, x):
        return F.linear(x, self.W, self.b)


class DenseBlock(chainerkfac.fisher_blocks.LinearBlock):
    """The Linear block registered for Dense: its rescaled weight and
    output size come with it (the registry is their one home)."""

    kind = 'Dense (K-FAC)'


class DenseBNNet(chainer.Chain):
    def __init__(self):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.d1 = Dense(4, 6)
            self.bn = L.BatchNormalization(6)
            self.d2 = Dense(6, 3)

    def forward(self, x):
        return self.d2(F.relu(self.bn(self.d1(x))))


@pytest.mark.parametrize('mode, rescaled', [
    ('auto', ['/d1/W']), (True, ['/d1/W', '/d2/W']), (False, [])])
def test_a_registered_block_gets_eq20_from_its_declaration(mode, rescaled):
    from chainerkfac.fisher_blocks import registry
    saved = dict(registry._REGISTRY)
    chainerkfac.register_block(Dense, DenseBlock)
    try:
        model = DenseBNNet()
        optimizer = helpers.kfac(weight_rescale=mode).setup(model)
        x, t = helpers.data(n=5, shape=(4,), n_class=3)
        optimizer.update(helpers.loss_of(model), x, t)
    finally:
        registry._REGISTRY.clear()
        registry._REGISTRY.update(saved)
    assert sorted(optimizer.rescaled_params()) == rescaled
    for name in rescaled:
        weight = dict(model.namedparams())[name].array
        d_out = weight.shape[0]
        numpy.testing.assert_allclose(numpy.linalg.norm(weight),
                                      numpy.sqrt(2.0 * d_out), rtol=1e-8)


def test_register_block_checks_its_arguments():
    with pytest.raises(TypeError, match='link class'):
        chainerkfac.register_block('Linear', GainBlock)
    with pytest.raises(TypeError, match='not callable'):
        chainerkfac.register_block(Gain, 3)


# -- loss reduction ------------------------------------------------------------
def test_a_summed_loss_is_refused_with_the_fix():
    model = helpers.MLP()
    x, t = numpy.random.RandomState(0).randn(4, 5), \
        numpy.array([0, 1, 2, 0], numpy.int32)
    optimizer = helpers.kfac().setup(model)

    def summed(x, t):
        return F.sum(F.softmax_cross_entropy(model(x), t, reduce='no'))
    with pytest.raises(ValueError, match="loss_reduction='sum'"):
        optimizer.update(summed, x, t)


def _assert_same_steps(loss_of, variants, manual, x, t):
    """One MLP's copies trained 3 steps by K-FAC, one per variant of the
    loss (``loss_of(model, variant)``): the same weights to 1e-12."""
    base = helpers.MLP()
    trained = []
    for variant in variants:
        model = base.copy(mode='copy')
        optimizer = helpers.kfac(lr=0.1, momentum=0.9).setup(model)
        for _ in range(3):
            helpers.update(optimizer, model, loss_of(model, variant), x, t,
                           manual)
        trained.append(model)
    for a, b in zip(trained[0].params(), trained[1].params()):
        numpy.testing.assert_allclose(a.array, b.array, rtol=0, atol=1e-12)


@pytest.mark.parametrize('manual', [False, True])
def test_a_sum_over_time_steps_of_batch_means_is_a_mean(manual):
    """F.sum of the stacked batch means of T time steps (T not the batch's
    size) sums no batch: it steps as the same loss written as a Python
    sum (it was refused as a sum over the batch, and its advice gave
    another step). T equal to the batch's size is still refused (the
    check cannot tell), with the way out in the message."""
    x, t = helpers.data(n=4, shape=(5,), n_class=3)

    def loss_of(model, stacked, steps=3):
        def loss(x, t):
            terms = [F.softmax_cross_entropy(model(x * (1 + 0.1 * k)), t)
                     for k in range(steps)]
            return F.sum(F.stack(terms)) if stacked else sum(terms)
        return loss
    _assert_same_steps(loss_of, (False, True), manual, x, t)
    model = helpers.MLP()
    optimizer = helpers.kfac().setup(model)

    def four_steps(x, t):
        return F.sum(F.stack([F.softmax_cross_entropy(model(x), t)] * 4))
    with pytest.raises(ValueError, match='Python sum'):
        helpers.update(optimizer, model, four_steps, x, t, manual)


@pytest.mark.parametrize('manual', [False, True])
def test_the_double_backprop_cross_entropy_is_a_mean(manual):
    """softmax_cross_entropy(..., enable_double_backprop=True), which
    Chainer needs for a gradient penalty, is the batch mean written as
    F.sum(x / n): K-FAC steps as with the plain loss (it refused it as a
    sum, and its advice, loss_reduction='sum', gave other steps). A sum
    scaled by another constant is still refused."""
    x, t = helpers.data(n=6, shape=(5,), n_class=3)

    def loss_of(model, double):
        return lambda x, t: F.softmax_cross_entropy(
            model(x), t, enable_double_backprop=double)
    _assert_same_steps(loss_of, (False, True), manual, x, t)
    model = helpers.MLP()
    optimizer = helpers.kfac().setup(model)

    def half_sum(x, t):
        return F.sum(0.5 * F.softmax_cross_entropy(model(x), t,
                                                   reduce='no'))
    with pytest.raises(ValueError, match="loss_reduction='sum'"):
        optimizer.update(half_sum, x, t)


def test_a_constant_of_the_loss_equal_to_a_later_batch_is_no_sum():
    """``2 * loss`` and a squared error over D outputs times D are means:
    a batch of 2 (an epoch's last), or of D, made them look like a mean
    times the batch's length (refused mid-run, in a reviewer's test);
    the scaled forms are checked at the run's first micro-batch only, and
    a mean over several values a sample is never taken for one."""
    x, t = helpers.data(n=10, shape=(5,), n_class=3)
    model = helpers.MLP(sizes=(5, 4, 3))
    optimizer = helpers.kfac().setup(model)

    def doubled(x, t):
        return 2 * F.softmax_cross_entropy(model(x), t)

    def squared(x, t):
        y = model(x)
        return F.mean_squared_error(y, numpy.zeros_like(y.array)) * 3
    optimizer.update(doubled, x[:8], t[:8])
    optimizer.update(doubled, x[8:], t[8:])          # a last batch of 2
    optimizer.update(squared, x[:3], t[:3])          # N = D = 3
    fresh = helpers.kfac().setup(helpers.MLP(sizes=(5, 4, 3)))
    fresh.update(lambda x, t: F.mean_squared_error(
        fresh.target(x), numpy.zeros((3, 3))) * 3, x[:3], t[:3])
    one = helpers.kfac().setup(helpers.MLP(sizes=(5, 4, 3)))
    one.update(lambda x, t: 1.0 * F.softmax_cross_entropy(
        one.target(x), t), x[:1], t[:1])


@pytest.mark.parametrize('written', ['F.sum', 'mean*N'])
@pytest.mark.parametrize('acc_iters', [1, 2])
def test_sum_reduction_steps_as_the_mean_loss(acc_iters, written):
    """A summed loss with ``loss_reduction='sum'`` steps as the mean loss,
    written ``F.sum(losses)`` or ``F.mean(losses) * N``; the latter was
    taken as a mean under the default (a step N times too long), and is
    now refused there as the sum it is."""
    x, t = helpers.data(n=8)
    base = helpers.ConvNet(bn=True)
    results = []

    def summed(per_sample):
        if written == 'F.sum':
            return F.sum(per_sample)
        return F.mean(per_sample) * len(per_sample)
    refused = helpers.kfac().setup(base.copy(mode='copy'))
    with pytest.raises(ValueError, match="batch mean times that length"):
        refused.update(lambda x, t: summed(F.softmax_cross_entropy(
            refused.target(x), t, reduce='no')), x, t)
    for reduction in ('mean', 'sum'):
        model = base.copy(mode='copy')
        optimizer = helpers.kfac(lr=0.05, momentum=0.9, acc_iters=acc_iters,
                                 loss_reduction=reduction,
                                 weight_rescale=True).setup(model)

        def loss(x, t):
            per_sample = F.softmax_cross_entropy(model(x), t, reduce='no')
            return summed(per_sample) if reduction == 'sum' \
                else F.mean(per_sample)
        for _ in range(3):
            for chunk in numpy.split(numpy.arange(8), acc_iters):
                optimizer.update(loss, x[chunk], t[chunk])
        results.append(weights(model))
    for name in results[0]:
        numpy.testing.assert_allclose(results[1][name], results[0][name],
                                      rtol=1e-10, atol=1e-13, err_msg=name)
    assert_moved(results[0], weights(base))


@pytest.mark.parametrize('manual', [False, True], ids=['lossfun', 'manual'])
@pytest.mark.parametrize('loss', ['sce', 'f.mean', 'mse', 'mae',
                                  'sum/N'])
def test_sum_reduction_refuses_a_batch_mean(loss, manual):
    """loss_reduction='sum' with a mean loss was taken silently (a step
    1.12x the sum loss's in a stranger's run); the reverse was refused.
    ``mean_absolute_error`` and ``F.sum(losses) / N`` were still taken (G
    1/N² of the right one, the step 52 % and 83 % off in an auditor's
    run). A mean over something else than the batch (time steps), and a
    sum divided by another count, pass."""
    x, t = helpers.data(n=8)
    model = helpers.ConvNet(bn=True)
    optimizer = helpers.kfac(loss_reduction='sum').setup(model)

    def lossfun(x, t):
        y = model(x)
        if loss == 'sce':
            return F.softmax_cross_entropy(y, t)
        if loss == 'f.mean':
            return F.mean(F.softmax_cross_entropy(y, t, reduce='no'))
        if loss == 'mae':
            return F.mean_absolute_error(y, numpy.zeros_like(y.array))
        if loss == 'sum/N':
            return F.sum(F.softmax_cross_entropy(y, t, reduce='no')) / len(t)
        return F.mean_squared_error(y, numpy.zeros_like(y.array))
    name = {'sce': 'SoftmaxCrossEntropy', 'f.mean': 'Mean',
            'mse': 'MeanSquaredError', 'mae': 'MeanAbsoluteError',
            'sum/N': 'MulConstant'}[loss]
    with pytest.raises(ValueError, match=r"loss_reduction='sum'.*batch "
                       r"mean \(its last operation is {}\)".format(name)):
        helpers.update(optimizer, model, lossfun, x, t, manual)

    def over_time(x, t):
        steps = [F.sum(F.softmax_cross_entropy(model(x), t, reduce='no'))
                 for _ in range(3)]
        return F.mean(F.stack(steps))
    helpers.update(optimizer, model, over_time, x, t, manual)

    def halved(x, t):
        return F.sum(F.softmax_cross_entropy(model(x), t, reduce='no')) / 2
    helpers.update(optimizer, model, halved, x, t, manual)


# -- a stock training script ------------------------------------------------------
def _train_stock_mlp(make_optimizer, epochs=10):
    """Chainer's MNIST example script on the digits; only the optimizer line
    varies. Returns per-epoch (validation loss, validation accuracy)."""
    from sklearn.datasets import load_digits
    digits = load_digits()
    x = (digits.data / 16.0).astype(numpy.float32)
    t = digits.target.astype(numpy.int32)
    order = numpy.random.RandomState(0).permutation(len(t))
    train = chainer.datasets.TupleDataset(x[order[:1000]], t[order[:1000]])
    test = chainer.datasets.TupleDataset(x[order[1000:]], t[order[1000:]])
    numpy.random.seed(0)
    model = L.Classifier(StockMLP(100, 10))
    optimizer = make_optimizer()                          # <- the one line
    optimizer.setup(model)
    train_iter = chainer.iterators.SerialIterator(train, 100)
    test_iter = chainer.iterators.SerialIterator(test, 100, repeat=False,
                                                 shuffle=False)
    updater = training.updaters.StandardUpdater(train_iter, optimizer)
    with tempfile.TemporaryDirectory() as out:
        trainer = training.Trainer(updater, (epochs, 'epoch'), out=out)
        trainer.extend(extensions.Evaluator(test_iter, model))
        log = extensions.LogReport(trigger=(1, 'epoch'))
        trainer.extend(log)
        trainer.run()
    return [(e['validation/main/loss'], e['validation/main/accuracy'])
            for e in log.log]


@pytest.mark.slow
def test_stock_mnist_mlp_with_the_readme_line():
    kfac = _train_stock_mlp(lambda: chainerkfac.optimizers.KFAC(
        lr=0.01, momentum=0.9, damping=1e-2, verbose=False))
    sgd = _train_stock_mlp(lambda: chainer.optimizers.MomentumSGD(
        lr=0.01, momentum=0.9))
    losses = [loss for loss, _ in kfac]
    assert losses[-1] <= 1.2 * min(losses), losses      # no divergence
    assert kfac[-1][1] >= sgd[-1][1], (kfac, sgd)


@pytest.mark.parametrize('low_rank', [False, True])
def test_snapshot_holds_factors_not_inverses(low_rank):
    model = helpers.ConvNet(bn=True)
    x, t = helpers.data(n=6)
    optimizer = helpers.kfac(lr=0.05, low_rank=low_rank).setup(model)
    optimizer.update(helpers.loss_of(model), x, t)
    buffer = io.BytesIO()
    chainer.serializers.save_npz(buffer, optimizer)
    buffer.seek(0)
    saved = numpy.load(buffer)
    keys = set(saved.files)
    assert {'kfac/conv/A', 'kfac/conv/G', 'kfac/bn/F', 'kfac/fc/A'} <= keys
    assert not [k for k in keys if k.endswith('_inv')]
    # Symmetric factors as upper triangles: n (n + 1) / 2 numbers; a
    # low-rank one (fc's A: 6 samples, 28 inputs) as its columns (n, k).
    n = helpers.block_named(optimizer, '/conv').factors['A'].shape[0]
    assert saved['kfac/conv/A'].shape == (n * (n + 1) // 2,)
    fc_a = helpers.block_named(optimizer, '/fc').factors['A']
    assert saved['kfac/fc/A'].shape == (
        (fc_a.dim, fc_a.rank) if low_rank else
        (fc_a.shape[0] * (fc_a.shape[0] + 1) // 2,))
    restored = helpers.kfac(lr=0.05, low_rank=low_rank).setup(
        model.copy(mode='copy'))
    buffer.seek(0)
    chainer.serializers.load_npz(buffer, restored)
    assert not helpers.block_named(restored, '/conv').inverses
    restored._start()
    for name in ('/conv', '/bn', '/fc'):
        mine = helpers.block_named(restored, name)
        theirs = helpers.block_named(optimizer, name)
        for factor in theirs.factor_names:
            numpy.testing.assert_array_equal(
                helpers.dense(mine.inverses[factor]),
                helpers.dense(theirs.inverses[factor]))


# The step's NaN goes through BN's forward on purpose.
@pytest.mark.filterwarnings('ignore:invalid value encountered:RuntimeWarning')
def test_skipped_non_finite_step_keeps_bn_running_statistics():
    model = helpers.ConvNet(bn=True)
    x, t = helpers.data(n=6)
    optimizer = helpers.kfac(lr=0.05).setup(model)
    optimizer.update(helpers.loss_of(model), x, t)
    mean, var = model.bn.avg_mean.copy(), model.bn.avg_var.copy()
    before = weights(model)
    x = x.copy()
    x[0, 0, 0, 0] = numpy.inf
    optimizer.update(helpers.loss_of(model), x, t)
    numpy.testing.assert_array_equal(model.bn.avg_mean, mean)
    numpy.testing.assert_array_equal(model.bn.avg_var, var)
    for name, value in weights(model).items():
        numpy.testing.assert_array_equal(value, before[name])


def test_flush_accumulation_takes_the_partial_step():
    x, t = helpers.data(n=8)
    base = helpers.ConvNet(bn=True)
    results = []
    for acc, flush in ((3, True), (2, False)):
        model = base.copy(mode='copy')
        optimizer = helpers.kfac(lr=0.05, momentum=0.9,
                                 acc_iters=acc).setup(model)
        for chunk in (slice(0, 4), slice(4, 8)):
            optimizer.update(helpers.loss_of(model), x[chunk], t[chunk])
        if flush:
            assert optimizer.t == 0
            assert optimizer.flush_accumulation() == 2
            assert optimizer.flush_accumulation() == 0
        assert optimizer.t == 1
        results.append(weights(model))
    for name in results[0]:
        numpy.testing.assert_array_equal(results[0][name], results[1][name])
    assert_moved(results[0], weights(base))
