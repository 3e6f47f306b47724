"""``chainermn.create_multi_node_optimizer(KFAC(...), comm)`` — ChainerMN's
own function, unchanged — trains with K-FAC's distributed algorithm.

ChainerMN's wrapper averages the gradients itself (an all-reduce), calls
``KFAC.update()`` without the loss function, and spends its first update
on broadcasting rank 0's parameters (for any optimizer). So from the second
iteration on it must equal ``chainerkfac.create_multi_node_optimizer`` fed
the same batches, and one process accumulating the same chunks
(``acc_iters = P``), in the wrapper's two ways of being called: with the
loss function, and after a hand-written backward.
"""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import chainermn
import pytest

from tests.chainerkfac import helpers
from tests.chainerkfac.multi_node import common

STEPS = 3
TOLERANCE = 1e-12


def _wrapped(comm, net, acc_iters):
    model = net(seed=comm.rank)       # rank-dependent: the broadcast fixes
    optimizer = chainermn.create_multi_node_optimizer(
        helpers.kfac(**common.kfac_options(acc_iters=acc_iters)), comm)
    optimizer.setup(model)
    return model, optimizer


def _train_wrapped(model, optimizer, comm, manual, steps, first_step):
    """``steps`` steps of ``acc_iters`` wrapper calls each, on the chunks
    of :func:`common.chunks` (rank r takes chunks r·acc .. r·acc + acc − 1,
    as :func:`common.train_distributed`)."""
    acc = optimizer.acc_iters
    lossfun = helpers.loss_of(model)
    for step in range(first_step, first_step + steps):
        batch = common.chunks(step, comm.size * acc, 0, model.in_shape)
        for j in range(acc):
            x, t = batch[comm.rank * acc + j]
            helpers.update(optimizer, model, lossfun, x, t, manual)


@pytest.mark.mpi
@pytest.mark.parametrize('net', [common.ConvBNNet, common.SmallMLP])
@pytest.mark.parametrize('manual', [False, True])
@pytest.mark.parametrize('acc_iters', [1, 2])
def test_chainermn_wrapper_equals_chainerkfac_and_one_process(net, manual,
                                                              acc_iters):
    # ChainerMN's own communicator, as a user's script has it (its K-FAC
    # collectives' default wire: float64 for these float64 nets).
    comm = chainermn.create_communicator('naive')
    model, optimizer = _wrapped(comm, net, acc_iters)
    # The first call only broadcasts rank 0's parameters (ChainerMN), then
    # STEPS K-FAC steps on the batches of steps 1..STEPS.
    x, t = common.chunks(0, comm.size, 0, model.in_shape)[comm.rank]
    optimizer.update(helpers.loss_of(model), x, t)
    assert optimizer.actual_optimizer.pending_micro_batches == 0
    _train_wrapped(model, optimizer, comm, manual, STEPS, 1)
    kfac = optimizer.actual_optimizer
    assert kfac.t == STEPS and kfac.transport.size == comm.size
    assert kfac.gradients_reduced

    reference, ref_optimizer = common.distributed(
        comm, net=net, acc_iters=acc_iters)
    common.train_distributed(reference, ref_optimizer, comm, STEPS,
                             first_step=1)
    single, single_optimizer = common.single(
        net=net, acc_iters=acc_iters * comm.size)
    common.train_single(single, single_optimizer, comm.size * acc_iters,
                        STEPS, first_step=1)

    got = common.params(model)
    initial = common.params(net(seed=0))
    common.assert_everywhere(
        common.max_relative_diff(got, common.params(reference)) < TOLERANCE,
        'wrapper == chainerkfac.create_multi_node_optimizer')
    common.assert_everywhere(
        common.max_relative_diff(got, common.params(single)) < TOLERANCE,
        'wrapper == one process with acc_iters = P')
    common.assert_everywhere(
        all(common.max_relative_diff({k: got[k]}, {k: initial[k]}) > 1e-6
            for k in got), 'every weight moved')
    # Every K-FAC block refreshed and preconditioned on its owner.
    owned = [b for b in kfac.blocks
             if b.factor_names and kfac.transport.owns(b)]
    common.assert_everywhere(all(b.has_inverses() for b in owned),
                             'owned blocks preconditioned')
