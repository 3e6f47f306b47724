"""Under ``mpiexec -n P``: K-FAC knows its communicator through the
library's function and through ChainerMN's wrapper — ChainerMN's own
class, and a user's subclass whose ``update`` reaches K-FAC through a
helper function (no wrapper in the calling frame) — and all three take
the same steps as one process; a plain ``KFAC`` without a communicator
raises on every process when P > 1 (the error, not silent drift), and
``process_local=True`` keeps process-local factors."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import chainermn
import pytest

from tests.chainerkfac import helpers
from tests.chainerkfac.multi_node import common

STEPS = 2
TOLERANCE = 1e-12


def _step_of(optimizer):
    """A user's helper: the wrapper's K-FAC is updated from here."""
    optimizer.actual_optimizer.update()


class UserWrapper(chainermn.optimizers._MultiNodeOptimizer):
    """A user's subclass of ChainerMN's wrapper with its own ``update``:
    average the gradients, count, step through a helper."""

    def __init__(self, actual_optimizer, communicator):
        super().__init__(actual_optimizer, communicator, zero_fill=True)
        object.__setattr__(self, 'steps_seen', 0)

    def update(self, lossfun=None, *args, **kwds):
        target = self.target
        if lossfun is not None:
            target.cleargrads()
            lossfun(*args, **kwds).backward()
        if self.is_changed(target):
            self.communicator.bcast_data(target)
            return
        self.communicator.multi_node_mean_grad(target, self.zero_fill)
        object.__setattr__(self, 'steps_seen', self.steps_seen + 1)
        _step_of(self)


def _wrapped(comm, how):
    model = common.ConvBNNet(seed=comm.rank)   # the broadcast fixes it
    kfac = helpers.kfac(**common.kfac_options())
    if how == 'chainerkfac':
        optimizer = chainerkfac.create_multi_node_optimizer(kfac, comm)
    elif how == 'chainermn':
        optimizer = chainermn.create_multi_node_optimizer(kfac, comm)
    else:
        optimizer = UserWrapper(kfac, comm)
    optimizer.setup(model)
    return model, optimizer, kfac


@pytest.mark.mpi
@pytest.mark.parametrize('how', ['chainerkfac', 'chainermn', 'subclass'])
def test_communicator_known_every_way_and_the_steps_equal_one_process(how):
    comm = common.naive()
    model, optimizer, kfac = _wrapped(comm, how)
    lossfun = helpers.loss_of(model)
    if how != 'chainerkfac':
        # ChainerMN's wrappers spend their first update on the broadcast.
        x, t = common.chunks(0, comm.size, 0, model.in_shape)[comm.rank]
        optimizer.update(lossfun, x, t)
        assert kfac.t == 0
    for step in range(1, STEPS + 1):
        x, t = common.chunks(step, comm.size, 0, model.in_shape)[comm.rank]
        optimizer.update(lossfun, x, t)
    common.assert_everywhere(
        kfac.t == STEPS and kfac.transport.size == comm.size and
        kfac.gradients_reduced == (how != 'chainerkfac'),
        '{}: K-FAC over the communicator'.format(how))
    if how == 'subclass':
        assert optimizer.steps_seen == STEPS
    single, single_optimizer = common.single(acc_iters=comm.size)
    common.train_single(single, single_optimizer, comm.size, STEPS,
                        first_step=1)
    common.assert_everywhere(
        common.max_relative_diff(common.params(model),
                                 common.params(single)) < TOLERANCE,
        '{} == one process with acc_iters = P'.format(how))


@pytest.mark.mpi
@pytest.mark.parametrize('manual', [False, True])
def test_plain_kfac_raises_in_a_group_and_runs_alone(manual):
    comm = common.naive()
    model = common.ConvBNNet(seed=0)
    optimizer = helpers.kfac(**common.kfac_options()).setup(model)
    x, t = common.chunks(0, comm.size, 0, model.in_shape)[comm.rank]
    if comm.size == 1:
        helpers.update(optimizer, model, helpers.loss_of(model), x, t,
                       manual)
        assert optimizer.t == 1
        return
    with pytest.raises(RuntimeError) as info:
        helpers.update(optimizer, model, helpers.loss_of(model), x, t,
                       manual)
    message = str(info.value)
    assert 'group of {} processes'.format(comm.size) in message
    assert 'chainerkfac.create_multi_node_optimizer' in message
    assert 'process_local=True' in message
    assert optimizer.t == 0


@pytest.mark.mpi
def test_process_local_factors_on_purpose():
    comm = common.naive()
    model = common.ConvBNNet(seed=comm.rank)
    optimizer = helpers.kfac(**common.kfac_options(
        process_local=True)).setup(model)
    x, t = common.chunks(0, comm.size, 0, model.in_shape)[comm.rank]
    optimizer.update(helpers.loss_of(model), x, t)
    assert optimizer.t == 1 and optimizer.transport.size == 1
