"""The fused per-step kernels (chainerkfac.fused) against their NumPy
twins: the update of eqs. (19)-(20), the regularised gradient of eq. (13),
and the one-kernel finite check over many arrays."""
import numpy
import pytest

from chainerkfac import fused
from tests.gpu import support

pytestmark = support.MARKS


@pytest.mark.parametrize('dtype', [numpy.float32, numpy.float64])
@pytest.mark.parametrize('rescale', [None, 3.5])
def test_momentum_step_equals_its_twin(dtype, rescale):
    rng = numpy.random.RandomState(0)
    w, v, d = (rng.randn(33, 17).astype(dtype) for _ in range(3))
    cpu_w, cpu_v = w.copy(), v.copy()
    fused.momentum_step(cpu_w, cpu_v, d, 0.1, 0.9, rescale)
    gpu_w, gpu_v, gpu_d = support.to_gpu(w, v, d)
    fused.momentum_step(gpu_w, gpu_v, gpu_d, 0.1, 0.9, rescale)
    tol = 1e-12 if dtype == numpy.float64 else 1e-5
    numpy.testing.assert_allclose(support.to_cpu(gpu_w), cpu_w, rtol=tol,
                                  atol=tol)
    numpy.testing.assert_allclose(support.to_cpu(gpu_v), cpu_v, rtol=tol,
                                  atol=tol)
    if rescale is not None:
        assert numpy.linalg.norm(support.to_cpu(gpu_w)) == pytest.approx(
            rescale, rel=1e-5)


@pytest.mark.parametrize('mean', [0.0, 1.0])
def test_regularized_grad_equals_its_twin(mean):
    rng = numpy.random.RandomState(1)
    g, w = rng.randn(40), rng.randn(40)
    expected = fused.regularized_grad(g, w, 0.03, mean)
    got = fused.regularized_grad(*support.to_gpu(g, w), 0.03, mean)
    numpy.testing.assert_allclose(support.to_cpu(got), expected, rtol=1e-14)


@pytest.mark.parametrize('bad', [None, numpy.nan, numpy.inf, -numpy.inf])
@pytest.mark.parametrize('where', [0, 7, 160])
def test_all_finite_over_many_arrays(bad, where):
    rng = numpy.random.RandomState(2)
    dtypes = (numpy.float32, numpy.float64, numpy.float16)
    arrays = [rng.randn(int(rng.randint(1, 5000))).astype(dtypes[k % 3])
              for k in range(161)]
    if bad is not None:
        arrays[where][len(arrays[where]) // 2] = bad
    on_gpu = [support.to_gpu(a) for a in arrays]
    # A non-contiguous view is checked too.
    on_gpu.append(support.to_gpu(rng.randn(8, 8))[:, ::2])
    assert fused.all_finite(arrays) == (bad is None)
    assert fused.all_finite(on_gpu) == (bad is None)
