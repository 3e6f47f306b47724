"""The library's CUDA kernels, their own source text, run on the CPU
(tests/cuda_cpu.py) through the library's GPU code paths, against the
NumPy twins: every ``RawKernel`` (the multi-tensor ops, the BN rows, the
finite check over a pointer table, the device guard's copies) and the
``ElementwiseKernel`` / ``ReductionKernel`` bodies (eqs. 13, 19-20, the
gather-cast of the collectives, linalg_cuda's checks run through
test_linalg_cuda_emulated). Each launch's arguments are checked against
the parameters the source declares, every array sits between guard bands
that must come back untouched, and the threads of a block run in two
orders (a missing ``__syncthreads()`` shows as two results).

The elementwise results are bit for bit the twins' (the emulation does
not fuse multiply-adds); sums, whose order differs, within a bound from
the arithmetic. The same tests on a GPU run in tests/gpu and beside their
CPU twins (``make test-gpu``)."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import contextlib
import functools
import math
import os
import sys
import types

import numpy
import pytest

import chainer

from chainerkfac import device_guard, fused, low_rank, multi_tensor, packing
from chainerkfac import step_bound
from tests import cuda_cpu
from tests.chainerkfac import cuda_emulation
from tests.chainerkfac.test_linalg import spd

# CI sets CHAINERKFAC_REQUIRE_CXX: there, a missing compiler fails the tests
pytestmark = pytest.mark.skipif(
    not os.environ.get('CHAINERKFAC_REQUIRE_CXX') and
    cuda_cpu.unavailable() is not None,
    reason=str(cuda_cpu.unavailable()))

#: Float32 / float64 unit roundoff.
U = {numpy.float32: 2.0 ** -24, numpy.float64: 2.0 ** -53}


class Device:
    """The emulated device: a fake ``cupy`` whose kernels are those of
    tests/cuda_cpu.py, its arrays in guard bands."""

    def __init__(self, schedule):
        self.guarded = cuda_cpu.Guarded()
        cupy = cuda_emulation.modules()['cupy']
        cupy.RawKernel = functools.partial(cuda_cpu.RawKernel,
                                           schedule=schedule)
        cupy.ElementwiseKernel = cuda_cpu.ElementwiseKernel
        cupy.ReductionKernel = cuda_cpu.ReductionKernel
        cupy.empty = lambda shape, dtype=float: self.array(
            self._garbage(shape, dtype))
        cupy.zeros = lambda shape, dtype=float: self.array(
            numpy.zeros(shape, dtype))
        cupy.asarray = lambda a, dtype=None: self.array(a, dtype)
        cupy.ascontiguousarray = cupy.asarray
        cupy.cuda.get_current_stream = lambda: types.SimpleNamespace(
            is_capturing=lambda: False)
        cupy.__getattr__ = self._numpy      # what else CuPy has
        self.cupy = cupy

    @staticmethod
    def _numpy(name):
        function = getattr(numpy, name)

        def on_device(*args, **kwargs):
            out = function(*args, **kwargs)
            return out.view(cuda_emulation.Array) if isinstance(
                out, numpy.ndarray) else out
        return on_device

    @staticmethod
    def _garbage(shape, dtype):
        out = numpy.empty(shape, dtype)
        out.view(numpy.uint8)[...] = 0x7F      # NaN in every float dtype
        return out

    def array(self, a, dtype=None):
        """``a`` on the device (a copy between guard bands)."""
        return self.guarded(numpy.asarray(a, dtype)).view(
            cuda_emulation.Array)

    def get_array_module(self, *arrays):
        return self.cupy if any(isinstance(a, cuda_emulation.Array)
                                for a in arrays) else numpy


def _clear_caches():
    for cached in (multi_tensor._kernel, fused._kernels,
                   device_guard._kernels):
        cached.cache_clear()
    del packing._KERNEL[:]


@contextlib.contextmanager
def emulated(schedule, chainer_backend=False):
    """The library's GPU paths on the emulated device, its kernel caches
    cleared before and after; with ``chainer_backend`` Chainer's
    ``get_array_module`` too (what the collectives' packing asks; Chainer's
    own functions would then take their CuPy paths)."""
    dev = Device(schedule)
    original = chainer.backend.get_array_module
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, 'cupy', dev.cupy)
        patch.setattr(multi_tensor, 'MAX_BLOCKS', MAX_BLOCKS)
        for module in (multi_tensor, fused, device_guard, step_bound):
            patch.setattr(module, 'get_array_module', dev.get_array_module)
        if chainer_backend:
            patch.setattr(
                chainer.backend, 'get_array_module',
                lambda *a: dev.cupy if dev.get_array_module(*a) is not numpy
                else original(*a))
        _clear_caches()
        try:
            yield dev
        finally:
            _clear_caches()
    dev.guarded.check()


@pytest.fixture(params=['forward', 'reverse'])
def device(request):
    with emulated(request.param) as dev:
        yield dev


@pytest.fixture(params=['forward', 'reverse'])
def device_for_chainer(request):
    with emulated(request.param, chainer_backend=True) as dev:
        yield dev


def _tensors(rng, sizes, dtype, scale=1.0):
    return [(rng.randn(n) * scale).astype(dtype) for n in sizes]


#: Blocks along x at most, in these tests: the grid-stride loops go
#: round on tensors of more than MAX_BLOCKS × THREADS × 4 = 4,096 elements
#: without the 512 × 256 threads of the library's limit (each a fiber).
MAX_BLOCKS = 4
#: 40 tensors (two launches), sizes across one block's 1,024 elements and
#: past one grid's 4,096, empty slots in the second launch.
SIZES = [1, 7, 255, 256, 257, 1023, 1024, 1025, 5000, 3, 20000] + \
    list(range(30, 59))


# -- the multi-tensor kernels ------------------------------------------------
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
@pytest.mark.parametrize('scalars', ['host', 'device'])
def test_momentum_sgd_is_chainers_expression(device, dtype, scalars):
    rng = numpy.random.RandomState(0)
    groups = [_tensors(rng, SIZES, dtype) for _ in range(3)]
    expected = [[a.copy() for a in g] for g in groups]
    on_device = [[device.array(a) for a in g] for g in groups]
    lr, momentum = 0.05, float(numpy.float32(0.8))
    if scalars == 'device':    # read by the kernel, cast to the dtype
        lr, momentum = (device.array(numpy.float64(lr)),
                        device.array(numpy.float32(momentum)))
    multi_tensor.momentum_sgd(*on_device, lr, momentum)
    multi_tensor.momentum_sgd(*expected, 0.05, float(numpy.float32(0.8)))
    for k in range(len(SIZES)):
        numpy.testing.assert_array_equal(on_device[0][k], expected[0][k])
        numpy.testing.assert_array_equal(on_device[2][k], expected[2][k])
    assert multi_tensor._kernel('momentum_sgd', numpy.dtype(dtype)).launches == 2


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
def test_momentum_step_is_eq19(device, dtype):
    rng = numpy.random.RandomState(1)
    w, d, v = (_tensors(rng, SIZES, dtype) for _ in range(3))
    expected_w, expected_v = [a.copy() for a in w], [a.copy() for a in v]
    w, d, v = ([device.array(a) for a in g] for g in (w, d, v))
    multi_tensor.momentum_step(w, v, d, 0.1, 0.9)
    for k in range(len(SIZES)):
        fused.momentum_step(expected_w[k], expected_v[k],
                            numpy.asarray(d[k]), 0.1, 0.9)
        numpy.testing.assert_array_equal(w[k], expected_w[k])
        numpy.testing.assert_array_equal(v[k], expected_v[k])


def _rescaled_reference(w, v, d, lr, momentum, target):
    """Eq. (20) as the kernels compute it: the unscaled step in the dtype
    (the twin's expression), its norm in float64 (here exactly rounded:
    math.fsum) cast to the dtype, the rescale in the dtype."""
    dtype = w.dtype.type
    unscaled = w + (dtype(momentum) * v - dtype(lr) * d)
    wide = unscaled.astype(numpy.float64)
    norm = dtype(math.sqrt(math.fsum(wide * wide)))
    scaled = unscaled * (dtype(target) / (norm + dtype(fused.RESCALE_EPS)))
    return scaled, scaled - w


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
def test_momentum_step_rescaled_is_eq20(device, dtype):
    """Two launches per chunk: the unscaled step with its blocks' float64
    sums of squares, then the rescale from those sums added in order.
    Against the kernels' arithmetic with an exactly rounded norm: float32
    weights to one unit in the last place (the float64 sum's order can
    flip the norm's rounding to float32), float64 ones to the order's
    error, √n·u per element at most (the twin's norm is the dtype's, so
    it is not the oracle here)."""
    rng = numpy.random.RandomState(2)
    w, d, v = (_tensors(rng, SIZES, dtype) for _ in range(3))
    targets = [float(k + 1) for k in range(len(SIZES))]
    expected = [_rescaled_reference(w[k], v[k], d[k], 0.1, 0.9, targets[k])
                for k in range(len(SIZES))]
    w, d, v = ([device.array(a) for a in g] for g in (w, d, v))
    multi_tensor.momentum_step(w, v, d, 0.1, 0.9, targets)
    for k, (new_w, new_v) in enumerate(expected):
        ulps = 1 if dtype is numpy.float32 else 2 + math.sqrt(SIZES[k])
        tolerance = ulps * 2 * U[dtype] * numpy.abs(new_w)
        assert (numpy.abs(w[k] - new_w) <= tolerance).all(), k
        assert (numpy.abs(v[k] - new_v) <= 2 * tolerance + 2 * U[dtype] *
                numpy.abs(new_v)).all(), k
    assert multi_tensor._kernel('unscaled', numpy.dtype(dtype)).launches == 2
    assert multi_tensor._kernel('rescaled', numpy.dtype(dtype)).launches == 2


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
@pytest.mark.parametrize('where', [None, (0, 0), (10, -1), (39, 5),
                                   (10, 19999)])
@pytest.mark.parametrize('value', [numpy.nan, numpy.inf, -numpy.inf])
def test_flag_nonfinite(device, dtype, where, value):
    rng = numpy.random.RandomState(3)
    arrays = _tensors(rng, SIZES, dtype)
    if where is not None:
        arrays[where[0]][where[1]] = value
    flag = device.array(numpy.zeros(1, numpy.int32))
    multi_tensor.flag_nonfinite([device.array(a) for a in arrays], flag)
    assert flag[0] == (where is not None)


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
def test_bound_terms_against_float64(device, dtype):
    """⟨d, g⟩ + γ⟨d, w⟩ − γμΣd per parameter, float64 from each element
    on: against NumPy's float64 sums to 1e-12 of the sums of magnitudes;
    the two schedules agree bit for bit (no atomics)."""
    rng = numpy.random.RandomState(4)
    d, g, w = (_tensors(rng, SIZES, dtype) for _ in range(3))
    dampings = [numpy.float64(10.0 ** -(k % 4)) for k in range(len(SIZES))]
    means = [0.0 if k % 3 else 0.5 for k in range(len(SIZES))]
    terms = multi_tensor.bound_terms(
        [device.array(a) for a in d], [device.array(a) for a in g],
        [device.array(a) for a in w], [device.array(x) for x in dampings],
        means)
    for k in range(len(SIZES)):
        dk, gk, wk = (numpy.asarray(a[k], numpy.float64) for a in (d, g, w))
        gamma = dampings[k]
        expected = dk.dot(gk) + gamma * dk.dot(wk) - gamma * means[k] * \
            dk.sum()
        magnitude = numpy.abs(dk * gk).sum() + gamma * numpy.abs(
            dk * wk).sum() + gamma * abs(means[k]) * numpy.abs(dk).sum()
        assert abs(terms[k] - expected) <= 1e-12 * magnitude, k


def test_sums_do_not_depend_on_the_threads_order():
    """The block sums of eq. (20)'s norm and of the bound's terms are
    added in a fixed order (no atomics), so the two schedules give the
    same bits: what a CUDA graph's replay relies on."""
    rng = numpy.random.RandomState(13)
    d, g, w = (_tensors(rng, SIZES, numpy.float32) for _ in range(3))
    results = []
    for schedule in ('forward', 'reverse'):
        with emulated(schedule) as dev:
            on = [[dev.array(a) for a in group] for group in (d, g, w)]
            terms = multi_tensor.bound_terms(
                *on, [dev.array(numpy.float64(1e-2))] * len(SIZES),
                [0.5] * len(SIZES))
            velocities = [dev.array(numpy.zeros_like(a)) for a in w]
            multi_tensor.momentum_step(on[2], velocities, on[0], 0.1, 0.9,
                                       [2.0] * len(SIZES))
            results.append([numpy.array(terms)] +
                           [numpy.array(a) for a in on[2]])
    for a, b in zip(*results):
        numpy.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
def test_scale_is_a_cast_product(device, dtype):
    rng = numpy.random.RandomState(5)
    arrays = _tensors(rng, SIZES, dtype)
    on_device = [device.array(a) for a in arrays]
    factor = numpy.float64(0.3)
    multi_tensor.scale(on_device, device.array(factor))
    for a, b in zip(arrays, on_device):
        a *= dtype(factor)
        numpy.testing.assert_array_equal(b, a)


# -- the fused kernels ---------------------------------------------------------
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
@pytest.mark.parametrize('shape', [(3, 5, 7), (2, 3, 256), (2, 4, 257),
                                   (1, 2, 3000)])
def test_bn_sample_grads_rows(device, dtype, shape):
    """One block per (n, c), 64 or 256 threads: against the float64 rows
    through x̂, within the error of two float sums of ``length`` terms."""
    rng = numpy.random.RandomState(6)
    x = rng.randn(*shape) * 2 + 1
    gy = rng.randn(*shape)
    mean = x.mean(axis=(0, 2))
    inv_std = 1 / x.std(axis=(0, 2))
    expected = fused.bn_sample_grads(x, gy, mean, inv_std, numpy.float64)
    rows = fused.bn_sample_grads(
        *(device.array(a, dtype) for a in (x, gy, mean, inv_std)), dtype)
    xhat = (x - mean[:, None]) * inv_std[:, None]
    bound = 4 * shape[2] * U[dtype] * numpy.concatenate(
        [(numpy.abs(gy * x).sum(axis=2) + numpy.abs(mean) *
          numpy.abs(gy).sum(axis=2)) * inv_std,
         numpy.abs(gy).sum(axis=2)], axis=1) + 4 * U[dtype] * numpy.abs(
        numpy.concatenate([(gy * xhat).sum(axis=2), gy.sum(axis=2)], 1))
    assert rows.shape == expected.shape and rows.dtype == dtype
    assert (numpy.abs(rows - expected) <= bound).all()
    kernel = fused._kernels().bn_sample_grads[numpy.dtype(dtype)]
    assert kernel.launches == 1


def test_bn_sample_grads_of_no_samples_launch_nothing(device):
    """An empty batch gives empty rows without the kernel: CuPy would
    launch a grid of at least one block, which writes rows[0]."""
    x = device.array(numpy.zeros((0, 3, 4), numpy.float32))
    stats = device.array(numpy.ones(3, numpy.float32))
    rows = fused.bn_sample_grads(x, x, stats, stats, numpy.float32)
    assert rows.shape == (0, 6)
    assert fused._kernels().bn_sample_grads[
        numpy.dtype(numpy.float32)].launches == 0


@pytest.mark.parametrize('where', [None, (0, 0), (1, -1), (2, 70000), (3, 1)])
def test_all_finite_pointer_table(device, where):
    rng = numpy.random.RandomState(7)
    arrays = [rng.randn(n).astype(t) for n, t in (
        (10, numpy.float32), (100, numpy.float64), (80000, numpy.float32),
        (3, numpy.float16))]
    if where is not None:
        arrays[where[0]][where[1]] = numpy.nan
    assert fused.all_finite([device.array(a) for a in arrays]) == (
        where is None)


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
@pytest.mark.parametrize('rescale', [None, 3.0])
@pytest.mark.parametrize('scalars', ['host', 'device'])
def test_momentum_step_elementwise(device, dtype, rescale, scalars):
    """fused.momentum_step's ElementwiseKernels and norm reduction: the
    twin's arithmetic bit for bit (the reduction adds in the twin's
    order only up to NumPy's pairwise sum: within n·u of the norm)."""
    rng = numpy.random.RandomState(8)
    w, v, d = (rng.randn(5000).astype(dtype) for _ in range(3))
    ew, ev = w.copy(), v.copy()
    lr, momentum = 0.1, 0.9
    if scalars == 'device':
        lr, momentum = device.array(numpy.float64(0.1)), device.array(
            numpy.float64(0.9))
    dw, dv = device.array(w), device.array(v)
    fused.momentum_step(dw, dv, device.array(d), lr, momentum, rescale)
    fused.momentum_step(ew, ev, d, 0.1, 0.9, rescale)
    if rescale is None:
        numpy.testing.assert_array_equal(dw, ew)
        numpy.testing.assert_array_equal(dv, ev)
    else:
        tolerance = 5000 * U[dtype] * 4
        numpy.testing.assert_allclose(dw, ew, rtol=tolerance, atol=0)


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
@pytest.mark.parametrize('mean', [0.0, 0.25])
def test_regularized_grad_is_eq13(device, dtype, mean):
    rng = numpy.random.RandomState(9)
    g, w = (rng.randn(300).astype(dtype) for _ in range(2))
    got = fused.regularized_grad(device.array(g), device.array(w), 1e-3,
                                 mean)
    expected = numpy.asarray(g) + dtype(1e-3) * (w - dtype(mean))
    numpy.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
@pytest.mark.parametrize('scalars', ['host', 'device'])
@pytest.mark.parametrize('mean', [0.0, 1.0])
def test_multi_tensor_regularized_is_eq13(device, dtype, scalars, mean):
    """multi_tensor.regularized: eq. (13) of 40 parameters into their
    slots, two launches, bit for bit the fused kernel's NumPy twin."""
    rng = numpy.random.RandomState(10)
    g, w = (_tensors(rng, SIZES, dtype) for _ in range(2))
    outs = [device.array(numpy.full(n, numpy.nan, dtype)) for n in SIZES]
    damping = 1e-3 if scalars == 'host' else device.array(
        numpy.float64(1e-3))
    multi_tensor.regularized([device.array(a) for a in g],
                             [device.array(a) for a in w], damping, mean,
                             outs)
    assert multi_tensor._kernel('regularized',
                                numpy.dtype(dtype)).launches == 2
    for k in range(len(SIZES)):
        numpy.testing.assert_array_equal(
            outs[k], fused.regularized_grad(g[k], w[k], 1e-3, mean))


class _CaptureRules:
    """CuPy 14's rules while a stream captures, on the emulated device:
    no copy from the host (``cupy.asarray`` of host data), and so no
    ``stack`` / ``concatenate`` of more than 8 arrays of one dtype
    averaging under 2 MiB, which CuPy joins in one kernel after copying a
    table of their pointers from the host
    (``cupy/_core/_routines_manipulation.pyx``,
    ``_concatenate_single_kernel``; ``cupy/cuda/memory.pyx``: "the current
    stream is capturing, so H2D transfers are disallowed")."""

    def __init__(self, dev):
        self.dev, self.capturing = dev, False
        self.joined = []

    def install(self, patch):
        cupy = self.dev.cupy
        for name in ('stack', 'concatenate'):
            patch.setattr(cupy, name, self._joining(getattr(numpy, name)),
                          raising=False)
        asarray = cupy.asarray

        def to_device(a, dtype=None):
            if self.capturing and not isinstance(a, cuda_emulation.Array):
                raise RuntimeError('the current stream is capturing, so '
                                   'H2D transfers are disallowed')
            return asarray(a, dtype)
        patch.setattr(cupy, 'asarray', to_device)

    def _joining(self, function):
        def join(arrays, *args, **kwargs):
            arrays = list(arrays)
            self.joined.append(len(arrays))
            if (self.capturing and len(arrays) > 8 and
                    len({a.dtype for a in arrays}) == 1 and
                    sum(a.nbytes for a in arrays) < 2 ** 21 * len(arrays)):
                raise RuntimeError('the current stream is capturing, so '
                                   'H2D transfers are disallowed')
            return function(arrays, *args, **kwargs).view(
                cuda_emulation.Array)
        return join


@pytest.mark.parametrize('kind', ['kronecker', 'kronecker_bias', 'bn'])
def test_batched_preconditioning_captures_beyond_eight_blocks(device, kind):
    """K-FAC's stage 5 on the GPU batches blocks of equal shapes; ResNet-50
    has 16 BN layers of 256 channels. With CuPy's capture rules modelled
    (:class:`_CaptureRules`), 12 blocks' batched preconditioning runs on
    the emulated device while "capturing" (it stacked with xp.stack
    before: refused there, so the stale step ran eagerly), and equals
    the same function on NumPy; the inverse stack is made before the
    capture (the eager refresh step) and reused."""
    from chainerkfac.fisher_blocks import batch_norm, kronecker
    rules = _CaptureRules(device)
    rng = numpy.random.RandomState(11)
    dtype, count, c = numpy.float32, 12, 5

    def variable(a):
        return types.SimpleNamespace(array=a, shape=a.shape)

    def blocks_on(to):
        made = []
        for k in range(count):
            r = numpy.random.RandomState(100 + k)
            if kind == 'bn':
                link = types.SimpleNamespace(
                    gamma=variable(to(r.randn(c).astype(dtype))),
                    beta=variable(to(r.randn(c).astype(dtype))))
                made.append(types.SimpleNamespace(
                    link=link, channels=c, inverse_count={'F': 1},
                    inverses={'F': to(spd(2 * c, 100 + k).astype(dtype))}))
            else:
                bias = kind == 'kronecker_bias'
                link = types.SimpleNamespace(
                    W=variable(to(r.randn(c, 3, 2, 2).astype(dtype))),
                    b=variable(to(r.randn(c).astype(dtype)))
                    if bias else None)
                made.append(types.SimpleNamespace(
                    link=link, has_bias=bias, out_size=c,
                    inverse_count={'A': 1, 'G': 1},
                    inverses={'A': to(spd(12 + bias, 100 + k).astype(dtype)),
                              'G': to(spd(c, 200 + k).astype(dtype))}))
        return made

    grads = [[rng.randn(*shape).astype(dtype) for shape in (
        [(c,), (c,)] if kind == 'bn' else
        [(c, 3, 2, 2)] + [(c,)] * (kind == 'kronecker_bias'))]
        for _ in range(count)]
    on_device = [[device.array(g) for g in gs] for gs in grads]
    if kind == 'bn':
        run = batch_norm.precondition_batch
        names = ('F',)
    else:
        run = kronecker.precondition_batch
        names = ('A', 'G')
    expected = run(blocks_on(numpy.asarray), grads, 0.01,
                   kronecker.InverseStack(names))
    members = blocks_on(device.array)
    stack = kronecker.InverseStack(names)
    with pytest.MonkeyPatch.context() as patch:
        rules.install(patch)
        for module in (batch_norm, kronecker):
            patch.setattr(module, 'get_array_module',
                          device.get_array_module)
        run(members, on_device, 0.01, stack)      # eager: stacks made
        rules.capturing = True
        got = run(members, on_device, 0.01, stack)
        # a refresh taken in place (a graphed run, eagerly): the stacks a
        # captured step reads keep their arrays and take the new inverse
        stacks = stack.arrays()
        rules.capturing = False
        host_blocks = blocks_on(numpy.asarray)
        for blocks, to in ((host_blocks, numpy.asarray),
                           (members, device.array)):
            name = names[-1]
            new = to(spd(blocks[3].inverses[name].shape[0], 7).astype(dtype))
            blocks[3].inverses[name] = low_rank.refilled(
                blocks[3].inverses[name], new)
            blocks[3].inverse_count[name] += 1
        refreshed = run(members, on_device, 0.01, stack)
        assert all(a is b for a, b in zip(stack.arrays(), stacks))
    assert max(rules.joined, default=0) <= 2
    for directions, wanted in zip(got, expected):
        for a, b in zip(directions, wanted):
            assert isinstance(a, cuda_emulation.Array)
            numpy.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    expected = run(host_blocks, grads, 0.01, kronecker.InverseStack(names))
    for directions, wanted in zip(refreshed, expected):
        for a, b in zip(directions, wanted):
            numpy.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


# -- the device guard's copies and check ---------------------------------------------
@pytest.mark.parametrize('flag_value', [0, 1])
def test_guard_copies_every_item_size(device, flag_value):
    """save, then the arrays change, then restore_where(flag): back to the
    saved bits where the flag is set, for 1-, 2-, 4- and 8-byte items
    (several arrays per size, one wider than a block's stride)."""
    rng = numpy.random.RandomState(10)
    host = [rng.randn(n).astype(t) for n, t in (
        (5, numpy.float16), (70000, numpy.float16), (9, numpy.float32),
        (3000, numpy.float32), (4, numpy.float64), (100, numpy.float64))]
    host.append(rng.randint(0, 255, 33).astype(numpy.uint8))
    arrays = [device.array(a) for a in host]
    copies = device_guard._Copies()
    copies.save(arrays)
    for a in arrays:
        a[...] = a.dtype.type(1)
    flag = device.array(numpy.array([flag_value], numpy.int32))
    copies.restore_where(flag, arrays)
    for a, saved in zip(arrays, host):
        expected = saved if flag_value else numpy.ones_like(saved)
        numpy.testing.assert_array_equal(a.view(numpy.uint8),
                                         expected.view(numpy.uint8))
    for a in arrays:
        a[...] = a.dtype.type(2)
    copies.restore(arrays)
    for a, saved in zip(arrays, host):
        numpy.testing.assert_array_equal(a.view(numpy.uint8),
                                         saved.view(numpy.uint8))


def test_guard_check_flags_strided_and_grouped_arrays(device):
    """The guard's finite check: contiguous float32/float64 arrays go to
    the multi-tensor kernel, a strided view and float16 to the
    elementwise one; any NaN sets the flag, a clean set clears it."""
    rng = numpy.random.RandomState(11)
    base = device.array(rng.randn(6, 8).astype(numpy.float32))
    arrays = [device.array(rng.randn(n)) for n in (3, 500)] + [
        base[:, ::2], device.array(rng.randn(4).astype(numpy.float16))]
    flag = device.array(numpy.ones(1, numpy.int32))
    device_guard._flag_nonfinite(arrays, flag)
    assert flag[0] == 0
    for target, index in ((arrays[1], 499), (arrays[3], 2)):
        target[index] = numpy.nan
        device_guard._flag_nonfinite(arrays, flag)
        assert flag[0] == 1
        target[index] = 0
    base[2, 3] = numpy.inf       # outside the view: not its business
    device_guard._flag_nonfinite(arrays, flag)
    assert flag[0] == 0
    base[2, 4] = numpy.inf
    device_guard._flag_nonfinite(arrays, flag)
    assert flag[0] == 1


# -- the collectives' gather-cast ------------------------------------------------
@pytest.mark.parametrize('source_dtype,dtype', [
    (numpy.float32, numpy.float16), (numpy.float16, numpy.float32),
    (numpy.float64, numpy.float32), (numpy.float32, numpy.float32)])
def test_gather_cast(device_for_chainer, source_dtype, dtype):
    device = device_for_chainer
    rng = numpy.random.RandomState(12)
    source = rng.randn(50).astype(source_dtype)
    index = rng.randint(-1, 50, 80).astype(numpy.int32)
    got = packing.gather_cast(device.array(source), device.array(index),
                              dtype)
    expected = packing.gather_cast(source, index, dtype)
    assert got.dtype == dtype
    numpy.testing.assert_array_equal(got, expected)


# -- the emulation catches what it is for ------------------------------------------
_REDUCE = r'''
extern "C" __global__ void block_sum(const float* x, float* out) {
    __shared__ float s[64];
    s[threadIdx.x] = x[blockIdx.x * 64 + threadIdx.x];
    SYNC
    for (int half = 32; half > 0; half >>= 1) {
        if (threadIdx.x < half) s[threadIdx.x] += s[threadIdx.x + half];
        SYNC
    }
    if (threadIdx.x == 0) out[blockIdx.x] = s[0];
}
'''


def test_a_missing_barrier_shows_as_two_results():
    x = numpy.arange(128, dtype=numpy.float32)
    expected = x.reshape(2, 64).sum(axis=1)
    results = {}
    for sync in ('__syncthreads();', ''):
        for schedule in ('forward', 'reverse'):
            out = numpy.zeros(2, numpy.float32)
            cuda_cpu.RawKernel(_REDUCE.replace('SYNC', sync), 'block_sum',
                               schedule=schedule)((2,), (64,), (x, out))
            results[sync, schedule] = out
    for schedule in ('forward', 'reverse'):
        numpy.testing.assert_array_equal(
            results['__syncthreads();', schedule], expected)
    assert not numpy.array_equal(results['', 'forward'],
                                 results['', 'reverse'])


def test_launch_checks():
    kernel = cuda_cpu.RawKernel(_REDUCE.replace('SYNC', '__syncthreads();'),
                                'block_sum')
    x = numpy.zeros(64, numpy.float32)
    out = numpy.zeros(1, numpy.float32)
    with pytest.raises(cuda_cpu.LaunchError, match='parameter x .*4-byte'):
        kernel((1,), (64,), (x.astype(numpy.float64), out))
    with pytest.raises(cuda_cpu.LaunchError, match='1 arguments for 2 parameters'):
        kernel((1,), (64,), (x,))
    divergent = cuda_cpu.RawKernel(r'''
extern "C" __global__ void split(int* out) {
    if (threadIdx.x < 3) { __syncthreads(); out[0] = 1; }
    else { __syncthreads(); out[1] = 1; }
}''', 'split')
    with pytest.raises(cuda_cpu.LaunchError, match='lines 3 and 4'):
        divergent((1,), (8,), (numpy.zeros(2, numpy.int32),))
    scalar = cuda_cpu.RawKernel(r'''
extern "C" __global__ void put(int* out, const int v, const long long w) {
    out[0] = v; out[1] = (int) w;
}''', 'put')
    out = numpy.zeros(2, numpy.int32)
    with pytest.raises(cuda_cpu.LaunchError, match='v is int .* int64'):
        scalar((1,), (1,), (out, 3, 4))       # a Python int is int64
    scalar((1,), (1,), (out, numpy.int32(3), 4))
    assert out.tolist() == [3, 4]
    guarded = cuda_cpu.Guarded()
    small = guarded(numpy.zeros(1, numpy.int32))
    scalar((1,), (1,), (small, numpy.int32(3), 4))    # writes out[1]
    with pytest.raises(AssertionError, match='outside an array'):
        guarded.check()


# -- the optimizers' device paths end to end ------------------------------------------
def _on_emulated_device(model):
    for param in model.params():
        param.array = param.array.view(cuda_emulation.Array)


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
def test_fused_momentum_sgd_trains_as_chainers(dtype):
    """FusedMomentumSGD with its parameters on the emulated device (one
    kernel per 32 parameters, from the optimizer's own grouping, the
    WeightDecay hook folded in) against Chainer's MomentumSGD on the CPU:
    the same weights bit for bit after six steps, the unused head moved by
    weight decay alike."""
    from tests.chainerkfac.optimizers import test_fused_sgd as sgd
    expected, _ = sgd._state(*sgd._train(sgd._sgd, dtype))
    with emulated('forward'):
        model, optimizer = sgd._train(sgd._fused, dtype,
                                      prepare=_on_emulated_device)
        launches = multi_tensor._kernel('momentum_sgd_wd',
                                        numpy.dtype(dtype)).launches
    got, _ = sgd._state(model, optimizer)
    # 46 parameters: two launches a step, the WeightDecay hook in them
    assert launches == 6 * 2
    for name, (weight, velocity, _) in expected.items():
        numpy.testing.assert_array_equal(got[name][0], weight, name)
        numpy.testing.assert_array_equal(got[name][1], velocity, name)


def test_kfac_update_on_the_device_equals_the_cpu():
    """K-FAC's update (update_rule.apply_all) with its parameters on the
    emulated device: the plain rules in one multi-tensor launch, the
    rescaled one (eq. 20) in two, the hooked and the disabled rule
    through their rules' own kernels (fused.momentum_step's
    ElementwiseKernels); against the same update on the CPU, two steps:
    bit for bit but for eq. (20)'s norm, whose sum is float64 on the
    device."""
    from chainerkfac.optimizers import update_rule
    from tests.chainerkfac.optimizers import test_fused_sgd as sgd
    plain, directions = sgd._kfac_params(4)
    on_device, _ = sgd._kfac_params(4)
    for params in (plain, on_device):
        for param in params:
            param.array = numpy.asarray(param.array)
    directions = [numpy.asarray(d) for d in directions]
    with emulated('reverse'):
        for param in on_device:
            param.array = param.array.view(cuda_emulation.Array)
        for step in range(2):
            update_rule.apply_all(list(zip(
                on_device, [d.view(cuda_emulation.Array)
                            for d in directions])))
            update_rule.apply_all(list(zip(plain, directions)))
        launches = {op: multi_tensor._kernel(
            op, numpy.dtype(numpy.float32)).launches
            for op in ('momentum_step', 'unscaled', 'rescaled')}
        elementwise = fused._kernels().momentum.launches
    assert launches == {'momentum_step': 2, 'unscaled': 2, 'rescaled': 2}
    assert elementwise == 2        # the hooked rule, twice
    for k, (a, b) in enumerate(zip(on_device, plain)):
        if k == 0:     # eq. (20): the norm's sum in float64 on the device
            numpy.testing.assert_allclose(a.array, b.array, rtol=4e-7)
            continue
        numpy.testing.assert_array_equal(a.array, b.array)
        if b.update_rule.state is not None:
            numpy.testing.assert_array_equal(a.update_rule.state['v'],
                                             b.update_rule.state['v'])


@pytest.mark.parametrize('kl_clip', [1e-3, 1e6])
def test_bounded_step_on_the_device_equals_the_cpu(kl_clip):
    """StepBound.apply_on_device's GPU path (the multi-tensor terms and
    scaling) on the emulated device against its NumPy path on the same
    float64 values: ν and every scaled direction to float64 rounding (the
    sums run in another order)."""
    from tests.chainerkfac import test_step_bound as bound_tests
    reference = step_bound.StepBound(kl_clip)
    terms, scaled, lr = bound_tests._bound_inputs(numpy.ndarray)
    reference.apply_on_device(terms, scaled, lr)
    with emulated('forward'):
        bound = step_bound.StepBound(kl_clip)
        device_terms, device_scaled, device_lr = bound_tests._bound_inputs(
            cuda_emulation.Array)
        bound.apply_on_device(device_terms, device_scaled, device_lr)
        launches = [multi_tensor._kernel(op, numpy.dtype(numpy.float64))
                    .launches for op in ('dots', 'terms', 'scale')]
    assert launches == [1, 1, 1]
    bound_tests.assert_bounds_agree(bound, device_scaled, reference, scaled,
                                    kl_clip)


class _GuardedNet(chainer.Chain):
    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.fc = chainer.links.Linear(4, 6)
            self.bn = chainer.links.BatchNormalization(6)
            self.out = chainer.links.Linear(6, 3)

    def forward(self, x):
        return self.out(chainer.functions.relu(self.bn(self.fc(x))))


def _guarded_run(on_device):
    """Four steps under a DeviceStepGuard, the third with a NaN gradient:
    the weights, velocities and running statistics after each checkpoint
    and after each update, and the skipped steps."""
    numpy.random.seed(0)
    model = _GuardedNet()
    optimizer = chainer.optimizers.MomentumSGD(lr=0.1).setup(model)
    if on_device:
        _on_emulated_device(model)
        model.bn.avg_mean = model.bn.avg_mean.view(cuda_emulation.Array)
        model.bn.avg_var = model.bn.avg_var.view(cuda_emulation.Array)
    guard = device_guard.DeviceStepGuard()
    rng = numpy.random.RandomState(1)
    history = []

    def record():
        history.append([numpy.array(a) for a in device_guard._update_arrays(
            list(model.params())) + device_guard._persistent_arrays(model)])
    for step in range(4):
        guard.checkpoint(model)
        record()
        x = rng.randn(5, 4).astype(numpy.float32)
        t = rng.randint(0, 3, 5).astype(numpy.int32)
        model.cleargrads()
        chainer.functions.softmax_cross_entropy(model(x), t).backward()
        if step == 2:
            model.fc.W.grad[1, 2] = numpy.nan
        grads = [p.grad for p in model.params()]
        if guard.check(grads):
            optimizer.update()
        record()
    return history, guard.skipped_steps


def test_device_step_guard_skips_as_on_the_cpu():
    """The device guard's copies, finite check and restore kernels at work:
    a step with a NaN gradient is launched, then undone at the next
    checkpoint (weights, velocities and BN statistics back to their bits
    before it), as the CPU guard undoes it; one step counted skipped."""
    cpu, cpu_skipped = _guarded_run(False)
    with emulated('forward'):
        device, skipped = _guarded_run(True)
        copies = device_guard._kernels().restore_where[4].launches
    assert skipped == cpu_skipped == 1
    assert copies >= 2
    for step, (a, b) in enumerate(zip(device, cpu)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            numpy.testing.assert_array_equal(x, y, err_msg=str(step))
    # the NaN step was launched (its update wrote NaN), and the next
    # checkpoint put back the bits from before it
    assert not all(numpy.isfinite(x).all() for x in device[5])
    for x, y in zip(device[3], device[6]):
        numpy.testing.assert_array_equal(x, y)
