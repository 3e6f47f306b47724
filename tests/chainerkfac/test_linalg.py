"""Damped Cholesky inverse and the factor GEMM (with its fp16 NumPy twin)."""
import numpy
import pytest

from chainerkfac import linalg


def spd(n, seed=0):
    rng = numpy.random.RandomState(seed)
    m = rng.randn(n, 2 * n)
    return m.dot(m.T) / n


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
def test_damped_inverse_is_inverse(dtype):
    m = spd(7).astype(dtype)
    result = linalg.damped_inverse(m, 0.1)
    assert result.retries == 0 and result.damping == 0.1
    assert result.inverse.dtype == dtype
    numpy.testing.assert_allclose(
        result.inverse.dot(m + 0.1 * numpy.eye(7)), numpy.eye(7),
        atol=1e-4 if dtype == numpy.float32 else 1e-10)
    numpy.testing.assert_array_equal(result.inverse, result.inverse.T)


def test_not_positive_definite_raises_damping():
    m = -numpy.eye(4) * 3.0
    result = linalg.damped_inverse(m, 1e-2)
    # 1e-2, 1e-1, 1, 10: the fourth try is PD.
    assert result.retries == 3 and result.damping == pytest.approx(10.0)
    numpy.testing.assert_allclose(result.inverse, numpy.eye(4) / 7.0)


def test_nan_cannot_be_repaired():
    m = spd(3)
    m[0, 1] = numpy.nan
    result = linalg.damped_inverse(m, 1.0)
    assert result.inverse is None
    assert result.retries == linalg.MAX_INVERSE_TRIES


def test_gram_fp16_twin_rounds_inputs_and_output():
    rng = numpy.random.RandomState(0)
    rows = rng.randn(50, 6).astype(numpy.float32)
    exact = rows.astype(numpy.float64).T.dot(rows) / 50
    fp32 = linalg.gram(rows, 1 / 50.0)
    fp16 = linalg.gram(rows, 1 / 50.0, numpy.float16)
    assert fp16.dtype == numpy.float32
    numpy.testing.assert_allclose(fp32, exact, rtol=1e-5, atol=1e-6)
    peak = numpy.abs(rows).max()
    half = (rows * numpy.float32(numpy.sqrt(1 / 50.0)) / peak).astype(
        numpy.float16).astype(numpy.float32)
    expected = half.T.dot(half).astype(numpy.float16).astype(numpy.float32)
    numpy.testing.assert_allclose(fp16, expected * peak ** 2, rtol=1e-6)
    assert numpy.abs(fp16 - exact).max() < 2e-3


def test_gram_does_not_overflow_in_fp16():
    rows = numpy.full((4096, 2), 300.0, numpy.float32)  # Σ x² = 3.7e8
    value = linalg.gram(rows, 1 / 4096.0, numpy.float16)
    numpy.testing.assert_allclose(value, 9e4, rtol=1e-3)


@pytest.mark.parametrize('n', [1, 5, 64, 130])
def test_mirror_upper_equals_triu_twin(n):
    m = numpy.random.RandomState(n).randn(n, n)
    expected = numpy.triu(m) + numpy.triu(m, 1).T
    numpy.testing.assert_array_equal(linalg.mirror_upper(m.copy()), expected)


@pytest.mark.parametrize('dtype', ['float32', 'float16'])
def test_gram_with_ones_equals_gram_of_augmented_rows(dtype):
    rows = numpy.random.RandomState(1).randn(30, 4).astype(numpy.float32)
    augmented = numpy.concatenate([rows, numpy.ones((30, 1), 'f')], 1)
    expected = linalg.gram(augmented, 0.1)
    got = linalg.gram(rows, 0.1, numpy.dtype(dtype), append_ones=True)
    tol = 1e-6 if dtype == 'float32' else 2e-3
    numpy.testing.assert_allclose(got, expected, rtol=tol, atol=tol)


# -- damped_inverses: all factors of a step in one call -----------------------

def _reference_inverse(matrix, damping, max_tries=linalg.MAX_INVERSE_TRIES,
                       boost=linalg.DAMPING_BOOST):
    """One factor at a time with numpy.linalg (independent of LAPACK's
    potri): the semantics ``damped_inverse`` had before the batched path."""
    if not numpy.isfinite(matrix).all():
        return None, damping, max_tries
    dtype = numpy.float64 if matrix.dtype == numpy.float64 else numpy.float32
    for attempt in range(max_tries):
        used = damping * boost ** attempt
        if matrix.ndim == 1:
            shifted = matrix.astype(dtype) + dtype(used)
            if (shifted > 0).all():
                return dtype(1) / shifted, used, attempt
            continue
        damped = matrix.astype(dtype) + dtype(used) * numpy.eye(
            len(matrix), dtype=dtype)
        try:
            numpy.linalg.cholesky(damped)
        except numpy.linalg.LinAlgError:
            continue
        return numpy.linalg.inv(damped), used, attempt
    return None, used, max_tries


def _problem_factors():
    """SPD, −I, indefinite diagonal, NaN, Inf, BN diagonals (one needing a
    boost), fp32 and fp64, in mixed order."""
    bad_nan = spd(4, seed=3)
    bad_nan[1, 2] = numpy.nan
    bad_inf = numpy.ones(5, numpy.float32)
    bad_inf[3] = numpy.inf
    return [
        (spd(9, seed=1), 1e-3),
        (-3.0 * numpy.eye(4), 1e-2),
        (numpy.diag([2.0, -0.5, 1.0]).astype(numpy.float32), 1e-2),
        (bad_nan, 1.0),
        (spd(30, seed=2).astype(numpy.float32), 1e-2),
        (numpy.abs(numpy.random.RandomState(4).randn(8)), 1e-3),
        (bad_inf, 1e-3),
        (numpy.array([0.5, -0.2, 1.0], numpy.float32), 1e-3),
        (spd(1, seed=5), 0.5),
    ]


def test_damped_inverses_equal_the_per_factor_reference():
    factors = _problem_factors()
    results = linalg.damped_inverses([m for m, _ in factors],
                                     [d for _, d in factors])
    assert len(results) == len(factors)
    for (matrix, damping), result in zip(factors, results):
        inverse, used, retries = _reference_inverse(matrix, damping)
        assert result.retries == retries
        assert result.damping == used  # exactly the same float
        if inverse is None:
            assert result.inverse is None
            continue
        assert result.inverse.dtype == inverse.dtype
        assert result.inverse.shape == matrix.shape
        tol = 1e-10 if inverse.dtype == numpy.float64 else 2e-4
        numpy.testing.assert_allclose(result.inverse, inverse, rtol=tol,
                                      atol=tol * numpy.abs(inverse).max())
        if matrix.ndim == 2:
            numpy.testing.assert_array_equal(result.inverse,
                                             result.inverse.T)


def test_damped_inverses_retry_counts():
    factors = _problem_factors()
    results = linalg.damped_inverses([m for m, _ in factors],
                                     [d for _, d in factors])
    tries = linalg.MAX_INVERSE_TRIES
    # −3·I: 1e-2, 1e-1, 1 fail, 10 works. diag(2, −0.5, 1): 1e-2, 1e-1
    # fail, 1 works. NaN / Inf: no try, the damping as given.
    expected = [(0, 1e-3), (3, 10.0), (2, 1.0), (tries, 1.0), (0, 1e-2),
                (0, 1e-3), (tries, 1e-3), (3, 1.0), (0, 0.5)]
    got = [(r.retries, r.damping) for r in results]
    for (retries, damping), (r, d) in zip(expected, got):
        assert r == retries and d == pytest.approx(damping)
    numpy.testing.assert_allclose(results[1].inverse, numpy.eye(4) / 7.0)
    numpy.testing.assert_allclose(results[2].inverse,
                                  numpy.diag([1 / 3.0, 2.0, 0.5]),
                                  rtol=1e-6)


def test_damped_inverses_give_up_after_max_tries():
    results = linalg.damped_inverses([-1e9 * numpy.eye(3),
                                      numpy.full(2, -1e9)],
                                     [1e-3, 1e-3], max_tries=3, boost=2.0)
    for result in results:
        assert result.inverse is None and result.retries == 3
        assert result.damping == 1e-3 * 2.0 ** 2


def test_damped_inverse_is_the_one_factor_case():
    m = spd(6, seed=7)
    single = linalg.damped_inverse(m, 0.3)
    batched = linalg.damped_inverses([m], [0.3])[0]
    numpy.testing.assert_array_equal(single.inverse, batched.inverse)
    assert single[1:] == batched[1:]


def test_damped_inverses_reject_bad_input():
    assert linalg.damped_inverses([], []) == []
    with pytest.raises(ValueError, match='dampings'):
        linalg.damped_inverses([numpy.eye(2)], [])
    with pytest.raises(ValueError, match='square'):
        linalg.damped_inverses([numpy.ones((2, 3))], [1.0])


def test_gpu_lanes_take_the_largest_factor_first_onto_the_least_loaded():
    from chainerkfac import linalg_cuda
    costs = [1.0, 64.0, 8.0, 27.0, 1.0, 125.0]
    lanes = linalg_cuda._assign_lanes(costs, 2)
    # 125 → lane 0; then 64, 27, 8, 1, 1 all fit on lane 1 (101 < 125).
    assert lanes == [1, 1, 1, 1, 1, 0]
    assert linalg_cuda._assign_lanes([5.0, 1.0, 9.0], 2) == [1, 1, 0]
    # More lanes than factors: one lane each.
    assert sorted(linalg_cuda._assign_lanes(costs, 8)) == list(range(6))


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
def test_gpu_gram_goes_to_our_cublas(monkeypatch, dtype):
    """On the GPU a Linear's or dense BN's Gram factor is one product by
    our cuBLAS handle (the rows and their transpose read in place): CuPy's
    ``dot`` calls its own cuBLAS, which a capturing stream refuses, and the
    refresh steps' passes are captured (chainerkfac.graphs). Here a
    computing cuBLAS stand-in reads memory as cuBLAS does; CuPy's dot or
    matmul fails the test. The factor is NumPy's."""
    import types
    from tests.chainerkfac.fisher_blocks.test_patches import (
        _OnDevice, _device_gemm)

    def refused(*args, **kwargs):
        raise AssertionError("CuPy's own product was called")

    class Rows(_OnDevice):
        dot = refused

    fake_cupy = types.SimpleNamespace(matmul=refused,
                                      ascontiguousarray=refused)
    fake, gemm = _device_gemm(monkeypatch)
    monkeypatch.setattr(linalg, 'get_array_module', lambda *a: (
        fake_cupy if isinstance(a[0], _OnDevice) else numpy))
    rows = numpy.random.RandomState(2).randn(7, 5).astype(dtype)
    got = linalg.gram(rows.view(Rows), 0.25, 'float32')
    want = linalg.gram(rows, 0.25, 'float32')
    assert got.dtype == want.dtype
    numpy.testing.assert_allclose(
        got, want, rtol=10 * numpy.finfo(dtype).eps * rows.shape[0])
    assert len(fake.calls) >= 1 and 'gemm' in fake.calls[-1][0].lower()
    gemm.close()
