"""Kronecker factors and BN Fisher against brute-force per-sample gradients
(one backward per sample, float64)."""
import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from tests.chainerkfac import helpers


def capture_factors(model, x, t, **kwargs):
    optimizer = helpers.kfac(lr=0.0, momentum=0.0, **kwargs)
    optimizer.setup(model)
    optimizer.update(helpers.loss_of(model), x, t)
    return optimizer


def per_sample_output_grads(model, layer_output, x, t):
    """∂l_n/∂y_n for every sample, one backward each (batch context kept)."""
    grads = []
    for n in range(len(x)):
        y = layer_output(x)
        logits = model.fc(F.relu(y) if not model.use_bn
                          else F.relu(model.bn(y)))
        loss_n = F.softmax_cross_entropy(logits, t, reduce='no')[n]
        model.cleargrads()
        loss_n.backward(retain_grad=True)
        grads.append(y.grad[n])
    return numpy.array(grads)


def patches(x, ksize, stride, pad, dilate):
    """im2col by explicit loops: rows (n, location), columns (c, i, j)."""
    (sy, sx), (ph, pw), (dy, dx) = stride, pad, dilate
    n, c, h, w = x.shape
    xp = numpy.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    eh, ew = dy * (ksize - 1) + 1, dx * (ksize - 1) + 1
    oh = (h + 2 * ph - eh) // sy + 1
    ow = (w + 2 * pw - ew) // sx + 1
    rows = numpy.zeros((n, oh * ow, c * ksize * ksize))
    for b in range(n):
        for i in range(oh):
            for j in range(ow):
                window = xp[b, :, i * sy:i * sy + eh:dy, j * sx:j * sx + ew:dx]
                rows[b, i * ow + j] = window.reshape(-1)
    return rows


def test_linear_factors_equal_per_sample_oracle():
    model = helpers.MLP()
    rng = numpy.random.RandomState(1)
    x, t = rng.randn(7, 5), rng.randint(0, 3, 7).astype(numpy.int32)
    optimizer = capture_factors(model, x, t)
    block = helpers.block_named(optimizer, '/l2')
    h = F.tanh(model.l1(x)).array
    a = numpy.concatenate([h, numpy.ones((7, 1))], axis=1)
    expected_a = a.T.dot(a) / 7
    gy = []
    for n in range(7):
        logits = model.l2(F.tanh(model.l1(x[n:n + 1])))
        model.cleargrads()
        F.softmax_cross_entropy(logits, t[n:n + 1]).backward(retain_grad=True)
        gy.append(logits.grad[0])
    gy = numpy.array(gy)
    numpy.testing.assert_allclose(block.factors['A'], expected_a, rtol=1e-10)
    numpy.testing.assert_allclose(block.factors['G'], gy.T.dot(gy) / 7,
                                  rtol=1e-10)


def test_kron_of_factors_is_exact_fisher_for_batch_one():
    model = helpers.MLP()
    rng = numpy.random.RandomState(2)
    x, t = rng.randn(1, 5), numpy.array([1], numpy.int32)
    optimizer = capture_factors(model, x, t)
    block = helpers.block_named(optimizer, '/l1')
    model.cleargrads()
    F.softmax_cross_entropy(model(x), t).backward()
    g = numpy.concatenate([model.l1.W.grad, model.l1.b.grad[:, None]],
                          axis=1).reshape(-1)
    numpy.testing.assert_allclose(
        numpy.kron(helpers.dense(block.factors['G']),
                   helpers.dense(block.factors['A'])), numpy.outer(g, g),
        rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize('stride,pad,dilate', [
    ((2, 2), (1, 1), (1, 1)),
    ((2, 1), (1, 0), (1, 1)),
    ((1, 1), (2, 2), (2, 2)),
])
def test_conv_factors_equal_per_sample_oracle(stride, pad, dilate):
    model = helpers.ConvNet(stride=stride, pad=pad, dilate=dilate, size=6)
    x, t = helpers.data(n=5, shape=(2, 6, 6))
    optimizer = capture_factors(model, x, t)
    block = helpers.block_named(optimizer, '/conv')
    rows = patches(x, 3, stride, pad, dilate)
    rows = numpy.concatenate([rows, numpy.ones(rows.shape[:2] + (1,))], 2)
    n, locations = rows.shape[:2]
    expected_a = numpy.einsum('nli,nlj->ij', rows, rows) / n
    gy = per_sample_output_grads(model, model.conv, x, t)  # (n, C, oh, ow)
    g = gy.transpose(0, 2, 3, 1).reshape(n * locations, -1)
    expected_g = g.T.dot(g) / (n * locations)
    numpy.testing.assert_allclose(block.factors['A'], expected_a, rtol=1e-10)
    numpy.testing.assert_allclose(block.factors['G'], expected_g, rtol=1e-10)


@pytest.mark.parametrize('mode', ['full', 'diag'])
def test_bn_fisher_equals_per_sample_oracle(mode):
    model = helpers.ConvNet(bn=True, bias=False)
    x, t = helpers.data(n=6)
    optimizer = capture_factors(model, x, t, bn_fisher=mode)
    block = helpers.block_named(optimizer, '/bn')
    per_sample = []
    for n in range(len(x)):
        model.cleargrads()
        logits = model(x)
        F.softmax_cross_entropy(logits, t, reduce='no')[n].backward()
        per_sample.append(numpy.concatenate([model.bn.gamma.grad,
                                             model.bn.beta.grad]))
    f = numpy.array(per_sample)
    full = f.T.dot(f) / len(x)
    expected = full if mode == 'full' else numpy.diag(full)
    numpy.testing.assert_allclose(block.factors['F'], expected, rtol=1e-9,
                                  atol=1e-14)


def test_diag_bn_is_diagonal_of_full():
    x, t = helpers.data(n=6)
    factors = {}
    for mode in ('full', 'diag'):
        numpy.random.seed(3)
        model = helpers.ConvNet(bn=True)
        optimizer = capture_factors(model, x, t, bn_fisher=mode)
        factors[mode] = helpers.block_named(optimizer, '/bn').factors['F']
    numpy.testing.assert_allclose(factors['diag'], numpy.diag(factors['full']),
                                  rtol=1e-12)


def test_link_called_twice_accumulates_both_calls():
    model = helpers.MLP(sizes=(3, 3, 3))
    rng = numpy.random.RandomState(4)
    x = rng.randn(4, 3)
    t = rng.randint(0, 3, 4).astype(numpy.int32)

    def lossfun(x, t):  # l1 applied twice (weight sharing)
        return F.softmax_cross_entropy(model.l2(model.l1(model.l1(x))), t)

    optimizer = helpers.kfac(lr=0.0, momentum=0.0)
    optimizer.setup(model)
    optimizer.update(lossfun, x, t)
    block = helpers.block_named(optimizer, '/l1')
    h = model.l1(x).array
    a1 = numpy.concatenate([x, numpy.ones((4, 1))], 1)
    a2 = numpy.concatenate([h, numpy.ones((4, 1))], 1)
    numpy.testing.assert_allclose(block.factors['A'],
                                  (a1.T.dot(a1) + a2.T.dot(a2)) / 4,
                                  rtol=1e-10)


def test_mc_fisher_uses_sampled_labels(monkeypatch):
    model = helpers.MLP()
    rng = numpy.random.RandomState(5)
    x, t = rng.randn(6, 5), rng.randint(0, 3, 6).astype(numpy.int32)
    optimizer = helpers.kfac(lr=0.0, momentum=0.0, fisher='mc', seed=0)
    optimizer.setup(model)
    drawn = []
    original = optimizer.label_sampler.sample

    def record(logits):
        labels = original(logits)
        drawn.append(labels)
        return labels

    monkeypatch.setattr(optimizer.label_sampler, "sample", record)
    optimizer.update(helpers.loss_of(model), x, t)
    labels = drawn[0]
    block = helpers.block_named(optimizer, '/l2')
    gy = []
    for n in range(6):
        logits = model(x[n:n + 1])
        model.cleargrads()
        F.softmax_cross_entropy(logits, labels[n:n + 1]).backward(
            retain_grad=True)
        gy.append(logits.grad[0])
    gy = numpy.array(gy)
    numpy.testing.assert_allclose(block.factors['G'], gy.T.dot(gy) / 6,
                                  rtol=1e-10)


def test_mc_label_sampler_follows_softmax():
    optimizer = helpers.kfac(fisher='mc', seed=1)
    logits = numpy.log(numpy.array([[0.7, 0.2, 0.1]] * 20000))
    labels = optimizer.label_sampler.sample(logits)
    freq = numpy.bincount(labels, minlength=3) / len(labels)
    numpy.testing.assert_allclose(freq, [0.7, 0.2, 0.1], atol=0.015)



def test_batched_preconditioning_equals_block_by_block():
    # Stage 5 on the GPU goes by groups of equal shapes
    # (kronecker.precondition_batch); here its NumPy run against each
    # block's own precondition, for bias / no bias and a diagonal factor.
    from chainerkfac.fisher_blocks import kronecker

    class Twins(chainer.Chain):
        def __init__(self):
            super().__init__()
            with helpers.float64_links(), self.init_scope():
                for i in range(3):
                    setattr(self, 'c{}'.format(i),
                            L.Convolution2D(2, 2, 3, pad=1, nobias=i == 2))
                for i in range(2):
                    setattr(self, 'fc{}'.format(i), L.Linear(18, 3))

        def forward(self, x):
            h = sum(getattr(self, 'c{}'.format(i))(x) for i in range(3))
            y = F.relu(h).reshape(len(x), -1)
            return self.fc0(y) + self.fc1(y)

    for max_factor_dim in (None, 10):
        model = Twins()
        # Dense inverses: the batch is of dense ones (a low-rank inverse
        # is applied block by block).
        optimizer = helpers.kfac(max_factor_dim=max_factor_dim,
                                 low_rank=False).setup(model)
        x, t = helpers.data(n=5, shape=(2, 3, 3), n_class=3)
        optimizer.update(helpers.loss_of(model), x, t)
        groups = {}
        for block in optimizer.blocks:
            groups.setdefault(kronecker.batch_key(block), []).append(block)
        assert sorted(len(g) for g in groups.values()) == [1, 2, 2]
        rng = numpy.random.RandomState(0)
        for members in groups.values():
            if len(members) < 2:
                continue
            grads = [[rng.randn(*p.shape) for p in b.params]
                     for b in members]
            stack = kronecker.InverseStack()
            batched = kronecker.precondition_batch(members, grads, 0.01,
                                                   stack)
            assert stack.get(members) is stack.get(members)   # cached
            for block, grad, got in zip(members, grads, batched):
                expected = block.precondition(grad, 0.01)
                for a, b in zip(got, expected):
                    numpy.testing.assert_allclose(a, b, rtol=1e-12,
                                                  atol=1e-14)


class TwinBN(chainer.Chain):
    """Three BatchNormalizations of 3 channels and one of 4, float64."""

    def __init__(self):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.c0 = L.Convolution2D(2, 3, 3, pad=1)
            self.c1 = L.Convolution2D(3, 4, 3, pad=1)
            for i in range(3):
                setattr(self, 'bn{}'.format(i), L.BatchNormalization(3))
            self.bn3 = L.BatchNormalization(4)
            self.fc = L.Linear(36, 3)

    def forward(self, x):
        h = self.c0(x)
        h = F.relu(self.bn0(h)) + F.tanh(self.bn1(h)) + self.bn2(h * h)
        return self.fc(F.relu(self.bn3(self.c1(h))))


def test_batched_bn_preconditioning_equals_block_by_block():
    # The GPU's stage 5 also groups the full BN Fishers of equal sizes
    # (batch_norm.precondition_batch: a stacked matrix-vector product);
    # here its NumPy run against each block's own precondition. Diagonal
    # and low-rank Fishers are not batched.
    from chainerkfac.fisher_blocks import batch_norm, kronecker
    for options, batched_sizes, n in (({}, [1, 3], 5),
                                      ({'bn_fisher': 'diag'}, [], 5),
                                      ({'low_rank': True}, [], 2)):
        # 2 samples: every BN Fisher of rank 2 is low rank (Woodbury)
        x, t = helpers.data(n=n, shape=(2, 3, 3), n_class=3)
        model = TwinBN()
        optimizer = helpers.kfac(**dict(dict(low_rank=False), **options))
        optimizer.setup(model)
        optimizer.update(helpers.loss_of(model), x, t)
        bn = [b for b in optimizer.blocks
              if isinstance(b, batch_norm.BatchNormalizationBlock)]
        assert len(bn) == 4
        groups = {}
        for block in bn:
            key = batch_norm.batch_key(block)
            if key is not None:
                groups.setdefault(key, []).append(block)
        assert sorted(len(g) for g in groups.values()) == batched_sizes
        assert all(batch_norm.batch_key(b) is None for b in
                   optimizer.blocks if b not in bn)
        rng = numpy.random.RandomState(0)
        for members in groups.values():
            grads = [[rng.randn(*p.shape) for p in b.params]
                     for b in members]
            stack = kronecker.InverseStack(('F',))
            batched = batch_norm.precondition_batch(members, grads, 0.01,
                                                    stack)
            assert stack.get(members) is stack.get(members)   # cached
            for block, grad, got in zip(members, grads, batched):
                expected = block.precondition(grad, 0.01)
                assert [g.shape for g in got] == [(block.channels,)] * 2
                for a, b in zip(got, expected):
                    numpy.testing.assert_allclose(a, b, rtol=1e-12,
                                                  atol=1e-14)


@pytest.mark.parametrize('make, limit', [
    (lambda: helpers.ConvNet(stride=2, pad=1, bn=True), 10),
    (lambda: helpers.ConvNet(ksize=3, dilate=2, pad=2, bias=False), 3),
    (lambda: helpers.MLP(sizes=(5, 4, 3)), 4),
])
def test_diagonal_factors_are_the_diagonals_of_the_full_ones(make, limit):
    # max_factor_dim keeps a factor larger than the limit as its diagonal:
    # the same estimate's diagonal, the other factor unchanged.
    x, t = helpers.data(n=6, shape=(2, 5, 5) if 'Conv' in str(make())
                        else (5,), n_class=3)
    factors = []
    for max_factor_dim in (None, limit):
        numpy.random.seed(0)
        model = make()
        optimizer = helpers.kfac(max_factor_dim=max_factor_dim)
        optimizer.setup(model)
        optimizer.update(helpers.loss_of(model), x, t)
        factors.append({(b.name, n): helpers.dense(v)
                        for b in optimizer.blocks
                        for n, v in b.factors.items()})
    full, limited = factors
    diagonal = 0
    for key, value in limited.items():
        if value.ndim == 1 and full[key].ndim == 2:
            diagonal += 1
            assert full[key].shape[0] > limit, key
            numpy.testing.assert_allclose(value, numpy.diag(full[key]),
                                          rtol=1e-12, err_msg=str(key))
        else:
            assert full[key].shape == value.shape, key
            assert value.ndim == 1 or value.shape[0] <= limit or \
                full[key].ndim == 1, key
    assert diagonal >= 1
