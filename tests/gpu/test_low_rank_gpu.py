"""Low-rank factors and the bounded step on the GPU: the same float64 runs
as on the CPU (tests/chainerkfac/test_low_rank.py, test_step_bound.py),
with CuPy arrays, against the CPU run and against the GPU's dense run."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import numpy
import pytest

import chainer

from tests.chainerkfac import helpers
from tests.chainerkfac import test_low_rank
from tests.gpu import support

pytestmark = support.MARKS

#: CPU and GPU runs of the same float64 model after a few steps (cuBLAS /
#: cuSOLVER against BLAS / LAPACK): 1e-12, as tests/gpu/test_optimizer_gpu.
TOLERANCE = 1e-12


def _train(make_model, on_gpu, low_rank, kl_clip, steps=4):
    numpy.random.seed(0)
    model = make_model()
    if on_gpu:
        model.to_device(support.device())
    optimizer = helpers.kfac(lr=0.5, momentum=0.9, damping=1e-2,
                             low_rank=low_rank, kl_clip=kl_clip,
                             refresh_interval_a=2, refresh_interval_g=1)
    optimizer.setup(model)
    reporter = chainer.Reporter()
    reports = []
    for x, t in test_low_rank._batches(model.in_shape, steps, batch=4):
        if on_gpu:
            x, t = support.to_gpu(x, t)
        observation = {}
        with reporter.scope(observation):
            optimizer.update(helpers.loss_of(model), x, t)
        reports.append(observation)
    return support.weights(model), reports


@pytest.mark.parametrize('make_model', [
    test_low_rank.WideMLP, lambda: test_low_rank.SmallConv(2, 1, 1, True)],
    ids=['linear', 'conv'])
@pytest.mark.parametrize('kl_clip', [None, 1e-3])
def test_low_rank_and_bound_on_the_gpu(make_model, kl_clip):
    cpu, cpu_reports = _train(make_model, False, True, kl_clip)
    gpu, gpu_reports = _train(make_model, True, True, kl_clip)
    dense, _ = _train(make_model, True, False, kl_clip)
    assert all(r['kfac/low_rank_factors'] >= 1 for r in gpu_reports)
    for name in cpu:
        numpy.testing.assert_allclose(gpu[name], cpu[name], rtol=TOLERANCE,
                                      atol=TOLERANCE, err_msg=name)
        numpy.testing.assert_allclose(gpu[name], dense[name],
                                      rtol=TOLERANCE, atol=TOLERANCE,
                                      err_msg=name)
    if kl_clip is not None:
        scales = [float(r['kfac/step_scale']) for r in gpu_reports]
        assert min(scales) < 1
        numpy.testing.assert_allclose(
            scales, [float(r['kfac/step_scale']) for r in cpu_reports],
            rtol=1e-10)
