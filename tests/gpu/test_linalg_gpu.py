"""Batched damped inverses and the fp16 factor GEMM on the GPU, against the
CPU path (LAPACK) and the NumPy twin."""
import numpy

from chainerkfac import linalg
from chainerkfac import linalg_cuda
from tests.chainerkfac.test_linalg import _problem_factors
from tests.gpu import support

pytestmark = support.MARKS


def _spd(n, seed, dtype=numpy.float32):
    rng = numpy.random.RandomState(seed)
    m = rng.randn(n, 2 * n)
    return (m.dot(m.T) / (2 * n)).astype(dtype)


def _many_factors():
    """More factors than streams: repeated and distinct sizes, 1-D BN
    diagonals, fp32 and fp64, one large enough for blocked cuSOLVER code."""
    factors = []
    for k, n in enumerate([1, 2, 3, 64, 64, 64, 65, 130, 257, 513, 1100,
                           7, 7, 7, 300]):
        factors.append((_spd(n, k), 10.0 ** -(k % 4)))
    factors.append((_spd(40, 99, numpy.float64), 1e-3))
    factors.append((_spd(200, 98, numpy.float64), 1e-2))
    rng = numpy.random.RandomState(5)
    for n in (4, 128, 2048):
        factors.append((numpy.abs(rng.randn(n)).astype(numpy.float32), 1e-3))
    return factors


def _compare(factors, tol32=2e-3, tol64=1e-9, method='cholesky'):
    """The GPU's inverses by ``method`` against the CPU's by Cholesky."""
    cpu = linalg.damped_inverses([m for m, _ in factors],
                                 [d for _, d in factors])
    gpu = linalg.damped_inverses([support.to_gpu(m) for m, _ in factors],
                                 [d for _, d in factors], method=method)
    problems = []
    for k, ((matrix, _), c, g) in enumerate(zip(factors, cpu, gpu)):
        if (g.retries, g.damping) != (c.retries, c.damping):
            problems.append((k, 'retries/damping', (g.retries, g.damping),
                             (c.retries, c.damping)))
            continue
        if c.inverse is None or g.inverse is None:
            if (c.inverse is None) != (g.inverse is None):
                problems.append((k, 'inverse None on one side only'))
            continue
        if not support.is_cupy(g.inverse):
            problems.append((k, 'GPU result not on the GPU'))
            continue
        got = support.to_cpu(g.inverse)
        if got.dtype != c.inverse.dtype or got.shape != matrix.shape:
            problems.append((k, 'dtype/shape', got.dtype, got.shape))
            continue
        if matrix.ndim == 2 and not numpy.array_equal(got, got.T):
            problems.append((k, 'not exactly symmetric'))
        tol = tol64 if got.dtype == numpy.float64 else tol32
        scale = numpy.abs(c.inverse).max()
        error = numpy.abs(got - c.inverse).max() / scale
        if not error <= tol:
            problems.append((k, matrix.shape, 'max error / max |inverse|',
                             error, '>', tol))
    assert not problems, problems
    return gpu


def test_gpu_inverses_equal_the_cpu_ones():
    """fp32: cuSOLVER and LAPACK round differently. The factors have
    eigenvalues in about [0.09, 2.9] (condition numbers ≤ ~35 once damped),
    so both are within ~1e-4 of the exact inverse; 2e-3 of the largest
    entry leaves room and still catches a wrong triangle or stale result."""
    _compare(_many_factors())


def test_gpu_retries_exactly_as_the_cpu():
    """−I, an indefinite diagonal, NaN, Inf, a negative BN diagonal: same
    retry counts and dampings as on the CPU, no NaN returned."""
    gpu = _compare(_problem_factors())
    retries = [r.retries for r in gpu]
    assert retries == [0, 3, 2, linalg.MAX_INVERSE_TRIES, 0, 0,
                       linalg.MAX_INVERSE_TRIES, 3, 0], retries


def test_newton_schulz_on_the_gpu_equals_cholesky():
    """The batched GEMM iteration (cuBLAS, exact fp32 unless CUPY_TF32 is
    set) against LAPACK Cholesky: the same inverses, the same retries on
    the problem factors (Cholesky decides where the iteration does not
    settle)."""
    _compare(_many_factors(), method='newton_schulz')
    gpu = _compare(_problem_factors(), method='newton_schulz')
    assert [r.retries for r in gpu] == [0, 3, 2, linalg.MAX_INVERSE_TRIES,
                                        0, 0, linalg.MAX_INVERSE_TRIES, 3, 0]


def test_newton_schulz_on_the_gpu_equals_its_cpu_run():
    """Ill-conditioned Gram factors (κ up to ~1e6) in fp64: the same
    iteration on CuPy and NumPy, to rounding."""
    from tests.chainerkfac.test_newton_schulz import factors
    pairs = factors(numpy.float64)
    cpu = linalg.damped_inverses([m for m, _ in pairs],
                                 [d for _, d in pairs],
                                 method='newton_schulz')
    gpu = linalg.damped_inverses([support.to_gpu(m) for m, _ in pairs],
                                 [d for _, d in pairs],
                                 method='newton_schulz')
    for c, g in zip(cpu, gpu):
        assert support.is_cupy(g.inverse) and g.retries == c.retries == 0
        numpy.testing.assert_allclose(support.to_cpu(g.inverse), c.inverse,
                                      rtol=1e-8,
                                      atol=1e-8 * abs(c.inverse).max())


def test_potrs_stand_in_gives_the_same_inverses(monkeypatch):
    """The path taken where cuSOLVER's potri cannot be bound."""
    monkeypatch.setattr(linalg_cuda, '_raw_potri', lambda: None)
    _compare(_many_factors()[:8] + _problem_factors())


def test_timed_routes_give_the_same_inverses(monkeypatch):
    """``CHOLESKY_INVERSE='auto'`` under autotune: each lone factor's size
    and dtype timed both ways once (recorded in ``timed_routes``), the
    inverses and retries as the CPU's; the problem factors too."""
    import chainer
    monkeypatch.setattr(linalg_cuda, 'CHOLESKY_INVERSE', 'auto')
    monkeypatch.setattr(linalg_cuda, '_TIMED_ROUTES', {})
    with chainer.using_config('autotune', True):
        _compare(_many_factors() + _problem_factors())
        chosen = linalg_cuda.timed_routes()
        _compare(_many_factors())
    assert linalg_cuda.timed_routes() == chosen
    assert {n for n, _, _ in chosen} >= {1100, 300, 513}
    assert set(chosen.values()) <= {'potri', 'potrs'}


def test_potri_is_bound_on_this_machine():
    """Not a correctness matter (potrs stands in), but the fast path is the
    one the benchmarks should measure: say why it is not taken."""
    path = linalg_cuda._loaded_cusolver()
    assert path is not None, 'no libcusolver found in /proc/self/maps'
    functions = linalg_cuda._bind_potri(path)   # raises with the reason
    assert set(functions) == {'spotri', 'dpotri', 'spotri_bufferSize',
                              'dpotri_bufferSize'}
    assert linalg_cuda._check_potri(functions) is None
    assert linalg_cuda._raw_potri() is not None


def test_one_factor_and_current_stream():
    """``damped_inverse`` (one factor) on a non-default current stream."""
    import cupy
    m = _spd(50, 3, numpy.float64)
    expected = linalg.damped_inverse(m, 1e-2)
    with cupy.cuda.Stream(non_blocking=True):
        got = linalg.damped_inverse(support.to_gpu(m), 1e-2)
    numpy.testing.assert_allclose(support.to_cpu(got.inverse),
                                  expected.inverse, rtol=1e-9, atol=1e-9)
    assert got[1:] == expected[1:]


def test_fp16_gram_equals_its_numpy_twin():
    """The fp16 factor path: fp16 inputs (same rounding on both sides), fp32
    accumulation, fp16 result. The accumulation orders differ, so an entry
    may round to the neighbouring fp16 value: within 2^-10 relative (one
    fp16 ulp) plus 2^-24·peak² absolute (fp16 subnormals)."""
    rng = numpy.random.RandomState(0)
    rows = (rng.randn(300, 40) * 3).astype(numpy.float32)
    rows[:, 3] *= 1e-3     # small entries too
    for append_ones in (False, True):
        twin = linalg.gram(rows, 1 / 300.0, numpy.float16,
                           append_ones=append_ones)
        gpu = support.to_cpu(linalg.gram(support.to_gpu(rows), 1 / 300.0,
                                         numpy.float16,
                                         append_ones=append_ones))
        assert gpu.dtype == twin.dtype == numpy.float32
        peak = float(numpy.abs(rows).max())
        numpy.testing.assert_allclose(gpu, twin, rtol=2.0 ** -10,
                                      atol=2.0 ** -24 * peak ** 2)
        exact = rows.astype(numpy.float64).T.dot(rows) / 300.0
        assert numpy.abs(gpu[:40, :40] - exact).max() < 1e-2 * numpy.abs(
            exact).max()


def test_fp32_gram_equals_numpy():
    rows = numpy.random.RandomState(1).randn(500, 30)
    for dtype in (numpy.float32, numpy.float64):
        cpu = linalg.gram(rows.astype(dtype), 0.01)
        gpu = support.to_cpu(linalg.gram(support.to_gpu(rows.astype(dtype)),
                                         0.01))
        tol = 1e-5 if dtype == numpy.float32 else 1e-12
        numpy.testing.assert_allclose(gpu, cpu, rtol=tol,
                                      atol=tol * numpy.abs(cpu).max())
