"""``factor_dtype='tf32'``: float32 factors whose products take their
operands with TF32's 10-bit mantissa (Tensor Cores on the GPU); and
``precondition_dtype='tf32'``: stage 5's dense products the same way.

On the CPU the twins round the operands (``linalg.round_to_tf32``) and
multiply them exactly; they are checked against float64 products of the
rounded operands (the only error left is float32 summation), and against
the exact float32 factors (they differ, by about TF32's rounding). On the
GPU (marked ``gpu``) the Tensor Core products against the twins, within a
bound from the arithmetic."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from chainerkfac import linalg
from chainerkfac.fisher_blocks import patches
from chainerkfac.optimizers import options
from tests.chainerkfac import helpers
from tests.chainerkfac.fisher_blocks.test_patches import (
    CASES, loop_gram, loop_patches, strategies)
from tests.gpu import support

#: TF32's unit roundoff: 10 mantissa bits kept, to nearest.
U_TF32 = 2.0 ** -11


def test_round_to_tf32_nearest_ties_to_even_and_idempotent():
    # 1 + 2^-10 is a TF32 number; 1 + 2^-11 ties to even (1); 1 + 3·2^-11
    # ties to even upwards (1 + 2^-9)
    values = numpy.array([1 + 2 ** -10, 1 + 2 ** -11, 1 + 3 * 2 ** -11,
                          -2.5, 0.0, -0.0], numpy.float32)
    rounded = linalg.round_to_tf32(values)
    numpy.testing.assert_array_equal(
        rounded, numpy.array([1 + 2 ** -10, 1.0, 1 + 2 ** -9, -2.5, 0.0,
                              -0.0], numpy.float32))
    x = numpy.random.RandomState(0).randn(1000).astype(numpy.float32)
    once = linalg.round_to_tf32(x)
    numpy.testing.assert_array_equal(linalg.round_to_tf32(once), once)
    assert numpy.abs(once - x).max() <= U_TF32 * numpy.abs(x).max()
    assert numpy.abs(once / x - 1).max() <= U_TF32
    assert numpy.count_nonzero(once != x) > 900
    assert numpy.isinf(linalg.round_to_tf32(
        numpy.array([numpy.inf], numpy.float32)))[0]


def test_tf32_matmul_twin_multiplies_the_rounded_operands():
    rng = numpy.random.RandomState(1)
    a = rng.randn(3, 5, 64).astype(numpy.float32)
    b = rng.randn(3, 64, 4).astype(numpy.float32)
    got = linalg.tf32_matmul(a, b)
    assert got.dtype == numpy.float32
    rounded = numpy.matmul(linalg.round_to_tf32(a).astype(numpy.float64),
                           linalg.round_to_tf32(b).astype(numpy.float64))
    bound = numpy.matmul(numpy.abs(a), numpy.abs(b))
    # float32 sums of 64 terms
    assert (numpy.abs(got - rounded) <= 64 * 2.0 ** -24 * bound).all()
    exact = numpy.matmul(a.astype(numpy.float64), b.astype(numpy.float64))
    assert (numpy.abs(got - exact) <= (2 * U_TF32 + 64 * 2.0 ** -24) *
            bound).all()
    assert numpy.abs(got - exact).max() > 1e-5 * bound.max()


@pytest.mark.parametrize('bias', [False, True])
def test_gram_in_tf32(bias):
    """Linear's A (and G, BN's F): the core from the rounded rows, the
    bias's row and column from the rows as they are."""
    rows = numpy.random.RandomState(2).randn(40, 7).astype(numpy.float32)
    got = linalg.gram(rows, 0.25, append_ones=bias, tf32=True)
    assert got.dtype == numpy.float32
    r = linalg.round_to_tf32(rows).astype(numpy.float64)
    core = r.T.dot(r) * 0.25
    numpy.testing.assert_allclose(got[:7, :7], core, rtol=1e-5, atol=1e-5)
    exact = linalg.gram(rows.astype(numpy.float64), 0.25, append_ones=bias)
    assert numpy.abs(got[:7, :7] - exact[:7, :7]).max() > 1e-6
    if bias:
        # float32 sums of 40 rows as they are (the rounded rows' sums are
        # ~1e-3 off, far outside this bound)
        bound = 40 * 2.0 ** -24 * 0.25 * numpy.abs(rows).sum(axis=0)
        assert (numpy.abs(got[7, :7] - exact[7, :7]) <= bound).all()
        r_sums = r.sum(axis=0) * 0.25
        assert (numpy.abs(r_sums - exact[7, :7]) > bound).any()
        assert got[7, 7] == exact[7, 7]
    numpy.testing.assert_array_equal(got, got.T)
    # float64 rows keep float64 products; float16 keeps its own path
    numpy.testing.assert_array_equal(
        linalg.gram(rows.astype(numpy.float64), 0.25, tf32=True),
        linalg.gram(rows.astype(numpy.float64), 0.25))
    numpy.testing.assert_array_equal(
        linalg.gram(rows, 0.25, numpy.float16, tf32=True),
        linalg.gram(rows, 0.25, numpy.float16))


@pytest.mark.parametrize('bias', [False, True])
@pytest.mark.parametrize('size,geometry', [CASES[0], CASES[2], CASES[9],
                                           CASES[10], CASES[13]])
def test_patch_gram_in_tf32_both_strategies(size, geometry, bias):
    """Convolution's A either way: the patches of the rounded input, the
    bias's sums of the input as it is; exact float32 factors differ."""
    x = numpy.random.RandomState(3).randn(6, 3, *size).astype(numpy.float32)
    rounded = linalg.round_to_tf32(x).astype(numpy.float64)
    expected = loop_gram(rounded, geometry, 1.0 / 6, bias)
    if bias:
        plain = loop_gram(x.astype(numpy.float64), geometry, 1.0 / 6, True)
        expected[-1], expected[:, -1] = plain[-1], plain[:, -1]
    magnitude = loop_gram(numpy.abs(x).astype(numpy.float64), geometry,
                          1.0 / 6, bias)
    terms = loop_patches(x, geometry).shape[0] * \
        loop_patches(x, geometry).shape[1]
    for strategy in strategies(x.shape, geometry):
        got = patches.patch_gram(x, geometry, 1.0 / 6, append_ones=bias,
                                 strategy=strategy, tf32=True)
        assert got.dtype == numpy.float32
        # float32 sums of the rounded products
        assert (numpy.abs(got - expected) <=
                2 * terms * 2.0 ** -24 * magnitude + 1e-30).all(), strategy
        numpy.testing.assert_array_equal(got, got.T)
        exact = patches.patch_gram(x, geometry, 1.0 / 6, append_ones=bias,
                                   strategy=strategy)
        assert numpy.abs(got - exact).max() > 1e-6 * magnitude.max()
    # float64 inputs keep float64 products
    x64 = x.astype(numpy.float64)
    numpy.testing.assert_array_equal(
        patches.patch_gram(x64, geometry, 0.5, tf32=True,
                           strategy='unfolded'),
        patches.patch_gram(x64, geometry, 0.5, strategy='unfolded'))


def test_channel_gram_and_split_k_in_tf32():
    y = numpy.random.RandomState(4).randn(4, 5, 6, 3).astype(numpy.float32)
    rows = linalg.round_to_tf32(y).astype(numpy.float64).transpose(
        0, 2, 3, 1).reshape(-1, 5)
    numpy.testing.assert_allclose(
        patches.channel_gram(y, 0.5, tf32=True), rows.T.dot(rows) * 0.5,
        rtol=1e-5)
    # the GPU's split-K product, on NumPy through the twin
    matrix = numpy.random.RandomState(5).randn(6, 96).astype(numpy.float32)
    r = linalg.round_to_tf32(matrix).astype(numpy.float64)
    for pieces in (1, 3, None):
        got = patches.column_gram(matrix, False, numpy.dtype(numpy.float32),
                                  pieces, tf32=True)
        numpy.testing.assert_allclose(got, r.dot(r.T), rtol=1e-5, atol=1e-5)


class SmallNet(chainer.Chain):
    """conv → BN → relu → conv → relu → linear, float32."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.c1 = L.Convolution2D(3, 8, 3, pad=1)
            self.bn = L.BatchNormalization(8)
            self.c2 = L.Convolution2D(8, 8, 3, stride=2, pad=1, nobias=True)
            self.fc = L.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        h = F.relu(self.bn(self.c1(x)))
        return self.fc(F.relu(self.c2(h)))


def _factors_after_one_step(factor_dtype):
    numpy.random.seed(0)
    model = SmallNet()
    optimizer = helpers.kfac(lr=0.1, factor_dtype=factor_dtype,
                             low_rank=False)
    optimizer.setup(model)
    rng = numpy.random.RandomState(6)
    x = rng.randn(16, 3, 8, 8).astype(numpy.float32)
    t = rng.randint(0, 5, 16).astype(numpy.int32)
    optimizer.update(helpers.loss_of(model), x, t)
    return optimizer, {(b.name, k): helpers.dense(v) for b in
                       optimizer.blocks for k, v in b.factors.items()}


def test_kfac_factor_dtype_tf32():
    """The option reaches every block; every dense factor is float32 and
    within TF32's rounding of the exact float32 one (relative to its
    largest entry: each product's operands rounded, 2u), not equal to it;
    the steps start from the same gradients, so the two runs' weights
    differ by what the factors' rounding makes of the step."""
    tf32, got = _factors_after_one_step('tf32')
    fp32, exact = _factors_after_one_step('float32')
    assert tf32.factor_dtype == 'tf32'
    assert all(b.factor_tf32 for b in tf32.blocks if b.factor_names)
    assert not any(b.factor_tf32 for b in fp32.blocks)
    assert set(got) == set(exact) and len(got) == 7    # 3 x (A, G) + BN F
    differ = 0
    for key, value in got.items():
        assert value.dtype == numpy.float32, key
        error = numpy.abs(value - exact[key]).max()
        assert error <= 4 * U_TF32 * numpy.abs(exact[key]).max(), key
        differ += error > 0
    assert differ >= 5
    assert 'tf32' in repr(tf32.factor_dtype)


def test_factor_dtype_option_values():
    assert 'tf32' in options.FACTOR_DTYPES
    for bad in ('tf16', 'bfloat16', 'float64'):
        with pytest.raises(ValueError, match='factor_dtype'):
            helpers.kfac(factor_dtype=bad)
    assert helpers.kfac(factor_dtype='TF32').factor_dtype == 'tf32'


def test_config_accepts_tf32():
    """A run's config takes the value (checked by the optimizer's own
    rules) and hands it to KFAC; a misspelt one names its key."""
    import config as config_module
    data = config_module.to_dict(config_module.load(
        config_module.preset_path('bs4k')))
    cfg = config_module.from_dict(dict(data, factor_dtype='tf32'))
    kwargs = config_module.kfac_options(cfg)
    assert kwargs['factor_dtype'] == 'tf32'
    kwargs.update(verbose=False)
    assert chainerkfac.optimizers.KFAC(**kwargs).factor_dtype == 'tf32'
    with pytest.raises(config_module.ConfigError, match='factor_dtype'):
        config_module.from_dict(dict(data, factor_dtype='tf16'))


# -- precondition_dtype='tf32': stage 5 -------------------------------------
class TwinLayers(chainer.Chain):
    """Two Linear layers of one shape (one batch of stage 5 on the GPU)
    between others, float32 or float64."""

    def __init__(self, dtype=numpy.float32):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(12, 24)
            self.l2 = L.Linear(24, 24)
            self.l3 = L.Linear(24, 24)
            self.out = L.Linear(24, 5, nobias=True)
        self.to_device('@numpy')
        for param in self.params():
            param.array = param.array.astype(dtype)

    def forward(self, x):
        h = F.tanh(self.l1(x))
        return self.out(F.tanh(self.l3(F.tanh(self.l2(h)))))


def _stepped(model, precondition_dtype):
    """One K-FAC step (dense factors, refreshed), so every block has its
    inverses; the gradients of that step, per block."""
    optimizer = helpers.kfac(lr=0.05, precondition_dtype=precondition_dtype,
                             low_rank=False)
    optimizer.setup(model)
    rng = numpy.random.RandomState(4)
    dtype = model.l1.W.dtype
    x = rng.randn(20, 12).astype(dtype)
    t = rng.randint(0, 5, 20).astype(numpy.int32)
    optimizer.update(helpers.loss_of(model), x, t)
    model.cleargrads()
    helpers.loss_of(model)(x, t).backward()
    grads = {b: [p.grad.copy() for p in b.params] for b in optimizer.blocks}
    return optimizer, grads


def _exact_direction(block, grads, damping):
    """``G⁻¹ ∇E A⁻¹`` in float64 from the block's own operands, and the
    same product of their magnitudes (what rounding errors scale with)."""
    regularized = [numpy.asarray(g, numpy.float64) for g in
                   block.regularized_grads(grads, damping)]
    matrix = regularized[0].reshape(block.out_size, -1)
    if block.has_bias:
        matrix = numpy.concatenate([matrix, regularized[1][:, None]], 1)
    g_inv, a_inv = (numpy.asarray(block.inverses[n], numpy.float64)
                    for n in 'GA')
    g_inv, a_inv = (numpy.diag(m) if m.ndim == 1 else m   # kept diagonal
                    for m in (g_inv, a_inv))
    return (g_inv.dot(matrix).dot(a_inv),
            numpy.abs(g_inv).dot(numpy.abs(matrix)).dot(numpy.abs(a_inv)))


def _flat(direction):
    return numpy.concatenate([numpy.ravel(d) for d in direction])


def test_precondition_dtype_tf32_rounds_stage_5s_operands():
    """Every Kronecker block's direction: within TF32's rounding of the
    exact product (its three operands and the intermediate product each
    rounded once, 4u of the magnitude product, and float32 sums) and not
    equal to float32's, which stays within float32's rounding."""
    numpy.random.seed(3)
    optimizer, grads = _stepped(TwinLayers(), 'tf32')
    blocks = [b for b in optimizer.blocks if b.factor_names]
    assert len(blocks) == 4 and all(b.precondition_tf32 for b in blocks)
    for block in blocks:
        damping = optimizer._block_damping(block)
        exact, magnitude = _exact_direction(block, grads[block], damping)
        tf32 = block.precondition(grads[block], damping)
        block.precondition_tf32 = False
        fp32 = block.precondition(grads[block], damping)
        block.precondition_tf32 = True
        assert tf32[0].dtype == numpy.float32
        terms = sum(block.inverses['A'].shape) + sum(
            block.inverses['G'].shape)
        float32_sums = 2 * terms * 2.0 ** -24
        magnitude = _flat(_split(block, magnitude))
        got, plain = _flat(tf32), _flat(fp32)
        exact = _flat(_split(block, exact))
        assert (numpy.abs(got - exact) <=
                (4.5 * U_TF32 + float32_sums) * magnitude).all(), block.name
        assert (numpy.abs(plain - exact) <=
                (4 * 2.0 ** -24 + float32_sums) * magnitude).all()
        assert numpy.abs(got - exact).max() > 10 * numpy.abs(
            plain - exact).max(), block.name


def _split(block, matrix):
    """A (out, in [+ 1]) matrix as the block's parameter shapes."""
    shape = block.link.W.shape
    if block.has_bias:
        return [matrix[:, :-1].reshape(shape), matrix[:, -1]]
    return [matrix.reshape(shape)]


def test_precondition_batch_tf32_is_the_blocks_own():
    """The GPU's batched stage 5 (here with NumPy stacks) gives each block
    its own TF32 direction, up to float32 summation order."""
    from chainerkfac.fisher_blocks import kronecker
    numpy.random.seed(5)
    optimizer, grads = _stepped(TwinLayers(), 'tf32')
    pair = [helpers.block_named(optimizer, n) for n in ('/l2', '/l3')]
    assert kronecker.batch_key(pair[0]) == kronecker.batch_key(pair[1])
    damping = optimizer._block_damping(pair[0])
    for tf32 in (True, False):
        batched = kronecker.precondition_batch(
            pair, [grads[b] for b in pair], damping,
            kronecker.InverseStack(), tf32=tf32)
        for block, direction in zip(pair, batched):
            block.precondition_tf32 = tf32
            alone = block.precondition(grads[block], damping)
            _, magnitude = _exact_direction(block, grads[block], damping)
            bound = 4 * 48 * 2.0 ** -24 * _flat(_split(block, magnitude))
            assert (numpy.abs(_flat(direction) - _flat(alone)) <=
                    bound).all()
    tf32 = kronecker.precondition_batch(
        pair, [grads[b] for b in pair], damping, kronecker.InverseStack(),
        tf32=True)
    assert not numpy.array_equal(_flat(tf32[0]), _flat(batched[0]))


def test_precondition_dtype_tf32_leaves_a_diagonal_factor_exact():
    """A block whose A is kept diagonal (``max_factor_dim``) is
    preconditioned exactly with ``precondition_dtype='tf32'``, block by
    block and in the GPU's batch alike (the batch took its dense G⁻¹
    product on TF32 before: the same block's direction then depended on
    whether it had a twin)."""
    from chainerkfac.fisher_blocks import kronecker
    numpy.random.seed(5)
    optimizer = helpers.kfac(lr=0.05, precondition_dtype='tf32',
                             low_rank=False, max_factor_dim=24)
    model = TwinLayers()
    optimizer.setup(model)
    rng = numpy.random.RandomState(4)
    x = rng.randn(20, 12).astype(numpy.float32)
    t = rng.randint(0, 5, 20).astype(numpy.int32)
    optimizer.update(helpers.loss_of(model), x, t)
    model.cleargrads()
    helpers.loss_of(model)(x, t).backward()
    pair = [helpers.block_named(optimizer, n) for n in ('/l2', '/l3')]
    assert [b.inverses['A'].ndim for b in pair] == [1, 1]   # 25 > 24
    assert [b.inverses['G'].ndim for b in pair] == [2, 2]
    grads = [[p.grad.copy() for p in b.params] for b in pair]
    damping = optimizer._block_damping(pair[0])
    batched = kronecker.precondition_batch(pair, grads, damping,
                                           kronecker.InverseStack(),
                                           tf32=True)
    for block, grad, direction in zip(pair, grads, batched):
        assert block.precondition_tf32
        alone = block.precondition(grad, damping)
        exact, magnitude = _exact_direction(block, grad, damping)
        bound = 4 * 48 * 2.0 ** -24 * _flat(_split(block, magnitude))
        for got in (direction, alone):
            assert (numpy.abs(_flat(got) - _flat(_split(block, exact))) <=
                    bound).all()


def test_precondition_dtype_tf32_leaves_float64_models_exact():
    runs = []
    for dtype in ('tf32', 'float32'):
        numpy.random.seed(3)
        model = TwinLayers(numpy.float64)
        _stepped(model, dtype)
        runs.append([p.array.copy() for p in model.params()])
    for a, b in zip(*runs):
        assert a.dtype == numpy.float64
        numpy.testing.assert_array_equal(a, b)


def test_precondition_dtype_option_and_config():
    assert options.PRECONDITION_DTYPES == ('float32', 'tf32')
    assert helpers.kfac().precondition_dtype == 'float32'
    for bad in ('float16', 'TF32x', None):
        with pytest.raises(ValueError, match='precondition_dtype'):
            helpers.kfac(precondition_dtype=bad)
    import config as config_module
    data = config_module.to_dict(config_module.load(
        config_module.preset_path('bs4k')))
    cfg = config_module.from_dict(dict(data, precondition_dtype='tf32'))
    kwargs = dict(config_module.kfac_options(cfg), verbose=False)
    assert kwargs['precondition_dtype'] == 'tf32'
    optimizer = chainerkfac.optimizers.KFAC(**kwargs)
    assert optimizer.precondition_dtype == 'tf32'
    with pytest.raises(config_module.ConfigError, match='precondition_dtype'):
        config_module.from_dict(dict(data, precondition_dtype='half'))


# -- GPU: the Tensor Core products against the twins --------------------------
@pytest.mark.gpu
@pytest.mark.parametrize('bias', [False, True])
@pytest.mark.parametrize('size,geometry', [CASES[0], CASES[9], CASES[13]])
def test_gpu_patch_gram_in_tf32_against_the_twin(size, geometry, bias):
    """Both multiply TF32 operands and sum in float32; the hardware may
    round an operand otherwise than the twin's nearest-even (truncation:
    up to 2^-10), so each entry is bounded by 2·2^-10 of its magnitude
    Gram plus float32 sums."""
    cupy = support.cupy_or_skip()
    x = numpy.random.RandomState(7).randn(5, 3, *size).astype(numpy.float32)
    cpu = patches.patch_gram(x, geometry, 0.2, append_ones=bias,
                             strategy='unfolded', tf32=True)
    gpu = patches.patch_gram(cupy.asarray(x), geometry, 0.2,
                             append_ones=bias, tf32=True)
    assert isinstance(gpu, cupy.ndarray) and gpu.dtype == numpy.float32
    magnitude = loop_gram(numpy.abs(x).astype(numpy.float64), geometry, 0.2,
                          bias)
    terms = x.shape[0] * numpy.prod(geometry.out_size(*size))
    bound = (2 * 2.0 ** -10 + 2 * terms * 2.0 ** -24) * magnitude
    assert (numpy.abs(cupy.asnumpy(gpu) - cpu) <= bound + 1e-30).all()
    # the products went to our cuBLAS handle in TF32 math (whether cuBLAS
    # then picks a Tensor Core kernel for so small a product is its own
    # choice, so the values alone cannot tell)
    from chainerkfac.graphs import cublas, gemm
    handles = getattr(gemm.default()._local, 'handles', {})
    assert any(math == cublas.CUBLAS_TF32_TENSOR_OP_MATH
               for _, math in handles)


@pytest.mark.gpu
def test_gpu_gram_in_tf32_against_the_twin():
    cupy = support.cupy_or_skip()
    rows = numpy.random.RandomState(8).randn(64, 33).astype(numpy.float32)
    cpu = linalg.gram(rows, 0.5, append_ones=True, tf32=True)
    gpu = cupy.asnumpy(linalg.gram(cupy.asarray(rows), 0.5, append_ones=True,
                                   tf32=True))
    a = numpy.abs(rows).astype(numpy.float64)
    magnitude = linalg.gram(a, 0.5, append_ones=True)
    bound = (2 * 2.0 ** -10 + 2 * 64 * 2.0 ** -24) * magnitude
    assert (numpy.abs(gpu - cpu) <= bound).all()


@pytest.mark.gpu
def test_gpu_precondition_batch_in_tf32_against_the_twin():
    """Stage 5's stacked products on the GPU in TF32 against the CPU twin:
    four operand roundings, each up to 2^-10 where the hardware truncates,
    of the magnitude product."""
    cupy = support.cupy_or_skip()
    from chainerkfac.fisher_blocks import kronecker
    numpy.random.seed(5)
    optimizer, grads = _stepped(TwinLayers(), 'tf32')
    pair = [helpers.block_named(optimizer, n) for n in ('/l2', '/l3')]
    damping = optimizer._block_damping(pair[0])
    cpu = kronecker.precondition_batch(pair, [grads[b] for b in pair],
                                       damping, kronecker.InverseStack(),
                                       tf32=True)
    magnitudes = [_flat(_split(b, _exact_direction(b, grads[b], damping)[1]))
                  for b in pair]
    for block in pair:
        block.link.to_device('@cupy:0')
        block.inverses = {k: cupy.asarray(v) for k, v in
                          block.inverses.items()}
    gpu = kronecker.precondition_batch(
        pair, [[cupy.asarray(g) for g in grads[b]] for b in pair], damping,
        kronecker.InverseStack(), tf32=True)
    for c, g, magnitude in zip(cpu, gpu, magnitudes):
        difference = numpy.abs(_flat([cupy.asnumpy(d) for d in g]) -
                               _flat(c))
        assert (difference <= (8 * 2.0 ** -10) * magnitude + 1e-30).all()
    from chainerkfac.graphs import cublas, gemm
    handles = getattr(gemm.default()._local, 'handles', {})
    assert any(math == cublas.CUBLAS_TF32_TENSOR_OP_MATH
               for _, math in handles)
