"""Bytes per step: a stale step sends the gradients only (like SGD), a
refresh step adds the due factors, symmetric ones packed as triangles."""
import pytest

from tests.chainerkfac.multi_node import common

pytestmark = pytest.mark.mpi

ITEMSIZE = 4  # float32 wire


def _analytic(optimizer, rank):
    """(gradient, factor) bytes of the reduce-scatter and the all-gather
    bytes this rank sends, from the assignment."""
    owners = optimizer.transport.assignment.owners
    grad_rs = factor_rs = all_gather = 0
    for block, owner in zip(optimizer.blocks, owners):
        size = sum(p.size for p in block.params)
        grad_rs += size * len(owner)
        if owner[0] == rank:
            all_gather += size
        for name, shape in block.factor_shapes().items():
            n = shape[0]
            elements = n * (n + 1) // 2 if len(shape) == 2 else n
            factor_rs += elements * len(owner)
    return grad_rs * ITEMSIZE, factor_rs * ITEMSIZE, all_gather * ITEMSIZE


@pytest.mark.parametrize('bn_fisher', ['full', 'diag'])
def test_stale_steps_send_only_gradients(bn_fisher):
    comm = common.naive('float32')
    # Dense factors (low-rank ones send their columns instead:
    # test_low_rank.py counts those).
    model, optimizer = common.distributed(
        comm, bn_fisher=bn_fisher, refresh_interval_a=2,
        refresh_interval_g=2, refresh_interval_f=2, low_rank=False)
    sent = []
    for step in range(3):  # refresh, stale, refresh
        comm.reset_byte_counts()
        common.train_distributed(model, optimizer, comm, 1, first_step=step)
        sent.append(comm.bytes_sent)
    grad_rs, factor_rs, all_gather = _analytic(optimizer, comm.rank)
    expected = [
        {'reduce_scatter_v': grad_rs + factor_rs, 'all_gather_v': all_gather},
        {'reduce_scatter_v': grad_rs, 'all_gather_v': all_gather},
        {'reduce_scatter_v': grad_rs + factor_rs, 'all_gather_v': all_gather},
    ]
    common.assert_everywhere(sent == expected,
                             'bytes {} == {}'.format(sent, expected))
    # Every gradient element leaves each rank once (per owner) and comes
    # back once: with one owner per block, the bytes of an SGD all-reduce.
    total_ag = sum(common.gathered(sent[1]['all_gather_v']))
    common.assert_everywhere(total_ag == sum(
        p.size for p in model.params()) * ITEMSIZE,
        'all-gather covers every parameter once')
