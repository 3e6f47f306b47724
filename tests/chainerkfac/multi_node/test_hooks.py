"""Chainer's hooks across processes: penalties act on each process's
gradient (linear: the mean is the same), clipping on the gathered
directions every process holds, so N processes take the step of one
process accumulating the N chunks."""
import pytest

from chainer import optimizer_hooks

from tests.chainerkfac.multi_node import common

pytestmark = pytest.mark.mpi


def _hooks():
    return [optimizer_hooks.WeightDecay(1e-3),
            optimizer_hooks.GradientClipping(0.05),
            optimizer_hooks.GradientHardClipping(-2e-3, 2e-3)]


def test_hooks_act_alike_on_n_ranks_and_one_process():
    comm = common.naive('float64')
    model, optimizer = common.distributed(comm, lr=0.5)
    ref_model, ref_optimizer = common.single(acc_iters=comm.size, lr=0.5)
    for opt in (optimizer, ref_optimizer):
        for hook in _hooks():
            opt.add_hook(hook)
    common.train_distributed(model, optimizer, comm, 3)
    common.train_single(ref_model, ref_optimizer, comm.size, 3)
    diff = common.max_relative_diff(common.params(model),
                                    common.params(ref_model))
    common.assert_everywhere(diff < 1e-9, 'max relative diff {}'.format(
        diff))
    # The hooks changed the steps (what is compared is their effect).
    free_model, free_optimizer = common.single(acc_iters=comm.size, lr=0.5)
    common.train_single(free_model, free_optimizer, comm.size, 3)
    effect = common.max_relative_diff(common.params(free_model),
                                      common.params(ref_model))
    common.assert_everywhere(effect > 1e-3, 'hooks acted: {}'.format(
        effect))
