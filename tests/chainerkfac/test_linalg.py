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
