"""Capture of the blocks through the optimizer, against float64 per-sample
gradients: BN after a Linear layer (2-D input), BN with a large mean, a
convolution through each way of forming A, fp16 factors."""
import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from chainerkfac.fisher_blocks import patches
from tests.chainerkfac import helpers


class LinearBN(chainer.Chain):
    """linear → BN → tanh → linear; float64."""

    def __init__(self, shift=0.0):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.l1 = L.Linear(5, 4)
            self.bn = L.BatchNormalization(4)
            self.l2 = L.Linear(4, 3)
        self.shift = shift

    def forward(self, x):
        return self.l2(F.tanh(self.bn(self.l1(x) + self.shift)))


def bn_oracle(model, x, t):
    """(1/N) Σ f fᵀ over per-sample gradients f of (γ, β), one backward
    per sample in the batch context."""
    rows = []
    for n in range(len(x)):
        model.cleargrads()
        F.softmax_cross_entropy(model(x), t, reduce='no')[n].backward()
        rows.append(numpy.concatenate([model.bn.gamma.grad,
                                       model.bn.beta.grad]))
    rows = numpy.array(rows)
    return rows.T.dot(rows) / len(x)


@pytest.mark.parametrize('mode', ['full', 'diag'])
@pytest.mark.parametrize('shift', [0.0, 50.0])
def test_bn_fisher_of_2d_input_equals_per_sample_oracle(mode, shift):
    model = LinearBN(shift)
    rng = numpy.random.RandomState(0)
    x, t = rng.randn(7, 5), rng.randint(0, 3, 7).astype(numpy.int32)
    optimizer = helpers.kfac(lr=0.0, momentum=0.0, bn_fisher=mode)
    optimizer.setup(model)
    optimizer.update(helpers.loss_of(model), x, t)
    expected = bn_oracle(model, x, t)
    if mode == 'diag':
        expected = numpy.diag(expected)
    numpy.testing.assert_allclose(
        helpers.block_named(optimizer, '/bn').factors['F'], expected,
        rtol=1e-9, atol=1e-14)


class ConvBN(chainer.Chain):
    """3x3 stride-1 padded convolution (bias) → BN → relu → linear."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(2, 3, 3, 1, 1)
            self.bn = L.BatchNormalization(3)
            self.fc = L.Linear(3 * 6 * 6, 4)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))))


def conv_a(strategy, monkeypatch, dtype, factor_dtype='float32'):
    """A of the convolution of a :class:`ConvBN` of ``dtype`` captured with
    ``strategy``, and the input."""
    chosen = []
    original = patches.patch_gram

    def forced(x, geometry, scale, factor_dtype=numpy.float32,
               append_ones=False, strategy=None, tf32=False):
        chosen.append(forced.strategy)
        return original(x, geometry, scale, factor_dtype, append_ones,
                        forced.strategy, tf32)
    forced.strategy = strategy
    monkeypatch.setattr(patches, 'patch_gram', forced)
    with chainer.using_config('dtype', dtype):
        numpy.random.seed(1)
        model = ConvBN()
    x, t = helpers.data(n=5, shape=(2, 6, 6))
    x = x.astype(dtype)
    optimizer = helpers.kfac(lr=0.0, momentum=0.0, factor_dtype=factor_dtype)
    optimizer.setup(model)
    optimizer.update(helpers.loss_of(model), x, t)
    assert chosen == [strategy]
    return helpers.block_named(optimizer, '/conv').factors['A'], x


def test_conv_a_through_each_strategy_equals_patch_sums(monkeypatch):
    from tests.chainerkfac.fisher_blocks.test_oracles import patches as cut
    results = {}
    for strategy in ('shifted', 'unfolded'):
        results[strategy], x = conv_a(strategy, monkeypatch, numpy.float64)
    rows = cut(x, 3, (1, 1), (1, 1), (1, 1))
    rows = numpy.concatenate([rows, numpy.ones(rows.shape[:2] + (1,))], 2)
    expected = numpy.einsum('nli,nlj->ij', rows, rows) / len(x)
    for strategy, value in results.items():
        assert value.dtype == numpy.float64
        numpy.testing.assert_allclose(value, expected, rtol=1e-10,
                                      err_msg=strategy)


@pytest.mark.parametrize('strategy', ['shifted', 'unfolded'])
def test_fp16_conv_factor_of_float32_model(strategy, monkeypatch):
    fp16, _ = conv_a(strategy, monkeypatch, numpy.float32, 'float16')
    fp32, _ = conv_a(strategy, monkeypatch, numpy.float32, 'float32')
    assert fp16.dtype == fp32.dtype == numpy.float32
    assert numpy.abs(fp16 - fp32).max() <= 3e-3 * numpy.abs(fp32).max()
