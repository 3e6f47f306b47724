"""The pieces of linalg's fp16 factor path and their NumPy twins; the CuPy
path against them on GPU."""
import numpy
import pytest

from chainerkfac import linalg
from tests.gpu import support


def test_factor_dtype_is_fp64_for_fp64_arrays_else_fp32():
    assert linalg.factor_dtype_for(numpy.float64) == numpy.float64
    assert linalg.factor_dtype_for(numpy.float32) == numpy.float32
    assert linalg.factor_dtype_for(numpy.float16) == numpy.float32


def test_normaliser_peak_is_largest_magnitude_negative_included():
    x = numpy.array([[0.5, -3.0], [2.0, 1.0]], numpy.float32)
    normaliser = linalg.half_normaliser(x, 0.25)
    assert normaliser.peak == 3.0
    assert normaliser.factor == numpy.float32(0.5) / numpy.float32(3.0)
    zero = linalg.half_normaliser(numpy.zeros(3, numpy.float32), 1.0)
    assert zero.peak > 0 and numpy.isfinite(zero.factor)


def test_write_scaled_rounds_once_to_the_output():
    x = numpy.random.RandomState(0).randn(5, 7).astype(numpy.float32)
    normaliser = linalg.half_normaliser(x, 0.1)
    out = numpy.empty((7, 5), numpy.float16)
    linalg.write_scaled(out, x.T, normaliser)
    numpy.testing.assert_array_equal(
        out, (x.T * normaliser.factor).astype(numpy.float16))
    plain = numpy.empty((5, 7), numpy.float64)
    linalg.write_scaled(plain, x, None)
    numpy.testing.assert_array_equal(plain, x)


def test_half_matmul_twin_accumulates_in_fp32_and_rounds_to_fp16():
    rng = numpy.random.RandomState(1)
    a = rng.randn(3, 4, 300).astype(numpy.float16)
    b = rng.randn(3, 300, 2).astype(numpy.float16)
    got = linalg.half_matmul(a, b)
    assert got.dtype == numpy.float16
    wide = numpy.matmul(a.astype(numpy.float32), b.astype(numpy.float32))
    numpy.testing.assert_array_equal(got, wide.astype(numpy.float16))
    # Accumulated in fp32: an fp16 running sum of 300 terms is far off.
    exact = numpy.matmul(a.astype(numpy.float64), b.astype(numpy.float64))
    assert numpy.abs(got - exact).max() <= 2 ** -10 * numpy.abs(exact).max()


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
def test_append_ones_row_is_gram_of_augmented_vectors(dtype):
    rows = numpy.random.RandomState(2).randn(9, 3).astype(dtype)
    augmented = numpy.concatenate([rows, numpy.ones((9, 1), dtype)], 1)
    got = linalg.append_ones_row(rows.T.dot(rows) * 0.5, rows.sum(axis=0),
                                 9, 0.5)
    assert got.dtype == dtype
    numpy.testing.assert_allclose(got, augmented.T.dot(augmented) * 0.5,
                                  rtol=1e-6)


@pytest.mark.gpu
def test_gpu_half_matmul_equals_twin():
    cupy = support.cupy_or_skip()
    rng = numpy.random.RandomState(3)
    a = rng.randn(2, 64, 512).astype(numpy.float16)
    b = rng.randn(2, 512, 32).astype(numpy.float16)
    twin = linalg.half_matmul(a, b)
    gpu = linalg.half_matmul(cupy.asarray(a), cupy.asarray(b))
    assert gpu.dtype == numpy.float16
    # Summation order only: at most one fp16 rounding step apart.
    numpy.testing.assert_allclose(cupy.asnumpy(gpu).astype(numpy.float32),
                                  twin.astype(numpy.float32), rtol=2 ** -10,
                                  atol=2 ** -10 * numpy.abs(twin).max())


@pytest.mark.gpu
@pytest.mark.parametrize('factor_dtype', ['float32', 'float16'])
def test_gpu_gram_equals_numpy(factor_dtype):
    cupy = support.cupy_or_skip()
    rows = numpy.random.RandomState(4).randn(200, 30).astype(numpy.float32)
    cpu = linalg.gram(rows, 0.01, factor_dtype, append_ones=True)
    gpu = linalg.gram(cupy.asarray(rows), 0.01, factor_dtype,
                      append_ones=True)
    tol = 1e-5 if factor_dtype == 'float32' else 2e-3
    numpy.testing.assert_allclose(cupy.asnumpy(gpu), cpu, rtol=tol,
                                  atol=tol * numpy.abs(cpu).max())
