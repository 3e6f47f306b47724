"""Convolution factors without im2col (fisher_blocks/patches.py) against
patches cut by explicit loops, in float64, for both ways of forming A; the
fp16 paths against their rounding twins; the CuPy path against NumPy."""
import numpy
import pytest

from chainer.utils import conv

from chainerkfac.fisher_blocks import patches
from chainerkfac.fisher_blocks.patches import ConvGeometry
from tests.gpu import support


def loop_patches(x, g):
    """Patches by explicit loops over output locations: rows (n, location),
    columns (c, i, j); taps outside the input read 0 (padding and the
    extra ``cover_all`` row/column)."""
    n, c, h, w = x.shape
    oh = conv.get_conv_outsize(h, g.kh, g.sy, g.ph, g.cover_all, g.dy)
    ow = conv.get_conv_outsize(w, g.kw, g.sx, g.pw, g.cover_all, g.dx)
    rows = numpy.zeros((n, oh * ow, c * g.kh * g.kw))
    for i in range(oh):
        for j in range(ow):
            patch = numpy.zeros((n, c, g.kh, g.kw))
            for a in range(g.kh):
                for b in range(g.kw):
                    u = i * g.sy + a * g.dy - g.ph
                    v = j * g.sx + b * g.dx - g.pw
                    if 0 <= u < h and 0 <= v < w:
                        patch[:, :, a, b] = x[:, :, u, v]
            rows[:, i * ow + j] = patch.reshape(n, -1)
    return rows


def loop_gram(x, g, scale, bias=False):
    rows = loop_patches(x, g)
    if bias:
        rows = numpy.concatenate([rows, numpy.ones(rows.shape[:2] + (1,))],
                                 axis=2)
    return numpy.einsum('nli,nlj->ij', rows, rows) * scale


# (height, width), geometry: padding, stride, dilation, cover_all,
# rectangular kernels, kernels wider than the input, 1x1 subsampling.
CASES = [
    ((6, 6), ConvGeometry(3, 3, 1, 1, 1, 1)),
    ((5, 7), ConvGeometry(3, 3, 1, 1, 0, 0)),
    ((6, 5), ConvGeometry(3, 3, 1, 1, 2, 2, 2, 2)),
    ((7, 6), ConvGeometry(2, 3, 1, 1, 1, 0, 1, 2)),
    ((4, 6), ConvGeometry(3, 1, 1, 1, 1, 0)),
    ((6, 6), ConvGeometry(5, 5, 1, 1, 4, 1)),
    ((2, 2), ConvGeometry(3, 3, 1, 1, 1, 1)),
    ((1, 5), ConvGeometry(3, 3, 1, 1, 1, 1, 1, 2)),
    ((3, 3), ConvGeometry(3, 3, 1, 1, 3, 3)),
    ((6, 6), ConvGeometry(3, 3, 2, 2, 1, 1)),
    ((7, 6), ConvGeometry(3, 3, 2, 1, 1, 0, cover_all=True)),
    ((7, 7), ConvGeometry(3, 2, 3, 2, 2, 1, 2, 1, cover_all=True)),
    ((6, 6), ConvGeometry(1, 1)),
    ((6, 5), ConvGeometry(1, 1, 2, 2)),
    ((5, 5), ConvGeometry(1, 1, 2, 1, 1, 2)),
    # the shifted product's border terms: a 1×1 image (every row and
    # column outside some tap's window), padding less than half the
    # kernel, a row kernel, valid padding with dilation (several rows and
    # columns per side)
    ((1, 1), ConvGeometry(3, 3, 1, 1, 1, 1)),
    ((9, 4), ConvGeometry(5, 3, 1, 1, 1, 2)),
    ((4, 9), ConvGeometry(1, 3, 1, 1, 0, 1)),
    ((9, 8), ConvGeometry(3, 3, 1, 1, 0, 0, 3, 2)),
]


def strategies(shape, g):
    return sorted(patches.strategy_costs(shape, g))


@pytest.mark.parametrize('bias', [False, True])
@pytest.mark.parametrize('size,geometry', CASES)
def test_patch_gram_equals_loop_patches(size, geometry, bias):
    x = numpy.random.RandomState(0).randn(3, 2, *size)
    expected = loop_gram(x, geometry, 1.0 / 3, bias)
    for strategy in strategies(x.shape, geometry):
        got = patches.patch_gram(x, geometry, 1.0 / 3, append_ones=bias,
                                 strategy=strategy)
        assert got.dtype == numpy.float64
        numpy.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12,
                                      err_msg=strategy)
        numpy.testing.assert_array_equal(got, got.T)


def test_shifted_applies_to_stride_one_kernels_only():
    shape = (2, 3, 8, 8)
    assert strategies(shape, ConvGeometry(3, 3)) == ['shifted', 'unfolded']
    assert strategies(shape, ConvGeometry(1, 3)) == ['shifted', 'unfolded']
    assert strategies(shape, ConvGeometry(3, 3, 2, 1)) == ['unfolded']
    assert strategies(shape, ConvGeometry(1, 1)) == ['unfolded']
    with pytest.raises(ValueError, match='shifted'):
        patches.patch_gram(numpy.zeros(shape), ConvGeometry(1, 1), 1.0,
                           strategy='shifted')


def test_geometry_of_a_convolution_call():
    import chainer
    import chainer.functions as F
    seen = []

    class Hook(chainer.FunctionHook):
        def forward_preprocess(self, function, in_data):
            seen.append(ConvGeometry.of(function, in_data[1].shape[2:]))

    x = numpy.zeros((1, 2, 9, 9), numpy.float32)
    w = numpy.zeros((4, 2, 3, 2), numpy.float32)
    with Hook():
        F.convolution_2d(x, w, stride=(2, 1), pad=(1, 0), dilate=(1, 3),
                         cover_all=True)
    assert seen == [ConvGeometry(3, 2, 2, 1, 1, 0, 1, 3, True)]
    assert seen[0].out_size(9, 9) == (5, 6)


@pytest.mark.parametrize('shape', [(4, 3, 5, 6), (2, 5, 1, 7)])
def test_channel_gram_is_gram_of_channel_vectors(shape):
    y = numpy.random.RandomState(1).randn(*shape)
    rows = y.transpose(0, 2, 3, 1).reshape(-1, shape[1])
    numpy.testing.assert_allclose(patches.channel_gram(y, 0.25),
                                  rows.T.dot(rows) * 0.25, rtol=1e-12)


@pytest.mark.parametrize('geometry', [ConvGeometry(3, 3, 1, 1, 1, 1),
                                      ConvGeometry(3, 3, 2, 2, 1, 1)])
def test_float32_strategies_agree_on_a_resnet_layer(geometry):
    x = numpy.random.RandomState(2).randn(8, 16, 16, 16).astype(numpy.float32)
    exact = loop_gram(x.astype(numpy.float64), geometry, 1.0 / 8)
    for strategy in strategies(x.shape, geometry):
        got = patches.patch_gram(x, geometry, 1.0 / 8, strategy=strategy)
        assert got.dtype == numpy.float32
        numpy.testing.assert_allclose(got, exact, rtol=1e-4, atol=1e-4)


def half_rounded(x, scale):
    """x scaled as the fp16 paths scale it, rounded to fp16, back in fp32."""
    peak = numpy.float32(numpy.abs(x).max())
    factor = numpy.float32(numpy.sqrt(scale)) / peak
    return (x * factor).astype(numpy.float16).astype(numpy.float32), peak


def test_unfolded_fp16_twin_rounds_inputs_and_output():
    x = numpy.random.RandomState(3).randn(4, 3, 6, 6).astype(numpy.float32)
    x[0, 0, 0, 0] = -7.0    # the peak is a negative value
    g = ConvGeometry(3, 3, 2, 2, 1, 1)
    half, peak = half_rounded(x, 0.25)
    columns = numpy.ascontiguousarray(
        loop_patches(half, g).reshape(-1, 27).T.astype(numpy.float32))
    # The twin's product: fp32 GEMM of the fp16 values (two buffers, so
    # the same BLAS call), rounded to fp16.
    product = numpy.matmul(columns, columns.copy().T)
    expected = product.astype(numpy.float16).astype(numpy.float32) * (
        peak * peak)
    got = patches.patch_gram(x, g, 0.25, numpy.float16, strategy='unfolded')
    assert got.dtype == numpy.float32
    numpy.testing.assert_allclose(got, expected, rtol=1e-6)


@pytest.mark.parametrize('bias', [False, True])
@pytest.mark.parametrize('size,geometry', [CASES[0], CASES[2], CASES[9],
                                           CASES[13]])
def test_fp16_factors_close_to_exact(size, geometry, bias):
    x = numpy.random.RandomState(4).randn(16, 4, *size).astype(numpy.float32)
    exact = loop_gram(x.astype(numpy.float64), geometry, 1.0 / 16, bias)
    for strategy in strategies(x.shape, geometry):
        got = patches.patch_gram(x, geometry, 1.0 / 16, numpy.float16,
                                 append_ones=bias, strategy=strategy)
        # fp16 inputs (2^-11 relative) and fp16 sums (2^-11 of the sum).
        assert numpy.abs(got - exact).max() <= 3e-3 * numpy.abs(exact).max()
        numpy.testing.assert_array_equal(got, got.T)


def test_fp16_channel_gram_does_not_overflow():
    y = numpy.full((64, 2, 32, 32), 300.0, numpy.float32)  # Σ y² = 5.9e9
    value = patches.channel_gram(y, 1.0 / 64, numpy.float16)
    numpy.testing.assert_allclose(value, 300.0 ** 2 * 32 * 32, rtol=1e-3)


def test_fp64_input_gives_fp64_factor_in_fp16_mode():
    x = numpy.random.RandomState(5).randn(2, 2, 4, 4)
    for strategy in strategies(x.shape, ConvGeometry(3, 3, 1, 1, 1, 1)):
        got = patches.patch_gram(x, ConvGeometry(3, 3, 1, 1, 1, 1), 0.5,
                                 numpy.float16, strategy=strategy)
        assert got.dtype == numpy.float64


# -- GPU: the CuPy path against the NumPy one ---------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize('dtype', ['float32', 'float16'])
@pytest.mark.parametrize('bias', [False, True])
@pytest.mark.parametrize('size,geometry', CASES)
def test_gpu_patch_gram_equals_numpy(size, geometry, bias, dtype):
    cupy = support.cupy_or_skip()
    x = numpy.random.RandomState(6).randn(5, 3, *size).astype(numpy.float32)
    for strategy in strategies(x.shape, geometry):
        cpu = patches.patch_gram(x, geometry, 0.2, dtype, bias, strategy)
        gpu = patches.patch_gram(cupy.asarray(x), geometry, 0.2, dtype, bias,
                                 strategy)
        assert isinstance(gpu, cupy.ndarray) and gpu.dtype == cpu.dtype
        # fp32: summation order; fp16: one fp16 rounding of the sums.
        tol = 1e-5 if dtype == 'float32' else 2e-3
        numpy.testing.assert_allclose(cupy.asnumpy(gpu), cpu, rtol=tol,
                                      atol=tol * numpy.abs(cpu).max())


@pytest.mark.gpu
def test_gpu_timed_strategy_equals_numpy(monkeypatch):
    """With ``chainer.config.autotune`` the GPU times both ways once per
    input shape (they agree, or the shifted one is not chosen) and keeps
    the faster: either gives NumPy's factor."""
    import chainer
    cupy = support.cupy_or_skip()
    monkeypatch.setattr(patches, '_TIMED', {})
    g = ConvGeometry(3, 3, 1, 1, 1, 1)
    x = numpy.random.RandomState(13).randn(8, 16, 14, 14).astype(
        numpy.float32)
    cpu = patches.patch_gram(x, g, 0.125, strategy='unfolded')
    with chainer.using_config('autotune', True):
        for _ in range(2):
            gpu = patches.patch_gram(cupy.asarray(x), g, 0.125)
            numpy.testing.assert_allclose(
                cupy.asnumpy(gpu), cpu, rtol=0,
                atol=1e-5 * numpy.abs(cpu).max())
    assert len(patches.timed_choices()) == 1


@pytest.mark.gpu
@pytest.mark.parametrize('dtype', ['float32', 'float16'])
def test_gpu_channel_gram_equals_numpy(dtype):
    cupy = support.cupy_or_skip()
    y = numpy.random.RandomState(7).randn(8, 6, 5, 4).astype(numpy.float32)
    cpu = patches.channel_gram(y, 0.5, dtype)
    gpu = patches.channel_gram(cupy.asarray(y), 0.5, dtype)
    tol = 1e-5 if dtype == 'float32' else 2e-3
    numpy.testing.assert_allclose(cupy.asnumpy(gpu), cpu, rtol=tol,
                                  atol=tol * numpy.abs(cpu).max())


def test_cases_cover_both_strategies():
    kinds = [strategies((1, 1) + size, g) for size, g in CASES]
    assert sum(k == ['shifted', 'unfolded'] for k in kinds) >= 12
    assert sum(k == ['unfolded'] for k in kinds) >= 5


@pytest.mark.parametrize('half', [False, True])
def test_split_k_column_gram_equals_product(half):
    matrix = numpy.random.RandomState(8).randn(5, 96).astype(numpy.float32)
    exact = matrix.astype(numpy.float64).dot(matrix.T)
    operand = matrix.astype(numpy.float16) if half else matrix
    for pieces in (1, 3, 96, None):
        got = patches.column_gram(operand, half, numpy.dtype(numpy.float32),
                                  pieces)
        assert got.dtype == numpy.float32
        numpy.testing.assert_allclose(got, exact, rtol=3e-3 if half else 1e-5,
                                      atol=3e-2 if half else 1e-4)
    # fp16: each piece's sum rounded once to fp16, then summed in fp32.
    # Integers: exact fp32 sums in any order, fp16 rounding above 2048.
    integers = numpy.random.RandomState(9).randint(-16, 17, (5, 96))
    operand = integers.astype(numpy.float16 if half else numpy.float32)
    wide = integers.reshape(5, 3, 32)
    expected = numpy.einsum('ipk,jpk->pij', wide, wide).astype(numpy.float32)
    if half:
        expected = expected.astype(numpy.float16).astype(numpy.float32)
        assert not numpy.array_equal(expected.sum(axis=0),
                                     integers.dot(integers.T))
    numpy.testing.assert_array_equal(
        patches.column_gram(operand, half, numpy.dtype(numpy.float32), 3),
        expected.sum(axis=0))


class _OnDevice(numpy.ndarray):
    """A NumPy array that the Gram code takes for a device array."""


def _device_gemm(monkeypatch):
    """Our cuBLAS handle over the computing cuBLAS stand-in, serving
    :class:`_OnDevice` arrays, installed as the process's: ``(fake,
    gemm)``."""
    from chainerkfac.graphs import gemm as gemm_module
    from tests.chainerkfac.graphs.cublas_fake import FakeCublas, NumpyArrays

    class Arrays(NumpyArrays):
        def serves(self, array):
            return isinstance(array, _OnDevice)

        def empty(self, shape, dtype):
            return super().empty(shape, dtype).view(_OnDevice)

    fake = FakeCublas()
    gemm = gemm_module.Gemm(fake.library(), Arrays())
    monkeypatch.setattr(gemm_module, '_gemm', gemm)
    return fake, gemm


def _strided_operands(args, half):
    """A recorded ``cublas?gemmStridedBatched(Ex)`` call's ``(pointer, ld,
    stride)`` of cuBLAS's A, then of its B: for the row-major ``a @ b``,
    cuBLAS computes the column-major ``bᵀ aᵀ``, so its A is our ``b`` and
    its B our ``a``."""
    typed = 1 if half else 0
    b_at, a_at = 7, 10 + typed
    return ((args[b_at],) + tuple(args[b_at + 1 + typed:b_at + 3 + typed]),
            (args[a_at],) + tuple(args[a_at + 1 + typed:a_at + 3 + typed]))


@pytest.mark.parametrize('tf32, half', [(False, False), (True, False),
                                        (False, True)],
                         ids=['exact', 'tf32', 'fp16'])
@pytest.mark.parametrize('pieces', [1, 4])
def test_gpu_column_gram_reads_the_patches_in_place(monkeypatch, tf32, half,
                                                    pieces):
    """On the GPU the split-K pieces go to our cuBLAS handle as views of
    the patch matrix (rows K apart, pieces K / pieces apart, the second
    operand as the first's transpose with cuBLAS's flag): no copy, where
    CuPy's matmul copied both operands (here a computing cuBLAS stand-in
    reads memory as cuBLAS does; any copy or CuPy matmul fails the
    test). The result is the exact Gram (float64), TF32's (float32) or
    the fp16 twin's (integers: exact but for fp16's rounding)."""
    import types
    from chainerkfac import linalg

    def refused(*args, **kwargs):
        raise AssertionError('the patches were copied or CuPy multiplied')

    fake_cupy = types.SimpleNamespace(matmul=refused,
                                      ascontiguousarray=refused)
    fake, gemm = _device_gemm(monkeypatch)
    monkeypatch.setattr(linalg, 'get_array_module', lambda *a: (
        fake_cupy if isinstance(a[0], _OnDevice) else numpy))
    rng = numpy.random.RandomState(10)
    if half:
        matrix = rng.randint(-30, 31, (6, 64)).astype(numpy.float16)
        out_dtype = numpy.dtype(numpy.float32)
    else:
        out_dtype = numpy.dtype(numpy.float32 if tf32 else numpy.float64)
        matrix = rng.randn(6, 64).astype(out_dtype)
    got = patches.column_gram(matrix.view(_OnDevice), half, out_dtype,
                              pieces, tf32=tf32)
    twin = patches.column_gram(matrix, half, out_dtype, pieces, tf32=tf32)
    if half:
        numpy.testing.assert_array_equal(got, twin)
    else:
        numpy.testing.assert_allclose(got, twin,
                                      rtol=1e-6 if tf32 else 1e-14)
    call, = fake.calls[-1:]
    assert call[0] == {(False, False): 'cublasDgemmStridedBatched',
                       (True, False): 'cublasSgemmStridedBatched',
                       (False, True): 'cublasGemmStridedBatchedEx'}[
                           tf32, half]
    args = call[1]
    # both operands the patch matrix itself, read in place
    assert _strided_operands(args, half) == (
        (matrix.ctypes.data, 64, 64 // pieces),) * 2
    assert args[1:3] == (1, 0)       # B = Aᵀ by cuBLAS's flag
    gemm.close()


class _DeviceModule:
    """NumPy taken for CuPy: its arrays are :class:`_OnDevice`; ``matmul``
    is refused (every product must go to our cuBLAS handle)."""

    def __init__(self):
        self.made = []

    def matmul(self, *args, **kwargs):
        raise AssertionError('a product went to CuPy\'s matmul')

    def __getattr__(self, name):
        function = getattr(numpy, name)

        def on_device(*args, **kwargs):
            result = function(*args, **kwargs)
            if isinstance(result, numpy.ndarray):
                result = result.view(_OnDevice)
                self.made.append(result)
            return result
        return on_device


@pytest.mark.parametrize('tf32, half', [(False, False), (True, False),
                                        (False, True)],
                         ids=['exact', 'tf32', 'fp16'])
def test_gpu_shifted_gram_goes_to_cublas_in_place(monkeypatch, tf32, half):
    """On the GPU the shifted product is a few cuBLAS calls: the full
    term one split-K call reading the shifted operands where they are
    (``(2kw − 1)·C`` by ``kh·C`` per position), one batched call per
    kind of border term (rows, columns, cells), and one for the blocks'
    weighted sums; no CuPy matmul. Its result is NumPy's: to 1e-14 in
    float64, TF32's operands (float32), or the fp16 twin's."""
    from chainerkfac import linalg

    device = _DeviceModule()
    fake, gemm = _device_gemm(monkeypatch)
    for module in (linalg, patches):
        monkeypatch.setattr(module, 'get_array_module', lambda *a: (
            device if isinstance(a[0], _OnDevice) else numpy))
    monkeypatch.setattr(patches, 'SPLIT_K_CHUNK', 64)
    g = ConvGeometry(3, 3, 1, 1, 1, 1)
    dtype = numpy.float64 if not (tf32 or half) else numpy.float32
    x = numpy.random.RandomState(11).randn(4, 3, 5, 6).astype(dtype)
    factor_dtype = numpy.float16 if half else dtype
    got = patches.patch_gram(x.view(_OnDevice), g, 0.25, factor_dtype,
                             strategy='shifted', tf32=tf32)
    twin = patches.patch_gram(x, g, 0.25, factor_dtype, strategy='shifted',
                              tf32=tf32)
    assert isinstance(got, _OnDevice) and got.dtype == twin.dtype
    numpy.testing.assert_array_equal(got, got.T)
    # summed in another order (split-K pieces): a few roundings of the
    # largest entry (2^-53 in float64, 2^-24 in float32); fp16 rounds
    # each piece's sum (2^-11) where NumPy's twin rounds the whole one
    numpy.testing.assert_allclose(got, twin, rtol=0, atol={
        (False, False): 1e-14, (True, False): 1e-6, (False, True): 2e-3}[
            tf32, half] * numpy.abs(twin).max())
    if not half:   # the twin against im2col's product
        numpy.testing.assert_allclose(
            twin, patches.patch_gram(x, g, 0.25, strategy='unfolded',
                                     tf32=tf32),
            rtol=1e-5 if tf32 else 1e-13, atol=1e-5 if tf32 else 1e-13)
    gemms = [args for name, args in fake.calls if 'gemm' in name.lower()]
    assert len(gemms) == 5           # full, rows, columns, cells, blocks
    positions, pieces, _, _ = patches._shifted_layout(5, 6, 4, g, device)
    assert pieces > 1
    assert positions % (pieces * patches.POSITION_ALIGN) == 0
    left, = [a for a in device.made if a.shape == (5, 3, positions)]
    right, = [a for a in device.made if a.shape == (3, 3, positions)]
    args = gemms[0]
    # cuBLAS's A is our right operand (transposed by its flag), its B our
    # left; both read where they are, K = positions / pieces
    assert args[3:6] == (9, 15, positions // pieces)
    assert _strided_operands(args, half) == (
        (right.ctypes.data, positions, positions // pieces),
        (left.ctypes.data, positions, positions // pieces))
    assert args[1:3] == (1, 0)
    assert args[-3 if half else -1] == pieces     # the batch count
    gemm.close()


def test_shifted_layout_aligns_the_gpus_pieces():
    """ResNet-50's res2 3×3 layer at batch 32: its image is 56 rows of
    (56 + 2)·32 positions, 103,936; on the GPU 25 split-K pieces, each
    now a multiple of 8 elements (4,160, 32 bytes in fp32) where they
    were 4,158 apart; on NumPy one product over the image itself."""
    g = ConvGeometry(3, 3, 1, 1, 1, 1)
    positions, pieces, front, length = patches._shifted_layout(
        56, 56, 32, g, _DeviceModule())
    assert pieces == 25 and positions == 104000
    assert (positions // pieces) % patches.POSITION_ALIGN == 0
    assert length == front + positions + 2 * 58 * 32
    assert patches._shifted_layout(56, 56, 32, g, numpy)[:2] == (103936, 1)


class _Stream:
    capturing = False

    def is_capturing(self):
        return self.capturing


@pytest.fixture
def timed_device(monkeypatch):
    """A device (:class:`_DeviceModule` with a CUDA stream) whose two ways
    of forming A are NumPy's, counted, and whose timer reports scripted
    seconds; a fresh table of timed choices."""
    import types
    device = _DeviceModule()
    stream = _Stream()
    device.cuda = types.SimpleNamespace(get_current_stream=lambda: stream)
    monkeypatch.setattr(patches, 'get_array_module', lambda *a: (
        device if isinstance(a[0], _OnDevice) else numpy))
    monkeypatch.setattr(patches, '_TIMED', {})
    state = types.SimpleNamespace(calls=[], seconds={}, stream=stream,
                                  shifted=None)
    for way, original in (('unfolded', patches._unfolded_gram),
                          ('shifted', patches._shifted_gram)):
        def counted(x, *args, way=way, original=original):
            state.calls.append(way)
            if way == 'shifted' and state.shifted is not None:
                return state.shifted(x.view(numpy.ndarray), *args)
            return original(x.view(numpy.ndarray), *args)
        monkeypatch.setattr(patches, '_{}_gram'.format(way), counted)

    def timed(xp, run):
        before = len(state.calls)
        result = run()
        return result, state.seconds[state.calls[before]]
    monkeypatch.setattr(patches, '_timed', timed)
    return state


def test_gpu_strategy_timed_under_autotune(timed_device, caplog):
    """On the GPU, with ``chainer.config.autotune``, A's two ways are
    timed once per input shape (after a warm-up of each) and the faster
    kept; without autotune the unfolded way, untimed; while a CUDA graph
    is being captured the way timed for that shape (a replayed refresh
    step forms A as an eager one), else the unfolded way, untimed. A way
    that fails or disagrees is not chosen."""
    import chainer
    g = ConvGeometry(3, 3, 1, 1, 1, 1)
    x = numpy.random.RandomState(12).randn(2, 3, 6, 6)
    state = timed_device
    state.seconds = {'unfolded': 2.0, 'shifted': 1.0}

    def gram(array):
        state.calls.clear()
        got = patches.patch_gram(array.view(_OnDevice), g, 0.5)
        numpy.testing.assert_allclose(got, loop_gram(array, g, 0.5),
                                      rtol=1e-12, atol=1e-12)
        return list(state.calls)

    assert gram(x) == ['unfolded'] and not patches.timed_choices()
    with chainer.using_config('autotune', True):
        assert gram(x) == ['unfolded'] * 2 + ['shifted'] * 2
        assert list(patches.timed_choices().values()) == ['shifted']
        assert gram(x) == ['shifted']          # the choice is kept
        state.stream.capturing = True
        assert gram(x[:1]) == ['unfolded']     # no timing in a capture
        assert gram(x) == ['shifted']          # ... but the timed choice
        state.stream.capturing = False
        state.seconds = {'unfolded': 1.0, 'shifted': 2.0}
        assert gram(x[:1]) == ['unfolded'] * 2 + ['shifted'] * 2
        assert sorted(patches.timed_choices().values()) == [
            'shifted', 'unfolded']
        # a way that fails, or whose factor differs, is not chosen
        state.seconds = {'unfolded': 2.0, 'shifted': 1.0}

        def fails(*args):
            raise RuntimeError('no kernel')
        state.shifted = fails
        assert gram(x[:, :2]) == ['unfolded'] * 2 + ['shifted']
        assert 'no kernel' in caplog.text
        state.shifted = _shifted_off
        assert gram(x[:, :1]) == ['unfolded'] * 2 + ['shifted'] * 2
        assert 'differs' in caplog.text
        assert patches.timed_choices()[next(
            k for k in patches.timed_choices() if k[0] == (2, 1, 6, 6))] == \
            'unfolded'


def _shifted_off(x, geometry, scale, *args):
    """The factor with the input's first row left out: what a wrong border
    term would give."""
    wrong = x.copy()
    wrong[:, :, 0] = 0.0
    return loop_gram(wrong, geometry, scale)
