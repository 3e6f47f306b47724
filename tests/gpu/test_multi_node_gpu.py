"""Distributed K-FAC on CuPy arrays under ``mpiexec -n 1..4``, every rank on
device 0, through the host-staged communicator (NCCL refuses two ranks on
one GPU). With ``pad_segments=True`` the packing is ``pure_nccl``'s, so the
GPU side of its multi-rank path (padded segments, the gather-and-cast
kernel at n ≥ 2) runs here.

As in tests/chainerkfac/multi_node/, every test gathers its verdict from all
ranks before asserting, so no rank is left waiting in a collective.
"""
import numpy
import pytest
from mpi4py import MPI

import chainer
import chainer.links as L

from chainerkfac.communicators.host_staged import KfacHostStagedCommunicator
from chainerkfac.multi_node_optimizer import create_multi_node_optimizer
from tests.chainerkfac import helpers
from tests.chainerkfac.communicators.test_collectives import _problem
from tests.chainerkfac.communicators.test_host_staged import \
    _integer_arrays, _same
from tests.chainerkfac.multi_node import common
from tests.gpu import support

pytestmark = [pytest.mark.mpi] + support.MARKS

world = MPI.COMM_WORLD

STALE = dict(refresh_interval_a=2, refresh_interval_g=1,
             refresh_interval_f=3)


@pytest.mark.parametrize('wire_dtype', ['float16', 'float32', 'float64'])
@pytest.mark.parametrize('pad', [False, True], ids=['packed', 'padded'])
def test_collectives_on_cupy_equal_those_on_numpy(wire_dtype, pad):
    comm = KfacHostStagedCommunicator(world, wire_dtype, pad_segments=pad)
    shapes, owners, symmetric = _problem(3, world.size)
    arrays = _integer_arrays(shapes, symmetric, 3)
    gpu_arrays = [support.to_gpu(a) for a in arrays]
    on_gpu = (comm.reduce_scatter_v(gpu_arrays, owners, symmetric),
              comm.all_gather_v(gpu_arrays, owners, symmetric))
    on_cpu = (comm.reduce_scatter_v(arrays, owners, symmetric),
              comm.all_gather_v(arrays, owners, symmetric))
    ok = all((g is None or support.is_cupy(g)) and
             _same(None if g is None else support.to_cpu(g), c)
             for gs, cs in zip(on_gpu, on_cpu) for g, c in zip(gs, cs))
    common.assert_everywhere(ok, 'CuPy results == NumPy results')


def test_bcast_data_and_mean_grad_on_cupy():
    """float32 and float16 parameters (float16 gradients are averaged in
    float32, as ChainerMN does)."""
    comm = KfacHostStagedCommunicator(world)
    numpy.random.seed(comm.rank)
    model = chainer.Chain()
    with model.init_scope():
        model.single = L.Linear(3, 2)
        with chainer.using_config('dtype', numpy.float16):
            model.half = L.Linear(2, 2)
    model.to_device(support.device())
    comm.bcast_data(model)
    mine = support.weights(model)
    root = comm.mpi_comm.bcast(mine if comm.rank == 0 else None)
    model.cleargrads()
    for param in model.params():
        param.grad = support.to_gpu(numpy.full(param.shape, comm.rank + 1.0,
                                               param.dtype))
    comm.multi_node_mean_grad(model)
    mean = (comm.size + 1) / 2.0
    grads = {name: support.to_cpu(p.grad)
             for name, p in model.namedparams()}
    common.assert_everywhere(
        all(support.is_cupy(p.array) and support.is_cupy(p.grad)
            for p in model.params()) and
        all(numpy.array_equal(mine[k], root[k]) for k in root) and
        all(g.dtype == dict(model.namedparams())[k].dtype and
            numpy.allclose(g, mean) for k, g in grads.items()),
        'bcast_data / multi_node_mean_grad on CuPy')


def _compare_on_gpu(comm, steps, acc_iters=1, tolerance=1e-9,
                    net=common.ConvBNNet, **options):
    """N GPU ranks against one CPU process accumulating the N chunks."""
    model = net(seed=comm.rank)
    model.to_device(support.device())
    optimizer = create_multi_node_optimizer(
        helpers.kfac(**common.kfac_options(acc_iters=acc_iters, **options)),
        comm)
    optimizer.setup(model)
    ref_model, ref_optimizer = common.single(
        acc_iters=acc_iters * comm.size, net=net, **options)
    initial = common.params(ref_model)
    for step in range(steps):
        batch = common.chunks(step, comm.size * acc_iters, 0, model.in_shape)
        for j in range(acc_iters):
            x, t = batch[comm.rank * acc_iters + j]
            optimizer.update(helpers.loss_of(model), *support.to_gpu(x, t))
    common.train_single(ref_model, ref_optimizer, comm.size * acc_iters,
                        steps)
    mine = support.weights(model)
    ref = common.params(ref_model)
    diffs = common.gathered(common.max_relative_diff(mine, ref))
    assert max(diffs) < tolerance, 'rank-wise max relative diff {}'.format(
        diffs)
    common.assert_everywhere(
        common.max_relative_diff(ref, initial) > 1e-2 and
        all(support.is_cupy(p.array) for p in model.params()),
        'weights moved, on the GPU')
    return optimizer


@pytest.mark.parametrize('bn_fisher', ['full', 'diag'])
@pytest.mark.parametrize('stale', [False, True], ids=['fresh', 'stale'])
def test_n_gpu_ranks_equal_one_process(bn_fisher, stale):
    comm = KfacHostStagedCommunicator(world, 'float64', pad_segments=True)
    _compare_on_gpu(comm, 5, bn_fisher=bn_fisher, **(STALE if stale else {}))


def test_accumulation_and_redundant_layers_on_gpu():
    comm = KfacHostStagedCommunicator(world, 'float64', pad_segments=True)
    _compare_on_gpu(comm, 4, acc_iters=2, **STALE)
    _compare_on_gpu(comm, 4, net=common.SmallMLP, **STALE)


def test_unpadded_float32_wire_on_gpu():
    """The default wire (fp32) rounds the sums: close, not equal."""
    comm = KfacHostStagedCommunicator(world, 'float32', pad_segments=False)
    _compare_on_gpu(comm, 3, tolerance=1e-4)


def test_sharded_update_on_gpu():
    """Weight-update sharding with CuPy weights: the owners' updates, the
    all-gather of the weights at float64 on a padded (pure_nccl-like)
    layout, redundant owners."""
    comm = KfacHostStagedCommunicator(world, 'float64', pad_segments=True)
    _compare_on_gpu(comm, 4, acc_iters=2, shard_update=True, **STALE)
    _compare_on_gpu(comm, 4, net=common.SmallMLP, shard_update=True,
                    **STALE)


@pytest.mark.parametrize('form', ['scaled', 'unscaled'])
def test_sharded_lars_on_gpu_equals_one_cpu_process(form):
    from chainerkfac.optimizers import GuardedOptimizer, LARS
    comm = KfacHostStagedCommunicator(world, 'float32', pad_segments=True)

    def lars():
        return LARS(lr=0.5, momentum=0.9, weight_decay=1e-3, eta=0.02,
                    momentum_form=form)
    model = common.ConvBNNet()
    model.to_device(support.device())
    optimizer = GuardedOptimizer(lars(), 2, comm, shard_update=True)
    optimizer.setup(model)
    ref_model = common.ConvBNNet()
    ref_optimizer = GuardedOptimizer(lars(), 2 * comm.size).setup(ref_model)
    for step in range(4):
        batch = common.chunks(step, comm.size * 2, 0, model.in_shape)
        for j in range(2):
            x, t = batch[comm.rank * 2 + j]
            optimizer.update(helpers.loss_of(model), *support.to_gpu(x, t))
    common.train_single(ref_model, ref_optimizer, comm.size * 2, 4)
    diffs = common.gathered(common.max_relative_diff(
        support.weights(model), common.params(ref_model)))
    # float64 model: gradients and weights travel at float64 whatever the
    # communicator's wire (sharding sends them at the parameters' dtype).
    assert max(diffs) < 1e-9, 'rank-wise max relative diff {}'.format(diffs)
