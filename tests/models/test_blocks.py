import numpy as np
import pytest
from chainer import gradient_check

from models.blocks import avg_pool_2x2_ceil


def reference(x):
    """Ceil-mode 2x2/2 average over the real elements of each window."""
    n, c, h, w = x.shape
    out = np.zeros((n, c, (h + 1) // 2, (w + 1) // 2))
    for i in range(out.shape[2]):
        for j in range(out.shape[3]):
            out[:, :, i, j] = x[:, :, 2 * i:2 * i + 2,
                                2 * j:2 * j + 2].mean(axis=(2, 3))
    return out


@pytest.mark.parametrize('shape', [(2, 3, 4, 6), (2, 3, 5, 7), (1, 2, 3, 4)])
def test_avg_pool_ceil(shape):
    x = np.random.RandomState(0).randn(*shape)
    np.testing.assert_allclose(avg_pool_2x2_ceil(x).array, reference(x),
                               rtol=1e-12)
    gradient_check.check_backward(
        avg_pool_2x2_ceil, x,
        np.random.RandomState(1).randn(*reference(x).shape),
        dtype=np.float64)
