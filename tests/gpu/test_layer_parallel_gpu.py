"""chainerkfac.layer_parallel on CuPy arrays, one process: MGRIT's forward
and adjoint solves on the GPU equal the CPU's (float64, 1e-12: converged
solves of the same layers, cuBLAS / cuDNN kernels summing in other
orders), K-FAC on the layer-parallel grid too, and the performance model's
unit costs are measured there (synchronised). The multi-process side is
tests/gpu/test_layer_parallel_mpi_gpu.py."""
import numpy
import pytest

from chainerkfac.optimizers import KFAC
from chainerkfac import layer_parallel as lp
from chainerkfac.layer_parallel import perf_model
from tests.chainerkfac.layer_parallel import common
from tests.gpu import support

pytestmark = support.MARKS

NETS = {
    'dense': lambda: common.dense_net(n_layers=26),
    'conv': lambda: common.conv_net(n_layers=9),
}


def _solve(net, x, t):
    mgrit = lp.MGRIT(net, tol=1e-14, max_iter=60)
    return common.mgrit_gradients(mgrit, x, t)


def _close(got, expected, what):
    got = support.to_cpu(got)
    scale = float(abs(expected).max()) or 1.0
    numpy.testing.assert_allclose(got, expected, rtol=0, atol=1e-12 * scale,
                                  err_msg=what)


@pytest.mark.parametrize('name', sorted(NETS))
def test_mgrit_forward_and_adjoint_on_the_gpu_equal_the_cpu(name):
    net, gpu_net = NETS[name](), NETS[name]()
    x, t = common.batch(net)
    expected = _solve(net, x, t)
    gpu_net.to_device(support.device())
    got = _solve(gpu_net, *support.to_gpu(x, t))
    assert support.is_cupy(got[0])
    _close(got[0], expected[0], 'logits')
    assert abs(got[1] - expected[1]) <= 1e-12
    assert got[2][-1] <= 1e-14 and got[3][-1] <= 1e-14
    for param, grad in expected[4].items():
        assert support.is_cupy(got[4][param])
        _close(got[4][param], grad, param)


def test_layer_parallel_kfac_on_the_gpu_equals_the_cpu():
    options = dict(lr=0.05, momentum=0.9, damping=1e-2, verbose=False)
    nets = {}
    for where in ('cpu', 'gpu'):
        net = NETS['dense']()
        x, t = common.batch(net, size=10)
        if where == 'gpu':
            net.to_device(support.device())
            x, t = support.to_gpu(x, t)
        training = lp.SimultaneousTraining(
            lp.MGRIT(net, tol=1e-14, max_iter=60), KFAC(**options),
            m1=60, m2=60)
        for _ in range(3):
            training.step(x, t)
        nets[where] = support.weights(net)
    for name, value in nets['cpu'].items():
        _close(nets['gpu'][name], value, name)


def test_unit_costs_are_measured_on_the_gpu():
    net = NETS['conv']()
    net.to_device(support.device())
    x, t = support.to_gpu(*common.batch(net))
    costs = perf_model.measure_layer_costs(net, x, t, repeats=2)
    assert set(costs) == {'step', 'adjoint_step', 'slope', 'layer_grad',
                          'axpy', 'ends'}
    assert all(value > 0 for value in costs.values()), costs
    assert all(param.grad is None for param in net.params())
