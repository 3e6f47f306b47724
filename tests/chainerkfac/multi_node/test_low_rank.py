"""Low-rank factors across processes: each process's columns travel in
its slice of a zero-padded buffer through the ReduceScatterV, the owner
inverts by Woodbury, and N processes take the steps one process takes
with dense factors and ``acc_iters = N`` (float64 wire)."""
import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from chainerkfac import low_rank
from tests.chainerkfac import helpers
from tests.chainerkfac.multi_node import common

pytestmark = pytest.mark.mpi


class WideMLP(chainer.Chain):
    """40 → 36 → 3, float64: with 4 samples per process l1's A (d = 41)
    and G (36) and l2's A (37) have at most 16 columns, low rank up to 4
    processes (budget ⌊d / 2⌋ / P ≥ 4 per process); accumulating two
    micro-batches, up to 2."""

    in_shape = (40,)

    def __init__(self, seed=0):
        super().__init__()
        state = numpy.random.get_state()
        numpy.random.seed(seed)
        with helpers.float64_links(), self.init_scope():
            self.l1 = L.Linear(40, 36)
            self.l2 = L.Linear(36, common.N_CLASS)
        numpy.random.set_state(state)

    def forward(self, x):
        return self.l2(F.tanh(self.l1(x)))



def _expected_low_rank(size, acc_iters):
    """The factors that are low rank: 4 · acc_iters columns per process
    within the budget, and the cost model's yes for the total."""
    factors = {('/l1', 'A'): (41, 36), ('/l1', 'G'): (36, 41),
               ('/l2', 'A'): (37, common.N_CLASS)}
    columns = common.CHUNK * acc_iters
    return {key for key, (dim, width) in factors.items()
            if columns <= low_rank.rank_budget(dim, size) and
            low_rank.pays(dim, columns * size, width, size)}


@pytest.mark.parametrize('acc_iters,stale', [(1, False), (2, True)],
                         ids=['fresh', 'accumulated-stale'])
def test_low_rank_across_processes_equals_one_dense_process(acc_iters,
                                                            stale):
    comm = common.naive('float64')
    options = dict(lr=0.2, acc_iters=acc_iters, weight_rescale=False)
    if stale:
        options.update(refresh_interval_a=2, refresh_interval_g=3)
    model, optimizer = common.distributed(comm, net=WideMLP, low_rank=True,
                                          **options)
    ref_model, ref_optimizer = common.single(
        net=WideMLP, low_rank=False,
        **dict(options, acc_iters=acc_iters * comm.size))
    initial = common.params(ref_model)
    common.train_distributed(model, optimizer, comm, 4)
    common.train_single(ref_model, ref_optimizer, comm.size * acc_iters, 4)
    diff = common.max_relative_diff(common.params(model),
                                    common.params(ref_model))
    held = {(b.name, n) for b in optimizer.blocks
            for n, f in b.factors.items() if isinstance(f, low_rank.LowRank)}
    owned = {(b.name, n) for b in optimizer.blocks
             if optimizer.transport.owns(b) for n in b.factor_names}
    expected = _expected_low_rank(comm.size, acc_iters)
    common.assert_everywhere(held == expected & owned,
                             'low rank where it pays: {}'.format(held))
    # Low rank is what is compared (it needs 8 columns within ⌊41/2⌋/P).
    common.assert_everywhere(expected or acc_iters * comm.size > 4,
                             'some factor low rank')
    common.assert_everywhere(diff < 1e-9, 'max relative diff {}'.format(
        diff))
    common.assert_everywhere(
        common.max_relative_diff(common.params(ref_model), initial) > 1e-3,
        'weights moved')


def test_a_low_rank_factor_sends_its_columns():
    """A refresh step's reduce-scatter carries, per low-rank factor, the
    d · k_total elements of the padded columns instead of the packed
    d (d + 1) / 2 of the dense factor (float32 wire)."""
    comm = common.naive('float32')
    sent = {}
    for low in (True, False):
        model, optimizer = common.distributed(comm, net=WideMLP, lr=0.2,
                                              weight_rescale=False,
                                              low_rank=low)
        comm.reset_byte_counts()
        common.train_distributed(model, optimizer, comm, 1)
        sent[low] = comm.bytes_sent['reduce_scatter_v']
    owners = optimizer.transport.assignment.owners
    dims = {('/l1', 'A'): 41, ('/l1', 'G'): 36, ('/l2', 'A'): 37}
    saved = 0
    for block, owner in zip(optimizer.blocks, owners):
        for name in block.factor_names:
            if (block.name, name) in _expected_low_rank(comm.size, 1):
                d, k = dims[(block.name, name)], common.CHUNK * comm.size
                saved += (d * (d + 1) // 2 - d * k) * len(owner)
    common.assert_everywhere(saved > 0, 'some factor low rank')
    common.assert_everywhere(sent[False] - sent[True] == 4 * saved,
                             'bytes {} (dense {}), saved {}'.format(
                                 sent[True], sent[False], 4 * saved))
