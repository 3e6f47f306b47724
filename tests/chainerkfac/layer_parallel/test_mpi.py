"""MGRIT on 1, 2, 3, 4 processes (run by tests/run_mpi.py under mpiexec):
bitwise the single-process solves, whatever the distribution; layers ×
data equal to one process on the global batch; the performance model's
schedule is every rank's.

Every check gathers all ranks' verdicts first, so all ranks fail together
and none is left waiting in a collective.
"""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import numpy
import pytest
from mpi4py import MPI

import chainer
import chainermn

from chainerkfac import layer_parallel as lp
from chainerkfac.layer_parallel import perf_model
from tests.chainerkfac.layer_parallel import common

pytestmark = pytest.mark.mpi

world = MPI.COMM_WORLD

NETS = {
    # Blocks of whole intervals on up to 4 processes.
    'dense64': lambda: common.dense_net(n_layers=64),
    # 30 layers: blocks of whole intervals, and a partial one at the end.
    'dense30': lambda: common.dense_net(n_layers=30),
    # 13 layers, c = 4: on 4 processes the blocks split intervals.
    'conv13': lambda: common.conv_net(n_layers=13),
    # Fewer layers than processes at -n 4: a rank with no layer.
    'dense3': lambda: common.dense_net(n_layers=3),
}


def _agree(failures):
    """Fail on every rank if any rank failed."""
    everyone = world.allgather(failures)
    problems = ['rank {}: {}'.format(rank, failure)
                for rank, mine in enumerate(everyone) for failure in mine]
    assert not problems, '\n'.join(problems)


def test_weights_built_differently_per_rank_become_rank_0s(caplog):
    """A network built on each process with its own seed (the docs'
    example without a seed, under mpiexec) runs as rank 0's network: its
    weights are broadcast, with a warning, not silently mixed from every
    rank's layers."""
    net = common.dense_net(n_layers=16, seed=world.rank)
    reference = common.dense_net(n_layers=16, seed=0)
    x, t = common.batch(net)
    options = dict(tol=1e-13, max_iter=40)
    expected = common.mgrit_gradients(lp.MGRIT(reference, **options), x, t)
    with caplog.at_level('WARNING', logger='chainerkfac'):
        mgrit = lp.MGRIT(net, comm=world, **options)
    logits, loss, _, _, grads = common.mgrit_gradients(mgrit, x, t)
    failures = []
    for (name, a), (_, b) in zip(sorted(net.namedparams()),
                                 sorted(reference.namedparams())):
        if not numpy.array_equal(a.array, b.array):
            failures.append('weights of {} are not rank 0\'s'.format(name))
    loss, wanted = (float(getattr(v, 'array', v)) for v in (loss,
                                                            expected[1]))
    if abs(loss - wanted) > 1e-10 * abs(wanted):
        failures.append('loss {} != {}'.format(loss, wanted))
    warned = 'differed between processes' in caplog.text
    if world.rank == 0 and warned != (world.size > 1):
        failures.append('warned: {}'.format(warned))
    _agree(failures)


@pytest.mark.parametrize('name', sorted(NETS))
@pytest.mark.parametrize('relax', ['FCF', 'F'])
def test_solves_are_bitwise_the_single_process_solves(name, relax):
    net, reference_net = NETS[name](), NETS[name]()
    x, t = common.batch(net)
    options = dict(relax=relax, tol=1e-13, max_iter=40)
    expected = common.mgrit_gradients(lp.MGRIT(reference_net, **options),
                                      x, t)
    mgrit = lp.MGRIT(net, comm=world, **options)
    logits, loss, history, adjoint_history, grads = \
        common.mgrit_gradients(mgrit, x, t)
    failures = []
    if history != expected[2] or adjoint_history != expected[3]:
        failures.append('histories differ: {} {} / {} {}'.format(
            history, adjoint_history, expected[2], expected[3]))
    if not numpy.array_equal(logits, expected[0]) or loss != expected[1]:
        failures.append('logits or loss differ')
    for param_name, grad in grads.items():
        if not numpy.array_equal(grad, expected[4][param_name]):
            failures.append('grad of {} differs'.format(param_name))
    owned = world.allgather(sorted(grads))
    if sorted(sum(owned, [])) != sorted(expected[4]):
        failures.append('the owned parameters do not partition the net')
    _agree(failures)


def test_chainermn_communicator_and_share_weights():
    comm = chainermn.create_communicator('naive')
    net, reference_net = common.dense_net(), common.dense_net()
    x, t = common.batch(net)
    mgrit = lp.MGRIT(net, comm=comm)
    training = lp.SimultaneousTraining(mgrit, chainer.optimizers.Adam())
    reference = lp.SimultaneousTraining(lp.MGRIT(reference_net),
                                        chainer.optimizers.Adam())
    for _ in range(3):
        training.step(x, t)
        reference.step(x, t)
    mgrit.share_weights()
    expected = dict(reference_net.namedparams())
    _agree(['{} differs'.format(name)
            for name, param in net.namedparams()
            if not numpy.array_equal(param.array, expected[name].array)])


def _grids():
    return [p for p in range(1, world.size + 1) if world.size % p == 0]


@pytest.mark.parametrize('per_rank_seed', [False, True])
@pytest.mark.parametrize('layer_procs', _grids())
def test_layers_times_data_equals_one_process_on_the_global_batch(
        layer_procs, per_rank_seed):
    """m1 = m2 = 2 (inexact solves): each sample's iterates do not depend
    on the others', so replicas on shares of the batch with averaged
    gradients take the global batch's steps. A network built with each
    process's own seed starts from rank 0's weights (broadcast over the
    layer group by MGRIT, over the replicas by the training)."""
    grid = lp.ProcessGrid(world, layer_procs=layer_procs)
    net = common.dense_net(n_layers=32,
                           seed=world.rank if per_rank_seed else 0)
    reference_net = common.dense_net(n_layers=32)
    x, t = common.batch(net, size=12)
    training = lp.SimultaneousTraining(
        lp.MGRIT(net, comm=grid.layer_comm), chainer.optimizers.Adam(1e-2),
        grid=grid, smoothness=0.05)
    reference = lp.SimultaneousTraining(
        lp.MGRIT(reference_net), chainer.optimizers.Adam(1e-2),
        smoothness=0.05)
    failures = []
    for _ in range(3):
        result = training.step(*grid.local_batch(x, t))
        expected = reference.step(x, t)
        if abs(result.loss - expected.loss) > 1e-13:
            failures.append('loss {} != {}'.format(result.loss,
                                                   expected.loss))
    reference_params = dict(reference_net.namedparams())
    for name, param in training.mgrit.owned_params():
        if not numpy.allclose(param.array, reference_params[name].array,
                              rtol=1e-11, atol=1e-13):
            failures.append('{} differs'.format(name))
    _agree(failures)


@pytest.mark.parametrize('name', ['dense30', 'dense3'])
def test_time_smoothness_on_any_number_of_processes(name):
    net, reference_net = NETS[name](), NETS[name]()
    rng = numpy.random.RandomState(2)
    for param, reference in zip(net.params(), reference_net.params()):
        reference.array += 0.1 * rng.standard_normal(param.shape)
        param.array[...] = reference.array
    reference_net.cleargrads()
    expected = lp.accumulate_time_smoothness(lp.MGRIT(reference_net), 0.3)
    mgrit = lp.MGRIT(net, comm=world)
    net.cleargrads()
    value = lp.accumulate_time_smoothness(mgrit, 0.3)
    reference_grads = dict(reference_net.namedparams())
    failures = [] if value == expected else ['R {} != {}'.format(
        value, expected)]
    for param_name, param in mgrit.owned_params():
        if '/layers/' in param_name and not numpy.array_equal(
                param.grad, reference_grads[param_name].grad):
            failures.append('grad of {} differs'.format(param_name))
    _agree(failures)


@pytest.mark.parametrize('n_layers,relax,levels', [
    (64, 'FCF', None), (30, 'F', 3), (13, 'FCF', 2), (3, 'F', 1)])
def test_model_schedule_is_every_ranks(n_layers, relax, levels):
    """Steps per level and messages sent, rank by rank."""
    net = common.dense_net(n_layers=n_layers, width=3)
    x, t = common.batch(net, size=4)
    mgrit = lp.MGRIT(net, comm=world, relax=relax, levels=levels, tol=1e-9)
    sent = getattr(mgrit.transport, 'messages', 0)
    _, _, history, adjoint_history, _ = common.mgrit_gradients(mgrit, x, t)
    sent = getattr(mgrit.transport, 'messages', 0) - sent
    model = perf_model.gradient_time(
        n_layers, world.size, perf_model.Costs(*[1.0] * 7),
        len(history), len(adjoint_history), levels=levels, relax=relax)
    forward, adjoint = model['schedules']
    rank = world.rank
    failures = []
    if forward.steps[rank] != mgrit.forward_solver.steps:
        failures.append('forward steps {} != {}'.format(
            forward.steps[rank], mgrit.forward_solver.steps))
    if adjoint.steps[rank] != mgrit.adjoint_solver.steps:
        failures.append('adjoint steps {} != {}'.format(
            adjoint.steps[rank], mgrit.adjoint_solver.steps))
    if forward.messages[rank] + adjoint.messages[rank] != sent:
        failures.append('messages {} != {}'.format(
            forward.messages[rank] + adjoint.messages[rank], sent))
    _agree(failures)


def test_an_mgrit_off_the_grids_layer_group_is_refused_on_every_rank():
    """``MGRIT(net, comm=world)`` beside a grid of several replicas owns
    other layers than the replicas average: it hung in the first
    averaging (MPI_ERR_TRUNCATE on some ranks, the others waiting). Now
    every rank raises, naming the fix, before any step; MGRIT on
    ``grid.layer_comm`` is taken."""
    from chainerkfac.optimizers import KFAC
    for layer_procs in _grids():
        grid = lp.ProcessGrid(world, layer_procs=layer_procs)
        net = common.dense_net(n_layers=8)
        others = [world] if grid.n_replicas > 1 else []
        if grid.n_replicas > 1 and layer_procs > 1:
            others.append(grid.data_comm.comm)   # right size, other group
        for comm in others:
            mgrit = lp.MGRIT(net, comm=comm)
            with pytest.raises(ValueError, match='grid.layer_comm'):
                lp.SimultaneousTraining(mgrit, chainer.optimizers.SGD(),
                                        grid=grid)
            with pytest.raises(ValueError, match='grid.layer_comm'):
                lp.setup_kfac(KFAC(verbose=False), mgrit, grid)
        right = lp.MGRIT(net, comm=grid.layer_comm)
        grid.check_layer_group(right)
        lp.SimultaneousTraining(right, chainer.optimizers.SGD(), grid=grid)
