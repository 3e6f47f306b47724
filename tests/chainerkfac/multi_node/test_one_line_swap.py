"""The multi-node one-line swap on code written for ChainerMN: a plain
``chainermn.create_communicator('naive')``, lazily sized links, a head
that only some ranks call in some steps, and a hand-written loop on
processes that built their models with different weights — each against
one process accumulating the same chunks (the equivalence oracle)."""
import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
import chainermn

import chainerkfac
from tests.chainerkfac import helpers
from tests.chainerkfac.multi_node import common

pytestmark = pytest.mark.mpi

IN = 5


class LazyNet(chainer.Chain):
    """Linear(None) layers: sizes known only at the first forward."""

    def __init__(self):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.l1 = L.Linear(None, 6)
            self.l2 = L.Linear(None, common.N_CLASS)

    def forward(self, x):
        return self.l2(F.tanh(self.l1(x)))


class HeadNet(chainer.Chain):
    """A trunk and an auxiliary head that the loss calls only sometimes."""

    def __init__(self, seed):
        super().__init__()
        state = numpy.random.get_state()
        numpy.random.seed(seed)
        with helpers.float64_links(), self.init_scope():
            self.trunk = L.Linear(IN, 6)
            self.out = L.Linear(6, common.N_CLASS)
            self.head = L.Linear(6, common.N_CLASS)
        numpy.random.set_state(state)

    def loss(self, x, t, with_head):
        h = F.tanh(self.trunk(x))
        loss = F.softmax_cross_entropy(self.out(h), t)
        if with_head:
            loss += F.softmax_cross_entropy(self.head(h), t)
        return loss


def _options(**kw):
    return common.kfac_options(weight_rescale='auto', **kw)


def _chunks(step, n):
    return common.chunks(step, n, in_shape=(IN,))


def test_plain_chainermn_communicator_and_lazy_links():
    comm = chainermn.create_communicator('naive')
    assert not hasattr(comm, 'reduce_scatter_v')
    model = LazyNet()
    optimizer = chainerkfac.create_multi_node_optimizer(
        helpers.kfac(**_options()), comm)
    optimizer.setup(model)
    ref_model = LazyNet()
    ref = helpers.kfac(**_options(acc_iters=comm.size,
                                  process_local=True)).setup(ref_model)
    for step in range(4):
        chunks = _chunks(step, comm.size)
        # The first forward initialises the links: values differ by rank;
        # the reference has rank 0's.
        numpy.random.seed(100 + comm.rank)
        optimizer.update(helpers.loss_of(model), *chunks[comm.rank])
        numpy.random.seed(100)
        for x, t in chunks:
            ref.update(helpers.loss_of(ref_model), x, t)
        if step == 0:   # the links are initialised by now
            first = common.params(ref_model)
    diff = common.max_relative_diff(common.params(model),
                                    common.params(ref_model))
    # Steps 1-3 changed the weights (two runs doing nothing would agree).
    moved = common.max_relative_diff(common.params(ref_model), first)
    # K-FAC's collectives beside a plain communicator use the default fp32
    # wire (the float64 model's sums are rounded, as in test_float32_wire).
    common.assert_everywhere(
        diff < 1e-4 and optimizer.t == 4 and moved > 1e-3,
        'plain communicator + Linear(None) (diff {}, moved {})'.format(
            diff, moved))
    common.assert_everywhere(
        type(optimizer.transport.collectives).__name__ == 'KfacCollectives',
        'collectives beside the plain communicator')


def _head_called(step, chunk):
    # Chunk 0 calls the head on even steps, chunk 1 on every step, others
    # never; step 3 calls it nowhere.
    if step == 3:
        return False
    return chunk == 1 or (chunk == 0 and step % 2 == 0)


def test_head_called_by_some_ranks_only():
    comm = common.naive('float64')
    model = HeadNet(seed=comm.rank)
    optimizer = common.create_multi_node_optimizer(
        helpers.kfac(**_options(refresh_interval_a=2)), comm)
    optimizer.setup(model)
    ref_model = HeadNet(seed=0)
    ref = helpers.kfac(**_options(acc_iters=comm.size, refresh_interval_a=2,
                                  process_local=True)).setup(ref_model)
    head_before_step3 = None
    for step in range(5):
        if step == 3:
            head_before_step3 = ref_model.head.W.array.copy()
        chunks = _chunks(step, comm.size)
        x, t = chunks[comm.rank]
        optimizer.update(model.loss, x, t, _head_called(step, comm.rank))
        for i, (x, t) in enumerate(chunks):
            ref.update(ref_model.loss, x, t, _head_called(step, i))
        if step == 3:
            # Nobody called the head: it is not updated.
            numpy.testing.assert_array_equal(ref_model.head.W.array,
                                             head_before_step3)
    diff = common.max_relative_diff(common.params(model),
                                    common.params(ref_model))
    finite = all(numpy.isfinite(p.array).all() for p in model.params())
    moved = common.max_relative_diff(common.params(ref_model),
                                     common.params(HeadNet(seed=0)))
    common.assert_everywhere(diff < 1e-9 and finite and moved > 1e-3,
                             'head called by some ranks (diff {})'.format(
                                 diff))


def test_manual_loop_with_different_initial_weights():
    """``loss.backward(); optimizer.update()`` on processes whose models
    were built with different weights (ChainerMN's usual case: each rank
    builds its own and relies on the broadcast). The first micro-batch,
    computed before rank 0's weights arrived, is dropped on every process
    (it was dropped on the other ranks only, and rank 0 then waited in a
    collective of a step they never took: a hang)."""
    comm = common.naive('float64')
    model = HeadNet(seed=comm.rank)
    optimizer = common.create_multi_node_optimizer(
        helpers.kfac(**_options()), comm)
    optimizer.setup(model)
    ref_model = HeadNet(seed=0)
    ref = helpers.kfac(**_options(acc_iters=comm.size,
                                  process_local=True)).setup(ref_model)
    dropped = comm.size > 1     # one process has nothing to replace
    for step in range(4):
        chunks = _chunks(step, comm.size)
        x, t = chunks[comm.rank]
        model.cleargrads()
        model.loss(x, t, False).backward()
        optimizer.update()
        if step == 0 and dropped:
            continue    # the reference never sees it
        for x, t in chunks:
            ref.update(ref_model.loss, x, t, False)
    diff = common.max_relative_diff(common.params(model),
                                    common.params(ref_model))
    moved = common.max_relative_diff(common.params(ref_model),
                                     common.params(HeadNet(seed=0)))
    common.assert_everywhere(
        optimizer.t == 4 - dropped and diff < 1e-9 and moved > 1e-3,
        'manual loop, different initial weights (t {}, diff {})'.format(
            optimizer.t, diff))
