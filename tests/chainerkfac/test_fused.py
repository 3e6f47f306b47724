"""The NumPy twins of :mod:`chainerkfac.fused` against the whole-array
expressions of eqs. (13), (19) and (20), element for element: the twins
compute piece by piece (cache-sized pieces), in the same operations and
order, so the results are equal bit for bit (a comparison of two
computations in one process that run the same operations)."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import numpy
import pytest

from chainerkfac import fused


def _expression(weight, velocity, direction, lr, momentum, rescale_norm):
    new = weight + (momentum * velocity - lr * direction)
    if rescale_norm is not None:
        new *= rescale_norm / (numpy.linalg.norm(new) + fused.RESCALE_EPS)
    return new, new - weight


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
@pytest.mark.parametrize('rescale_norm', [None, 3.7])
@pytest.mark.parametrize('shape', [(7,), (64, 3, 3, 3),
                                   (3 * fused.PIECE + 5,)])
def test_momentum_step_is_the_expression(dtype, rescale_norm, shape):
    rng = numpy.random.RandomState(0)
    weight = rng.randn(*shape).astype(dtype)
    velocity = rng.randn(*shape).astype(dtype)
    # A direction that is a strided view (a bias's column of a matrix).
    direction = rng.randn(*(shape + (2,))).astype(dtype)[..., 0]
    expected_w, expected_v = _expression(weight, velocity, direction, 0.013,
                                         0.9, rescale_norm)
    fused.momentum_step(weight, velocity, direction, 0.013, 0.9,
                        rescale_norm)
    numpy.testing.assert_array_equal(weight, expected_w)
    numpy.testing.assert_array_equal(velocity, expected_v)


@pytest.mark.parametrize('mean', [0.0, 1.0])
def test_regularized_grad_is_eq_13(mean):
    rng = numpy.random.RandomState(1)
    grad, weight = rng.randn(2, 1000).astype(numpy.float32)
    numpy.testing.assert_array_equal(
        fused.regularized_grad(grad, weight, 0.01, mean),
        grad + 0.01 * (weight - mean) if mean else grad + 0.01 * weight)


# -- BatchNormalization's per-sample gradients --------------------------------
def _bn_case(shape, dtype, seed=0):
    rng = numpy.random.RandomState(seed)
    x = (rng.randn(*shape) * 2 + 0.5).astype(dtype)
    gy = rng.randn(*shape).astype(dtype)
    mean = x.mean(axis=(0, 2)).astype(dtype)
    inv_std = (1 / numpy.sqrt(x.var(axis=(0, 2)) + 1e-5)).astype(dtype)
    return x, gy, mean, inv_std


def _bn_reference(x, gy, mean, inv_std):
    """float64, through x̂ itself; and the magnitudes the sums' rounding
    scales with."""
    x, gy, mean, inv_std = (numpy.asarray(a, numpy.float64)
                            for a in (x, gy, mean, inv_std))
    x_hat = (x - mean[:, None]) * inv_std[:, None]
    rows = numpy.concatenate([(gy * x_hat).sum(axis=2), gy.sum(axis=2)], 1)
    scale = numpy.concatenate([
        (abs(gy) * (abs(x) + abs(mean[:, None]))).sum(axis=2) *
        inv_std, abs(gy).sum(axis=2)], 1)
    return rows, scale


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
@pytest.mark.parametrize('shape', [(3, 4, 1), (2, 5, 49), (4, 3, 300)])
def test_bn_sample_grads_twin_is_the_definition(shape, dtype):
    x, gy, mean, inv_std = _bn_case(shape, dtype)
    rows = fused.bn_sample_grads(x, gy, mean, inv_std, dtype)
    assert rows.shape == (shape[0], 2 * shape[1]) and rows.dtype == dtype
    expected, scale = _bn_reference(x, gy, mean, inv_std)
    unit = numpy.finfo(dtype).eps
    assert (abs(rows - expected) <= 4 * (shape[2] + 2) * unit * scale).all()


@pytest.mark.gpu
@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
@pytest.mark.parametrize('shape', [(3, 4, 1), (2, 5, 49), (4, 3, 300),
                                   (2, 2, 12544)])
def test_gpu_bn_sample_grads_kernel_against_the_definition(shape, dtype):
    """The one-pass kernel (a block per (n, c)): within the sums'
    rounding of float64 through x̂, and within the same bound of the
    twin."""
    from tests.gpu import support
    cupy = support.cupy_or_skip()
    x, gy, mean, inv_std = _bn_case(shape, dtype, seed=1)
    got = fused.bn_sample_grads(*(cupy.asarray(a) for a in
                                  (x, gy, mean, inv_std)), dtype)
    assert isinstance(got, cupy.ndarray) and got.dtype == dtype
    got = cupy.asnumpy(got)
    expected, scale = _bn_reference(x, gy, mean, inv_std)
    unit = numpy.finfo(dtype).eps
    bound = 4 * (shape[2] + 2) * unit * scale
    assert (abs(got - expected) <= bound).all()
    twin = fused.bn_sample_grads(x, gy, mean, inv_std, dtype)
    assert (abs(got - twin) <= 2 * bound).all()
