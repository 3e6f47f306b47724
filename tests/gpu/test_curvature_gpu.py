"""chainerkfac.curvature on CuPy arrays: every quantity of every kind of
graph on the GPU equals the CPU's (float64, to 1e-12 of the largest
entry: the same products in the same order on both, but other kernels —
cuBLAS, cuDNN, CuPy reductions — sum in other orders), with the root's
columns stacked (the default) and one backward pass per column."""
import numpy
import pytest

import chainer

from chainerkfac import curvature
from tests.chainerkfac.curvature import nets
from tests.chainerkfac.curvature.test_columns import MODELS
from tests.gpu import support

pytestmark = support.MARKS

QUANTITIES = curvature.QUANTITIES


def _supported(model, x, t):
    names = []
    for name in QUANTITIES:
        try:
            curvature.extract(model, x, t, quantities=(name,), seed=0)
        except curvature.UnsupportedGraph:
            continue
        names.append(name)
    return names


@pytest.mark.parametrize('chunk', [None, 1])
@pytest.mark.parametrize('graph', sorted(MODELS))
def test_every_quantity_on_the_gpu_equals_the_cpu(graph, chunk):
    model, x, t = MODELS[graph]()
    with chainer.using_config('train', False):
        names = _supported(model, x, t)
        expected = curvature.extract(model, x, t, quantities=names, seed=0,
                                     column_chunk=chunk)
        model.to_device(support.device())
        got = curvature.extract(model, *support.to_gpu(x, t),
                                quantities=names, seed=0,
                                column_chunk=chunk)
    assert set(got) == set(expected)
    for path, values in expected.items():
        assert set(got[path]) == set(values), path
        for name, value in values.items():
            assert support.is_cupy(got[path][name]), (path, name)
            scale = float(abs(value).max()) or 1.0
            numpy.testing.assert_allclose(
                support.to_cpu(got[path][name]), value, rtol=0,
                atol=1e-12 * scale, err_msg='{} {}'.format(path, name))


def test_batch_normalization_in_training_mode_on_the_gpu():
    """Coupled samples: the per-sample passes, on CuPy too."""
    model = nets.WithBN()
    x, t = nets.data(n=4)
    with chainer.using_config('train', True):
        expected = curvature.extract(model, x, t, quantities=(
            'diag_ggn', 'batch_grad'))
        model.to_device(support.device())
        got = curvature.extract(model, *support.to_gpu(x, t),
                                quantities=('diag_ggn', 'batch_grad'))
    for path, values in expected.items():
        for name, value in values.items():
            numpy.testing.assert_allclose(
                support.to_cpu(got[path][name]), value, rtol=0,
                atol=1e-12 * (float(abs(value).max()) or 1.0))
