"""Start-up checks: ranks that disagree fail on every rank with a message
naming the difference, and nothing hangs."""
import numpy
import pytest

import chainer
import chainer.links as L

from tests.chainerkfac import helpers
from tests.chainerkfac.multi_node import common

pytestmark = pytest.mark.mpi

several_ranks = pytest.mark.skipif(common.world.size < 2,
                                   reason='needs two ranks to disagree')


def _first_update_error(model, optimizer, comm):
    """The message of the exception the first update raises ('' if none),
    gathered from every rank."""
    x, t = common.chunks(0, comm.size)[comm.rank]
    try:
        optimizer.update(helpers.loss_of(model), x, t)
        message = ''
    except (ValueError, RuntimeError) as error:
        message = '{}: {}'.format(type(error).__name__, error)
    return common.gathered(message)


def _odd_one_out(comm):
    return comm.rank == comm.size - 1


@several_ranks
def test_different_hyperparameters_fail_on_every_rank():
    comm = common.naive()
    damping = 2e-2 if _odd_one_out(comm) else 1e-2
    model, optimizer = common.distributed(comm, damping=damping,
                                          refresh_interval_g='eq22'
                                          if _odd_one_out(comm) else 1)
    messages = _first_update_error(model, optimizer, comm)
    last = comm.size - 1
    common.assert_everywhere(all(
        m.startswith('ValueError') and 'damping: 0.01 on rank' in m and
        '0.02 on rank {}'.format(last) in m and 'refresh_interval_G' in m
        for m in messages), 'clear error on every rank: {}'.format(
            messages[0]))


@several_ranks
def test_a_link_frozen_on_some_ranks_fails_on_every_rank():
    """disable_update() on one process only: the replicas parted silently
    (0.61 relative after 3 steps in a reviewer's run, and the owner that
    froze it inverted nothing for the ranks that trained it)."""
    comm = common.naive()
    model, optimizer = common.distributed(comm)
    if _odd_one_out(comm):
        model.conv2.disable_update()
    messages = _first_update_error(model, optimizer, comm)
    common.assert_everywhere(all(
        m.startswith('RuntimeError') and '/conv2/W updated on {} of {} '
        'processes'.format(comm.size - 1, comm.size) in m
        for m in messages), 'frozen named: {}'.format(messages[0]))


@several_ranks
def test_loss_scaling_on_some_ranks_fails_on_every_rank():
    """Under ChainerMN's wrapper the gradients are averaged before K-FAC
    undoes each process's scale: a scale on one process only gave a step
    0.32 off, silently."""
    comm = common.naive()
    model, optimizer = common.distributed(comm)
    if _odd_one_out(comm):
        optimizer.loss_scaling(scale=8.0)
    messages = _first_update_error(model, optimizer, comm)
    common.assert_everywhere(all(
        'loss scaling: none on rank' in m and
        '8.0 on rank {}'.format(comm.size - 1) in m for m in messages),
        'loss scaling named: {}'.format(messages[0]))


@several_ranks
def test_different_model_fails_on_every_rank():
    comm = common.naive()
    model = common.ConvBNNet(n_out=4 if _odd_one_out(comm) else 3)
    optimizer = common.create_multi_node_optimizer(
        helpers.kfac(**common.kfac_options()), comm)
    optimizer.setup(model)
    messages = _first_update_error(model, optimizer, comm)
    common.assert_everywhere(all(
        'param /fc/W: (3, 36) float64 on rank' in m and
        '(4, 36) float64 on rank {}'.format(comm.size - 1) in m
        for m in messages),
        'model difference named: {}'.format(messages[0]))


def test_same_setup_passes_and_logs_the_assignment(caplog):
    comm = common.naive()
    caplog.set_level('INFO', logger='chainerkfac')
    model, optimizer = common.distributed(comm, verbose=True)
    common.train_distributed(model, optimizer, comm, 1)
    out = caplog.text
    if comm.rank == 0:
        ok = ('K-FAC assignment of 6 blocks to {} processes'.format(
            comm.size) in out and all('rank {}:'.format(r) in out
                                      for r in range(comm.size)))
    else:
        ok = out == ''  # logged once, by rank 0
    common.assert_everywhere(ok, 'assignment log:\n' + out)


def test_rejects_other_optimizers_and_communicators():
    with pytest.raises(TypeError, match='chainermn.create_multi_node'):
        common.create_multi_node_optimizer(
            chainer.optimizers.MomentumSGD(), common.naive())
    with pytest.raises(TypeError, match='ChainerMN communicator'):
        common.create_multi_node_optimizer(
            helpers.kfac(), object())
