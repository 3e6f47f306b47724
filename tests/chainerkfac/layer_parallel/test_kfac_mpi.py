"""K-FAC across the layer-parallel grid under mpiexec (1-4 processes, every
grid of layer groups × data replicas that divides them): converged MGRIT
with K-FAC equals serial K-FAC training of the same ResidualODE on the
global batch, to 1e-10 over 5 steps (float64; the factors travel in
float64). Each replica feeds its share of the batch; the Fisher blocks of a
layer group's layers are inverted across its replicas.

Every check gathers all ranks' verdicts first, so all ranks fail together
and none is left waiting in a collective.
"""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import pytest
from mpi4py import MPI

import chainer.functions as F

from chainerkfac.optimizers import KFAC
from chainerkfac import layer_parallel as lp
from tests.chainerkfac.layer_parallel import common

pytestmark = pytest.mark.mpi

world = MPI.COMM_WORLD

OPTIONS = dict(lr=0.05, momentum=0.9, damping=1e-2, verbose=False)


def _agree(failures):
    everyone = world.allgather(failures)
    problems = ['rank {}: {}'.format(rank, failure)
                for rank, mine in enumerate(everyone) for failure in mine]
    assert not problems, '\n'.join(problems)


def _grids():
    return [p for p in range(1, world.size + 1) if world.size % p == 0]


NETS = {
    'dense16': lambda: common.dense_net(n_layers=16),
    'conv9': lambda: common.conv_net(n_layers=9, width=2),
}


@pytest.mark.parametrize('name', sorted(NETS))
@pytest.mark.parametrize('layer_procs', _grids())
def test_converged_layer_parallel_kfac_is_serial_kfac(layer_procs, name):
    grid = lp.ProcessGrid(world, layer_procs=layer_procs)
    net, reference_net = NETS[name](), NETS[name]()
    x, t = common.batch(net, size=12)
    training = lp.SimultaneousTraining(
        lp.MGRIT(net, comm=grid.layer_comm, tol=1e-14, max_iter=60),
        KFAC(**OPTIONS), m1=60, m2=60, grid=grid)
    reference = KFAC(process_local=True, **OPTIONS).setup(reference_net)
    failures = []
    scales = []
    for _ in range(5):
        result = training.step(*grid.local_batch(x, t))
        reference.update(
            lambda: F.softmax_cross_entropy(reference_net(x), t))
        if result.state_residual > 1e-14 or result.adjoint_residual > 1e-14:
            failures.append('not converged: {}'.format(result))
        # the default bounded step (kl_clip): one ν for the whole network
        scales.append(training.optimizer.step_bound.scale)
        if abs(scales[-1] - reference.step_bound.scale) > 1e-12:
            failures.append('nu {} against serial {}'.format(
                scales[-1], reference.step_bound.scale))
    if min(scales) > 0.99:
        failures.append('the bound never acted: nu {}'.format(scales))
    expected = dict(reference_net.namedparams())
    worst = 0.0
    for param_name, param in training.mgrit.owned_params():
        worst = max(worst, float(abs(param.array -
                                     expected[param_name].array).max()))
    if worst > 1e-10:
        failures.append('parameters differ by {:.3g}'.format(worst))
    optimizer = training.optimizer
    curved = [b for b in optimizer.blocks if b.factor_names]
    owned_links = {link_name for link_name, _ in
                   training.mgrit.owned_links()}
    if sorted(b.name for b in curved) != sorted(owned_links):
        failures.append('blocks {} are not the owned links {}'.format(
            [b.name for b in curved], sorted(owned_links)))
    # The owned blocks are inverted across the replicas: each once.
    inverted = grid.data_comm.allgather(
        sorted(b.name for b in curved if optimizer.transport.owns(b)))
    counts = {}
    for names in inverted:
        for block_name in names:
            counts[block_name] = counts.get(block_name, 0) + 1
    if grid.n_replicas > 1 and len(curved) >= grid.n_replicas and (
            sorted(counts) != sorted(owned_links) or
            set(counts.values()) != {1}):
        failures.append('blocks not spread over the replicas: {}'.format(
            counts))
    _agree(failures)
