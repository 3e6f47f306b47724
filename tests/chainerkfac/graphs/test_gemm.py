"""chainerkfac.graphs.gemm on a CPU against a computing cuBLAS stand-in
(tests/chainerkfac/graphs/cublas_fake.py): the row-major GEMMs equal
NumPy's for every transposition, 2-D and batched; the handle's stream and
workspace; Chainer's Linear routed through it gives Chainer's own results.
Exact comparisons: the stand-in and NumPy compute the same products in
float64 (BLAS), the tolerance covers their different summation orders."""
import numpy
import pytest

import chainer
import chainer.functions as F

from chainerkfac import linalg
from chainerkfac.graphs import cublas
from chainerkfac.graphs import gemm as gemm_module
from tests.chainerkfac.graphs.cublas_fake import FakeCublas, NumpyArrays


@pytest.fixture
def gemm():
    fake = FakeCublas()
    g = gemm_module.Gemm(fake.library(), NumpyArrays())
    g.fake = fake
    yield g
    g.close()
    assert not fake.live


def _relative(got, expected):
    return float(abs(got - expected).max() / abs(expected).max())


@pytest.mark.parametrize('dtype, tol', [(numpy.float64, 1e-14),
                                        (numpy.float32, 1e-6)])
@pytest.mark.parametrize('transa', [False, True])
@pytest.mark.parametrize('transb', [False, True])
@pytest.mark.parametrize('batch', [None, 3])
def test_matmul_equals_numpy(gemm, dtype, tol, transa, transb, batch):
    rng = numpy.random.RandomState(0)
    m, k, n = 5, 7, 4
    lead = () if batch is None else (batch,)
    a = rng.randn(*(lead + ((k, m) if transa else (m, k)))).astype(dtype)
    b = rng.randn(*(lead + ((n, k) if transb else (k, n)))).astype(dtype)
    got = gemm.matmul(a, b, transa, transb)
    op_a = numpy.swapaxes(a, -1, -2) if transa else a
    op_b = numpy.swapaxes(b, -1, -2) if transb else b
    assert got.shape == lead + (m, n) and got.dtype == dtype
    assert _relative(got, numpy.matmul(op_a, op_b)) < tol
    name = ('cublasDgemm' if dtype == numpy.float64 else 'cublasSgemm') + (
        '_v2' if batch is None else 'StridedBatched')
    call, = gemm.fake.named(name)
    # the operands swapped, each with its own flag
    assert call[1:3] == (cublas.CUBLAS_OP_T if transb else cublas.CUBLAS_OP_N,
                         cublas.CUBLAS_OP_T if transa else cublas.CUBLAS_OP_N)


def test_handle_stream_workspace_and_math(gemm):
    fake, arrays = gemm.fake, gemm.arrays
    a = numpy.ones((2, 2))
    for _ in range(3):
        gemm.matmul(a, a)
    arrays.current_stream = 0x6000
    gemm.matmul(a, a)
    assert len(fake.named('cublasCreate_v2')) == 1
    math, = fake.named('cublasSetMathMode')
    assert math[1] == cublas.CUBLAS_DEFAULT_MATH    # no TF32 for float32
    assert [s[1] for s in fake.named('cublasSetStream_v2')] == [0x5000,
                                                              0x6000]
    # after each stream change, a workspace of its own for that stream
    names = [n for n, _ in fake.calls if n.startswith('cublasSet')]
    assert names == ['cublasSetMathMode', 'cublasSetStream_v2',
                     'cublasSetWorkspace_v2', 'cublasSetStream_v2',
                     'cublasSetWorkspace_v2']
    spaces = fake.named('cublasSetWorkspace_v2')
    assert spaces[0][1] != spaces[1][1]
    assert {s[2] for s in spaces} == {gemm_module.WORKSPACE_BYTES}
    arrays.current_stream = 0x5000
    gemm.matmul(a, a)                 # back: the first stream's workspace
    assert fake.named('cublasSetWorkspace_v2')[-1][1] == spaces[0][1]
    assert len(arrays.allocations) == 2


def test_release_stream_resets_the_handle_and_drops_the_workspace(gemm):
    """A closed StepGraph's side stream: its workspace goes (it was cut
    from that graph's pool), and a handle still set to the stream is set
    again on next use, with a new workspace: never the released one."""
    fake, arrays = gemm.fake, gemm.arrays
    a = numpy.ones((2, 2))
    arrays.current_stream = 0x6000
    gemm.matmul(a, a)
    released = fake.named('cublasSetWorkspace_v2')[-1][1]
    arrays.current_stream = 0x5000
    gemm.matmul(a, a)
    kept = fake.named('cublasSetWorkspace_v2')[-1][1]
    arrays.current_stream = 0x6000
    gemm.release_stream(0x6000)
    assert all(key[1] != 0x6000 for key in gemm._workspaces)
    gemm.matmul(a, a)          # same pointer, now another stream's
    assert fake.named('cublasSetStream_v2')[-1][1] == 0x6000
    assert fake.named('cublasSetWorkspace_v2')[-1][1] not in (released,
                                                              kept)
    arrays.current_stream = 0x5000
    gemm.matmul(a, a)
    assert fake.named('cublasSetWorkspace_v2')[-1][1] == kept


def test_refuses_what_it_does_not_serve(gemm):
    with pytest.raises(TypeError, match='C-contiguous'):
        gemm.matmul(numpy.ones((2, 3), 'f'), numpy.ones((3, 2)))
    with pytest.raises(TypeError):     # a row's elements not adjacent
        gemm.matmul(numpy.ones((4, 4))[:, ::2], numpy.ones((2, 2)))
    with pytest.raises(TypeError):     # rows in reverse
        gemm.matmul(numpy.ones((4, 2))[::-1], numpy.ones((2, 2)))
    with pytest.raises(ValueError, match='do not match'):
        gemm.matmul(numpy.ones((2, 3)), numpy.ones((2, 3)))
    assert not gemm.serves(numpy.ones((2, 2), numpy.complex128))
    assert not gemm.serves(numpy.ones((2, 2), numpy.int32))


def test_linear_routed_through_it(gemm):
    rng = numpy.random.RandomState(1)
    x = rng.randn(6, 5)
    W = rng.randn(4, 5)
    b = rng.randn(4)
    gy = rng.randn(6, 4)

    def run():
        xv, Wv, bv = (chainer.Variable(v.copy()) for v in (x, W, b))
        y = F.linear(xv, Wv, bv)
        y.grad = gy.copy()
        y.backward()
        return y.array, xv.grad, Wv.grad, bv.grad

    expected = run()
    with gemm_module.route_linear(gemm):
        got = run()
    for g, e in zip(got, expected):
        assert _relative(g, e) < 1e-14
    names = [n for n, _ in gemm.fake.calls if 'gemm' in n]
    assert names == ['cublasDgemm_v2'] * 3   # y, gx, gW
    # restored: Chainer's own path again
    run()
    assert len([n for n, _ in gemm.fake.calls if 'gemm' in n]) == 3


class _CupyOwnMatmul(Exception):
    pass


def test_row_strided_operands_go_in_place(gemm):
    """A column block of a wider matrix, and the split-K pieces of
    ``patches.column_gram`` (``x.reshape(d, p, -1).transpose(1, 0, 2)``
    times its transpose), go to cuBLAS where they are: the leading
    dimension and the stack's stride from their strides (the pieces
    interleave), no copy; the products equal NumPy's."""
    import types

    def refused(*args, **kwargs):
        raise AssertionError('an operand was copied')
    cupy = types.SimpleNamespace(ascontiguousarray=refused)
    rng = numpy.random.RandomState(3)
    x = rng.randn(6, 40)
    assert gemm_module.row_major(x) == (40, 0)
    block = x[:, 5:15]
    y = rng.randn(10, 3)
    got = gemm_module._routed(gemm, cupy, block, y)
    assert _relative(got, block.dot(y)) < 1e-14
    call, = gemm.fake.named('cublasDgemm_v2')
    assert call[8:11:2] == (3, 40)         # ldb of y (first), lda of block
    pieces = x.reshape(6, 4, 10).transpose(1, 0, 2)
    assert gemm_module.row_major(pieces) == (40, 10)
    got = gemm_module._routed(gemm, cupy, pieces, pieces.transpose(0, 2, 1))
    assert _relative(got, numpy.matmul(pieces, pieces.transpose(0, 2, 1))
                     ) < 1e-14
    assert _relative(got.sum(axis=0), x.dot(x.T)) < 1e-14
    call, = gemm.fake.named('cublasDgemmStridedBatched')
    assert call[1:3] == (cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N)
    assert call[7:10] + call[10:13] == (call[7], 40, 10, call[10], 40, 10)
    # a single row and a one-matrix stack: any row stride will do
    assert gemm_module.row_major(x[2:3, :7]) == (7, 0)
    assert gemm_module.row_major(x[None, :, :5])[0] == 40


def test_matmul_routed_for_transposed_and_strided_operands(gemm):
    """``cupy.matmul`` within route_matmul: a transposed view (the
    low-rank factors' ``u.T``, ``w.T``; a stack's last axes swapped) goes
    as its matrix with the transposition flag, another strided operand as
    a C-contiguous copy; never to CuPy's own matmul (its cuBLAS refuses a
    capturing stream: the H200 run of 2026-11-26 fell back to eager on
    ``w.T``). What the GEMM does not serve (complex) still takes CuPy's."""
    import types

    def own(a, b):
        raise _CupyOwnMatmul((a.shape, b.shape))

    cupy = types.SimpleNamespace(matmul=own,
                                 ascontiguousarray=numpy.ascontiguousarray)
    rng = numpy.random.RandomState(2)
    u = rng.randn(7, 3)
    m = rng.randn(7, 5)
    stack = rng.randn(4, 6, 5)
    wide = rng.randn(5, 14)
    cases = [(u.T, m), (m.T, u), (u, u.T), (u.T, u), (m[:, ::2].T, m),
             (wide[:, ::2], rng.randn(7, 2)), (stack, stack.swapaxes(1, 2)),
             (stack.swapaxes(1, 2), stack), (m, wide[0, ::3].copy()[:5]),
             (u.T, wide[0, ::2])]
    with gemm_module.route_matmul(cupy, gemm):
        for a, b in cases:
            before = len(gemm.fake.calls)
            got = cupy.matmul(a, b)
            assert got.shape == numpy.matmul(a, b).shape
            assert _relative(got, numpy.matmul(a, b)) < 1e-14
            assert any('gemm' in name
                       for name, _ in gemm.fake.calls[before:])
        flags = [args[1:3] for name, args in gemm.fake.calls
                 if name == 'cublasDgemm_v2']
        # (u.T, m): the operands swap (column-major), m plain, u transposed
        assert flags[0] == (cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_T)
        with pytest.raises(_CupyOwnMatmul):
            cupy.matmul(u.astype(numpy.complex128).T,
                        m.astype(numpy.complex128))
    assert cupy.matmul is own


@pytest.mark.parametrize('batch', [None, 3])
def test_tf32_on_a_handle_of_its_own(gemm, batch):
    """``tf32=True`` takes float32 products to a second handle in TF32 math
    (the stand-in rounds that handle's operands as the Tensor Cores do),
    leaving the exact handle as it was; float64 stays exact; the routed
    TF32 product takes a transposed operand with cuBLAS's flag, no
    copy."""
    rng = numpy.random.RandomState(1)
    lead = () if batch is None else (batch,)
    a = rng.randn(*(lead + (6, 40))).astype(numpy.float32)
    b = rng.randn(*(lead + (40, 5))).astype(numpy.float32)
    exact = gemm.matmul(a, b)
    got = gemm.matmul(a, b, tf32=True)
    oracle = numpy.matmul(linalg.round_to_tf32(a).astype(numpy.float64),
                          linalg.round_to_tf32(b).astype(numpy.float64))
    assert _relative(got, oracle) < 1e-6
    # TF32's rounding is ~1e-3 of each operand: far above float32's
    assert _relative(got, exact) > 1e-5
    fake = gemm.fake
    modes = [m[1] for m in fake.named('cublasSetMathMode')]
    assert modes == [cublas.CUBLAS_DEFAULT_MATH,
                     cublas.CUBLAS_TF32_TENSOR_OP_MATH]
    handles = [c[0] for c in fake.calls if 'gemm' in c[0]]
    assert len(handles) == 2
    first, second = (args[0] for name, args in fake.calls if 'gemm' in name)
    assert first != second
    # float64 asked for TF32 keeps the exact handle
    gemm.matmul(a.astype(numpy.float64), b.astype(numpy.float64), tf32=True)
    *_, last = (args[0] for name, args in fake.calls if 'gemm' in name)
    assert last == first
    # the K-FAC entry point: b given as a transposed view, no copy made
    bt = numpy.ascontiguousarray(numpy.swapaxes(b, -1, -2))
    routed = gemm_module.tf32_matmul(numpy, a, numpy.swapaxes(bt, -1, -2),
                                     gemm)
    numpy.testing.assert_array_equal(routed, got)
    *_, call = (args for name, args in fake.calls if 'gemm' in name)
    assert call[1] == cublas.CUBLAS_OP_T           # b's flag (swapped)
    # and linalg's NumPy twin gives the same operands' products
    twin = linalg.tf32_matmul(a, b)
    assert _relative(twin, oracle) < 1e-6


def test_in_place_matmul_without_a_cublas_of_its_own(monkeypatch):
    """Where no cuBLAS can be loaded, linalg.in_place_matmul takes CuPy's
    matmul (and tries to load once only)."""
    import types
    from chainerkfac._binding import LibraryNotFound
    loads = []

    def load():
        loads.append(1)
        raise LibraryNotFound('no libcublas here')
    monkeypatch.setattr(gemm_module, '_gemm', None)
    monkeypatch.setattr(gemm_module, '_no_library', False)
    monkeypatch.setattr(cublas, 'load', load)
    monkeypatch.setitem(__import__('sys').modules, 'cupy',
                        types.SimpleNamespace())
    own = []
    cupy = types.SimpleNamespace(
        matmul=lambda a, b: own.append(1) or numpy.matmul(a, b))
    monkeypatch.setattr(linalg, 'get_array_module', lambda *a: cupy)
    x = numpy.random.RandomState(4).randn(3, 4, 5)
    for _ in range(2):
        got = linalg.in_place_matmul(x, x.transpose(0, 2, 1))
        numpy.testing.assert_array_equal(got, numpy.matmul(
            x, x.transpose(0, 2, 1)))
    assert own == [1, 1] and loads == [1]


@pytest.mark.parametrize('batch', [None, 3])
@pytest.mark.parametrize('transb', [False, True])
def test_half_matmul_by_gemm_ex(gemm, batch, transb):
    """float16 operands go to cublasGemmEx / cublasGemmStridedBatchedEx
    (fp16 in and out, fp32 accumulation, split-K's partial sums included)
    on a handle in cuBLAS's default math (Tensor Cores), reading row-strided views in place: the same
    values as linalg.half_matmul's NumPy twin (integers: exact in fp32;
    their products round in fp16 above 2048, as the twin rounds them)."""
    rng = numpy.random.RandomState(5)
    lead = () if batch is None else (batch,)
    wide = rng.randint(-40, 41, lead + (6, 40)).astype(numpy.float16)
    a = wide[..., :30]                      # a column block: ld 40
    b = rng.randint(-40, 41, lead + ((7, 30) if transb else (30, 7))
                    ).astype(numpy.float16)
    got = gemm.matmul(a, b, transb=transb)
    expected = linalg.half_matmul(a, numpy.swapaxes(b, -1, -2) if transb
                                  else b)
    assert got.dtype == numpy.float16
    numpy.testing.assert_array_equal(got, expected)
    assert (abs(expected.astype(numpy.float64)) > 2048).any()
    name = 'cublasGemmEx' if batch is None else 'cublasGemmStridedBatchedEx'
    call, = gemm.fake.named(name)
    modes = [m[1] for m in gemm.fake.named('cublasSetMathMode')]
    assert modes == [cublas.CUBLAS_DEFAULT_MATH |
                     cublas.CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION]
    assert call[-2:] == (cublas.CUBLAS_COMPUTE_32F,
                         cublas.CUBLAS_GEMM_DEFAULT)
    assert call[12 if batch is None else 13] == 40       # lda of the block


@pytest.mark.parametrize('change, message', [
    (dict(lda=4), 'lda=4 < max'),            # A untransposed: lda >= m
    (dict(ldb=2), 'ldb=2 < max'),            # B untransposed: ldb >= k
    (dict(ldc=4), 'ldc=4 < max'),
    (dict(k=2 ** 31), 'k=2147483648 out of int'),
    (dict(stride_c=10), 'results overlap'),
])
def test_the_stand_in_refuses_what_cublas_refuses(change, message):
    """The computing stand-in checks cuBLAS's argument rules (what the
    real library answers with CUBLAS_STATUS_INVALID_VALUE), so a call
    that only the stand-in would take fails here."""
    from tests.chainerkfac.graphs import cublas_fake
    args = dict(name='cublasSgemmStridedBatched', ta=0, tb=0, m=5, n=3, k=4,
                lda=5, ldb=4, ldc=5, stride_c=15, count=2)
    cublas_fake._check_arguments(**args)
    with pytest.raises(AssertionError, match=message):
        cublas_fake._check_arguments(**dict(args, **change))
