"""MGRIT on CuPy arrays under ``mpiexec -n 1..4``, every rank on device 0,
through the host-staged communicator (chainerkfac.create_communicator(
'host_staged'); the states are staged through host memory): the forward
and adjoint solves equal one CPU process's (float64, 1e-12), and K-FAC on
a grid of layer groups × data replicas equals serial K-FAC on the CPU.

Every test gathers its verdict from all ranks before asserting."""
import pytest
from mpi4py import MPI

import chainer.functions as F

import chainerkfac
from chainerkfac.optimizers import KFAC
from chainerkfac import layer_parallel as lp
from tests.chainerkfac.layer_parallel import common
from tests.gpu import support

pytestmark = [pytest.mark.mpi] + support.MARKS

world = MPI.COMM_WORLD


def _agree(failures):
    everyone = world.allgather(failures)
    problems = ['rank {}: {}'.format(rank, failure)
                for rank, mine in enumerate(everyone) for failure in mine]
    assert not problems, '\n'.join(problems)


def _differs(got, expected) -> bool:
    scale = float(abs(expected).max()) or 1.0
    return float(abs(support.to_cpu(got) - expected).max()) > 1e-12 * scale


@pytest.mark.parametrize('make', [
    lambda: common.dense_net(n_layers=30),
    lambda: common.conv_net(n_layers=13),
], ids=['dense30', 'conv13'])
def test_mgrit_on_the_gpu_through_host_staging_equals_one_cpu_process(make):
    net, reference_net = make(), make()
    x, t = common.batch(net)
    options = dict(tol=1e-14, max_iter=60)
    expected = common.mgrit_gradients(lp.MGRIT(reference_net, **options),
                                      x, t)
    comm = chainerkfac.create_communicator('host_staged')
    net.to_device(support.device())
    mgrit = lp.MGRIT(net, comm=comm, **options)
    logits, loss, history, adjoint_history, grads = common.mgrit_gradients(
        mgrit, *support.to_gpu(x, t))
    failures = []
    if _differs(logits, expected[0]) or abs(loss - expected[1]) > 1e-12:
        failures.append('logits or loss differ')
    if history[-1] > 1e-14 or adjoint_history[-1] > 1e-14:
        failures.append('not converged: {} {}'.format(history[-1],
                                                      adjoint_history[-1]))
    for name, grad in grads.items():
        if not support.is_cupy(grad) or _differs(grad, expected[4][name]):
            failures.append('grad of {} differs'.format(name))
    if world.size > 1 and not getattr(mgrit.transport, 'staged', 0):
        failures.append('no message was staged through the host')
    _agree(failures)


@pytest.mark.parametrize('layer_procs', [
    p for p in range(1, world.size + 1) if world.size % p == 0])
def test_layer_parallel_kfac_on_the_gpu_equals_serial_kfac(layer_procs):
    options = dict(lr=0.05, momentum=0.9, damping=1e-2, verbose=False)
    grid = lp.ProcessGrid(world, layer_procs=layer_procs)
    net, reference_net = common.dense_net(n_layers=16), \
        common.dense_net(n_layers=16)
    x, t = common.batch(net, size=12)
    reference = KFAC(process_local=True, **options).setup(reference_net)
    net.to_device(support.device())
    mgrit = lp.MGRIT(net, comm=grid.layer_comm, tol=1e-14, max_iter=60)
    optimizer = lp.setup_kfac(KFAC(**options), mgrit, grid,
                              communicator='host_staged')
    training = lp.SimultaneousTraining(mgrit, optimizer, m1=60, m2=60,
                                       grid=grid)
    gpu_x, gpu_t = support.to_gpu(x, t)
    share = len(x) // grid.n_replicas
    rows = slice(grid.replica * share, (grid.replica + 1) * share)
    for _ in range(3):
        training.step(gpu_x[rows], gpu_t[rows])
        reference.update(
            lambda: F.softmax_cross_entropy(reference_net(x), t))
    expected = dict(reference_net.namedparams())
    _agree(['{} differs'.format(name)
            for name, param in mgrit.owned_params()
            if float(abs(support.to_cpu(param.array) -
                         expected[name].array).max()) > 1e-10])
