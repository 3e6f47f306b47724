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
