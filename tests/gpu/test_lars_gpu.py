"""LARS on the GPU (one fused kernel per momentum form, the trust ratio on
the device) against the same float64 model on the CPU."""
import numpy
import pytest

import chainer

from chainerkfac.optimizers import LARS
from tests.chainerkfac import helpers
from tests.gpu import support

pytestmark = support.MARKS

#: CPU and GPU runs of the same float64 model after 5 steps (cuBLAS
#: against BLAS in the forward and backward passes; the update itself is
#: the same expressions): the tolerance of test_optimizer_gpu.
CPU_GPU_TOLERANCE = 1e-12
STEPS = 5


def _train(model, optimizer, device):
    rng = numpy.random.RandomState(0)
    for _ in range(STEPS):
        x = rng.randn(6, 2, 5, 5)
        t = rng.randint(0, 4, size=6).astype(numpy.int32)
        optimizer.update(helpers.loss_of(model), device.send(x),
                         device.send(t))


@pytest.mark.parametrize('form', ['scaled', 'unscaled'])
def test_lars_on_the_gpu_equals_the_cpu(form):
    numpy.random.seed(0)
    cpu_model = helpers.ConvNet(bn=True)
    with helpers.float64_links(), cpu_model.init_scope():
        # no loss reaches it: no step (the kernel's `active` false)
        cpu_model.unused = chainer.links.Linear(3, 2)
    unused = cpu_model.unused.W.array.copy()
    gpu_model = cpu_model.copy('copy')
    device = support.device()
    device.use()
    gpu_model.to_device(device)
    options = dict(lr=0.5, momentum=0.9, weight_decay=5e-3, eta=0.02,
                   momentum_form=form)
    cpu = LARS(**options).setup(cpu_model)
    gpu = LARS(**options).setup(gpu_model)
    _train(cpu_model, cpu, chainer.get_device('@numpy'))
    _train(gpu_model, gpu, device)
    for name, param in cpu_model.namedparams():
        got = chainer.backend.CpuDevice().send(
            dict(gpu_model.namedparams())[name].array)
        numpy.testing.assert_allclose(got, param.array,
                                      rtol=CPU_GPU_TOLERANCE,
                                      atol=CPU_GPU_TOLERANCE, err_msg=name)
    assert sorted(gpu.excluded_params()) == sorted(cpu.excluded_params())
    numpy.testing.assert_array_equal(
        chainer.backend.CpuDevice().send(gpu_model.unused.W.array), unused)
