"""Exact low-rank factors (:mod:`chainerkfac.low_rank`): Woodbury against
the dense inverse, the cost model's choices, and whole training runs with
``low_rank=True`` against the same runs with dense factors, float64.

Tolerance: Woodbury's and Cholesky's inverses of a damped factor agree to
about ``cond · ε`` (cond ≤ 1e3 here, ε = 1.1e-16); a few steps of
momentum carry that along, so the weights agree to ~1e-13 relative; the
tests ask 1e-12.
"""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import contextlib

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from chainerkfac import low_rank
from tests.chainerkfac import helpers

TOLERANCE = 1e-12


# -- the algebra --------------------------------------------------------------
@pytest.mark.parametrize('dim,rank', [(30, 4), (12, 11), (8, 1)])
def test_woodbury_equals_the_dense_damped_inverse(dim, rank):
    rng = numpy.random.RandomState(dim)
    columns = rng.randn(dim, rank)
    damping = 0.03
    factor = low_rank.LowRank(columns)
    core = numpy.linalg.inv(factor.kernel() + damping * numpy.eye(rank))
    inverse = low_rank.WoodburyInverse(columns, core, damping)
    dense = numpy.linalg.inv(columns.dot(columns.T) +
                             damping * numpy.eye(dim))
    matrix = rng.randn(dim, 5)
    numpy.testing.assert_allclose(inverse.left(matrix), dense.dot(matrix),
                                  rtol=1e-11, atol=1e-11)
    numpy.testing.assert_allclose(inverse.right(matrix.T),
                                  matrix.T.dot(dense), rtol=1e-11,
                                  atol=1e-11)
    numpy.testing.assert_allclose(factor.dense(), columns.dot(columns.T))
    assert low_rank.mean_eigenvalue(factor) == pytest.approx(
        numpy.trace(columns.dot(columns.T)) / dim, rel=1e-14)


def _woodbury(rng, dim, rank, damping, dtype=numpy.float64):
    columns = rng.randn(dim, rank).astype(dtype)
    core = numpy.linalg.inv(columns.T.dot(columns) +
                            damping * numpy.eye(rank)).astype(dtype)
    return low_rank.WoodburyInverse(columns, core, damping)


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
def test_a_refilled_woodbury_inverse_applies_the_new_one(dtype):
    """A refresh taken in place (what a replayed CUDA graph reads): the
    old object's arrays hold the new inverse's values, its ``1/γ`` too,
    and it applies exactly what the new object applies (the same
    operations on the same values); another rank is not taken."""
    rng = numpy.random.RandomState(5)
    old = _woodbury(rng, 9, 3, 0.5, dtype)
    matrix = rng.randn(9, 4).astype(dtype)
    old.left(matrix)                       # 1/γ made for this dtype
    scale = old._scales[numpy.dtype(dtype)]
    arrays = old.arrays()
    new = _woodbury(rng, 9, 3, 0.02, dtype)
    assert low_rank.refilled(old, new) is old
    assert all(a is b for a, b in zip(old.arrays(), arrays))
    assert old._scales[numpy.dtype(dtype)] is scale
    assert old.damping == 0.02
    numpy.testing.assert_array_equal(old.left(matrix), new.left(matrix))
    numpy.testing.assert_array_equal(old.right(matrix.T),
                                     new.right(matrix.T))
    assert scale == numpy.asarray(1 / 0.02, dtype)
    other_rank = _woodbury(rng, 9, 4, 0.02, dtype)
    assert low_rank.refilled(old, other_rank) is other_rank
    numpy.testing.assert_array_equal(old.left(matrix), new.left(matrix))


def test_woodbury_scale_is_made_eagerly_and_refused_in_a_capture(
        monkeypatch):
    """1/γ for the columns' dtype exists from the start (a refresh is
    eager); one for another dtype first asked for while a CUDA graph is
    being captured is refused (its fill would be part of the graph, and
    every replay would write the capture's γ over a refill's)."""
    import types
    rng = numpy.random.RandomState(3)
    inverse = _woodbury(rng, 6, 2, 0.25)
    assert list(inverse._scales) == [numpy.dtype(numpy.float64)]
    assert inverse._scales[numpy.dtype(numpy.float64)] == 4.0
    capturing = types.SimpleNamespace(
        full=numpy.full, cuda=types.SimpleNamespace(
            get_current_stream=lambda: types.SimpleNamespace(
                is_capturing=lambda: True)))
    monkeypatch.setattr(low_rank, 'get_array_module',
                        lambda *arrays: capturing)
    inverse._scale(numpy.dtype(numpy.float64))        # made before: fine
    with pytest.raises(RuntimeError, match='float32 first asked for while '
                       'a CUDA graph is being captured'):
        inverse._scale(numpy.dtype(numpy.float32))


def test_refilled_dense_inverses_keep_their_array_where_it_fits():
    old = numpy.arange(9.0).reshape(3, 3)
    new = numpy.eye(3)
    assert low_rank.refilled(old, new) is old
    numpy.testing.assert_array_equal(old, new)
    for other in (numpy.eye(4), numpy.eye(3, dtype=numpy.float32),
                  numpy.asfortranarray(numpy.eye(3) * 2)):
        assert low_rank.refilled(old, other) is other
    frozen = numpy.zeros(3)
    frozen.flags.writeable = False
    assert low_rank.refilled(frozen, numpy.ones(3)) is not frozen
    assert low_rank.refilled(None, new) is new
    assert low_rank.refilled(old, None) is None
    assert low_rank.refilled(old, _woodbury(
        numpy.random.RandomState(1), 3, 1, 0.1)) is not old
    assert low_rank.inverse_arrays(old) == [old]
    assert low_rank.inverse_arrays(None) == []


def test_sums_and_scales_keep_the_columns_or_go_dense():
    rng = numpy.random.RandomState(0)
    a, b = rng.randn(6, 2), rng.randn(6, 3)
    joined = low_rank.add(low_rank.LowRank(a), low_rank.LowRank(b))
    assert isinstance(joined, low_rank.LowRank) and joined.rank == 5
    numpy.testing.assert_allclose(joined.dense(), a.dot(a.T) + b.dot(b.T))
    mixed = low_rank.add(low_rank.LowRank(a), b.dot(b.T))
    assert isinstance(mixed, numpy.ndarray)
    numpy.testing.assert_allclose(mixed, a.dot(a.T) + b.dot(b.T))
    numpy.testing.assert_allclose(
        low_rank.scaled(low_rank.LowRank(a), 0.25).dense(),
        0.25 * a.dot(a.T))


def test_cost_model():
    # Few columns of a large factor: low rank, alone and across processes.
    assert low_rank.pays(1000, 100, 785)
    assert low_rank.pays(1000, 100, 785, processes=4)
    # As many columns as the dimension: never.
    assert not low_rank.pays(64, 64, 64)
    # Where the preconditioning dominates (a wide gradient matrix), the
    # break-even is 2 o d k = o d²: k = d / 2.
    assert low_rank.pays(100, 49, 10 ** 5)
    assert not low_rank.pays(100, 51, 10 ** 5)
    # Across processes each form adds what it sends: d·k elements against
    # the packed d (d + 1) / 2 ... counted as d² / 2.
    alone, shared = (low_rank.costs(100, 30, 10, p) for p in (1, 4))
    assert shared['low_rank'] - alone['low_rank'] == pytest.approx(
        low_rank.SEND_COST * 100 * 30)
    assert shared['dense'] - alone['dense'] == pytest.approx(
        low_rank.SEND_COST * 100 * 100 / 2)
    assert low_rank.rank_budget(1000, 4) == 125


# -- whole runs: low rank against dense ---------------------------------------
class WideMLP(chainer.Chain):
    """20 → 16 → 3 with tanh, float64: batch 4 gives A and G of the first
    layer rank 4 (d = 21 and 16), low rank."""

    in_shape = (20,)

    def __init__(self, bias=True):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.l1 = L.Linear(20, 16, nobias=not bias)
            self.l2 = L.Linear(16, 3)

    def forward(self, x):
        return self.l2(F.tanh(self.l1(x)))


class SmallConv(chainer.Chain):
    """A convolution whose A (3·3·3 + 1) and G (16) see few columns, a
    grouped one (plain gradient either way), then a Linear; with ``bn``,
    a BatchNormalization after the convolution (its full Fisher, 32 × 32,
    has one column per sample)."""

    in_shape = (3, 4, 4)

    def __init__(self, stride=2, pad=1, dilate=1, bias=True, bn=False):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.conv = L.Convolution2D(3, 16, 3, stride, pad,
                                        nobias=not bias, dilate=dilate)
            if bn:
                self.bn = L.BatchNormalization(16)
            self.grouped = L.Convolution2D(16, 16, 1, groups=4)
            self.fc = L.Linear(None, 3)
        self.use_bn = bn
        with helpers.float64_links():
            self.fc(self.features(numpy.zeros((2,) + self.in_shape)))

    def features(self, x):
        h = self.conv(x)
        if self.use_bn:
            h = self.bn(h)
        return F.relu(self.grouped(F.tanh(h)))

    def forward(self, x):
        return self.fc(self.features(x))


def _batches(shape, steps, batch=2, seed=0):
    rng = numpy.random.RandomState(seed)
    return [(rng.randn(batch, *shape), rng.randint(0, 3, batch).astype(
        numpy.int32)) for _ in range(steps)]


def _run(make_model, low, steps=5, batch=2, acc_iters=1, hooks=(),
         **options):
    numpy.random.seed(0)
    model = make_model()
    options.setdefault('lr', 0.1)
    options.setdefault('momentum', 0.9)
    options.setdefault('damping', 1e-2)
    optimizer = helpers.kfac(low_rank=low, acc_iters=acc_iters, **options)
    optimizer.setup(model)
    for hook in hooks:
        optimizer.add_hook(hook)
    counts = []
    reporter = chainer.Reporter()
    for x, t in _batches(model.in_shape, steps * acc_iters, batch):
        observation = {}
        with reporter.scope(observation):
            optimizer.update(helpers.loss_of(model), x, t)
        if 'kfac/low_rank_factors' in observation:
            counts.append(observation['kfac/low_rank_factors'])
    return {n: p.array.copy() for n, p in model.namedparams()}, counts


def _compare(make_model, expect_low_rank=True, **kwargs):
    """The run with ``low_rank=True`` against the dense one; low rank
    used at every step (``expect_low_rank`` True), at some (``'some'``)
    or none (False)."""
    low, counts = _run(make_model, True, **kwargs)
    dense, dense_counts = _run(make_model, False, **kwargs)
    assert max(dense_counts) == 0
    if expect_low_rank == 'some':
        assert max(counts) >= 1, counts
    elif expect_low_rank:
        assert min(counts) >= 1, counts        # low rank really ran
    else:
        assert max(counts) == 0, counts
    kwargs['steps'] = 0
    initial, _ = _run(make_model, False, **kwargs)
    moved = max(float(numpy.abs(dense[n] - initial[n]).max())
                for n in dense)
    assert moved > 1e-3                         # the steps did something
    for name in dense:
        numpy.testing.assert_allclose(low[name], dense[name],
                                      rtol=TOLERANCE, atol=TOLERANCE,
                                      err_msg=name)
    return counts


@pytest.mark.parametrize('bias', [True, False])
def test_linear_equals_dense(bias):
    counts = _compare(lambda: WideMLP(bias=bias), batch=4)
    # l1's A and G, l2's A (l2's G: d = 3 < 2k).
    assert max(counts) == 3


@pytest.mark.parametrize('stride,pad,dilate,bias', [
    (2, 1, 1, True), (2, 0, 1, False), (1, 0, 1, True), (2, 2, 2, True)])
def test_convolution_equals_dense(stride, pad, dilate, bias):
    _compare(lambda: SmallConv(stride, pad, dilate, bias))


def test_batch_normalization_full_fisher_equals_dense():
    """BN's full Fisher of N per-sample gradients of (γ, β) is low rank
    too (2C = 32, 2 samples)."""
    numpy.random.seed(0)
    optimizer = helpers.kfac(lr=0.1).setup(SmallConv(bn=True))
    model = optimizer.target
    x, t = _batches(model.in_shape, 1)[0]
    optimizer.update(helpers.loss_of(model), x, t)
    assert isinstance(helpers.block_named(optimizer, '/bn').factors['F'],
                      low_rank.LowRank)
    _compare(lambda: SmallConv(bn=True), rho_bn=2.0)


def test_weight_decay_momentum_and_clipping_hooks():
    _compare(lambda: WideMLP(), batch=4, hooks=[
        chainer.optimizer_hooks.WeightDecay(1e-3),
        chainer.optimizer_hooks.GradientClipping(0.5)], momentum=0.5)


def test_accumulation_joins_the_micro_batches_columns():
    counts = _compare(lambda: WideMLP(), batch=2, acc_iters=2)
    assert max(counts) == 3


def test_stale_factors_keep_their_woodbury_inverses():
    _compare(lambda: WideMLP(), batch=4, steps=6, refresh_interval_a=3,
             refresh_interval_g=2)


def test_factor_decay_goes_dense_where_the_ranks_add_up():
    """An exponential average adds the ranks of the factors it averages
    (4 columns, then 8, 12, ...): each factor goes dense once that no
    longer pays, and the run equals the dense run throughout."""
    counts = _compare(lambda: WideMLP(), 'some', batch=4, steps=4,
                      factor_decay=0.5)
    assert counts[0] == 3 and counts[-1] == 0, counts


def test_fp16_factors_stay_dense():
    """fp16 factors are rounded products, not low rank: the option leaves
    them dense, and the run is the dense run."""
    _compare(lambda: WideMLP(), expect_low_rank=False, batch=4,
             factor_dtype='float16')


def test_a_sum_of_many_calls_goes_dense_past_the_budget():
    """A link called at every step of a sequence adds each call's columns;
    past the budget the capture forms the Gram matrix instead."""
    class Recurrent(chainer.Chain):
        in_shape = (20,)

        def __init__(self):
            super().__init__()
            with helpers.float64_links(), self.init_scope():
                self.cell = L.Linear(20, 20)
                self.out = L.Linear(20, 3)

        def forward(self, x):
            h = x
            for _ in range(4):
                h = F.tanh(self.cell(h))
            return self.out(h)

    numpy.random.seed(0)
    model = Recurrent()
    optimizer = helpers.kfac(lr=0.1).setup(model)
    x, t = _batches((20,), 1, batch=3)[0]
    optimizer.update(helpers.loss_of(model), x, t)
    cell = helpers.block_named(optimizer, '/cell')
    # 4 calls × 3 samples = 12 columns > budget 10 of A (d = 21).
    assert not isinstance(cell.factors['A'], low_rank.LowRank)
    _compare(Recurrent, batch=3, expect_low_rank=True)


def test_traces_read_once_give_each_reads_value():
    """The traces read together equal each factor's own read, to the bit:
    dense float32 / float64 / float16, a diagonal, a low-rank factor."""
    rng = numpy.random.RandomState(5)
    factors = [rng.randn(4, 4).astype(numpy.float32),
               rng.randn(3, 3),
               rng.randn(5, 5).astype(numpy.float16),
               rng.rand(6),
               low_rank.LowRank(rng.randn(7, 2))]
    alone = [low_rank.mean_eigenvalue(f) for f in factors]
    with low_rank.traces_read_once(factors):
        together = [low_rank.mean_eigenvalue(f) for f in factors]
        # a factor it was not given is read as before
        extra = rng.randn(2, 2)
        assert low_rank.mean_eigenvalue(extra) == float(numpy.trace(
            extra)) / 2
    assert together == alone
    assert getattr(low_rank._traces, 'read', None) is None


def test_a_refresh_step_reads_the_traces_once(monkeypatch):
    """K-FAC's refresh reads every Kronecker block's factor traces (the
    damping's split π) in one host read, not one per factor (a GPU refresh
    of ResNet-50 read 108 one by one); the step is the same to the bit as
    with one read per factor."""
    x, t = helpers.data(n=8, shape=(2, 5, 5))

    def train(read_once):
        numpy.random.seed(0)
        model = helpers.ConvNet(bn=True)
        optimizer = helpers.kfac(lr=0.05, momentum=0.9, damping=1e-2,
                                 low_rank=True).setup(model)
        for _ in range(3):
            optimizer.update(helpers.loss_of(model), x, t)
        return {n: p.array.copy() for n, p in model.namedparams()}

    reads, outside, inside, state = [], [], [], {'in': False}
    original_read, original_trace = low_rank._to_host, low_rank._device_trace
    original_once = low_rank.traces_read_once

    def counted(array):
        reads.append(array.shape)
        return original_read(array)

    def trace(factor):
        (inside if state['in'] else outside).append(factor)
        return original_trace(factor)

    @contextlib.contextmanager
    def once_marked(factors):
        state['in'] = True
        try:
            with original_once(factors):
                yield
        finally:
            state['in'] = False

    monkeypatch.setattr(low_rank, '_to_host', counted)
    monkeypatch.setattr(low_rank, '_device_trace', trace)
    monkeypatch.setattr(low_rank, 'traces_read_once', once_marked)
    once = train(True)
    # 3 refresh steps, one read each, of the conv's and the fc's A and G
    assert reads == [(4,)] * 3, reads
    assert outside == [] and len(inside) == 3 * 4
    monkeypatch.setattr(low_rank, 'traces_read_once',
                        lambda factors: contextlib.nullcontext())
    each = train(False)
    assert len(outside) == 3 * 4
    for name, value in each.items():
        numpy.testing.assert_array_equal(once[name], value, err_msg=name)
