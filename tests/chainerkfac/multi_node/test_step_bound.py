"""The bounded step across processes: N processes scale by the same ν as
one process accumulating the same N chunks, and every process reports the
same ν and metric (one partial sum per block, summed over processes in rank
order before any update)."""
import pytest

import chainer

from tests.chainerkfac.multi_node import common

pytestmark = pytest.mark.mpi

STEPS = 4


class _Scales(chainer.Reporter):
    def __init__(self):
        super().__init__()
        self.values = []

    def report(self, values, observer=None):
        if 'kfac/step_scale' in values:
            self.values.append((float(values['kfac/step_scale']),
                                float(values['kfac/step_metric'])))
        super().report(values, observer)


def _train(train, *args):
    reporter = _Scales()
    with reporter.scope({}):
        train(*args)
    return reporter.values


@pytest.mark.parametrize('stale', [False, True], ids=['fresh', 'stale'])
def test_n_ranks_scale_as_one_process(stale):
    comm = common.naive('float64')
    options = dict(lr=0.5, kl_clip=1e-3)
    if stale:
        options.update(refresh_interval_a=2, refresh_interval_g=2,
                       refresh_interval_f=3)
    model, optimizer = common.distributed(comm, **options)
    ref_model, ref_optimizer = common.single(acc_iters=comm.size, **options)
    initial = common.params(ref_model)
    mine = _train(common.train_distributed, model, optimizer, comm, STEPS)
    ref = _train(common.train_single, ref_model, ref_optimizer, comm.size,
                 STEPS)
    diff = common.max_relative_diff(common.params(model),
                                    common.params(ref_model))
    everyone = common.gathered(mine)
    common.assert_everywhere(all(s == everyone[0] for s in everyone),
                             'the same ν and metric bits on every rank')
    common.assert_everywhere(len(mine) == STEPS and all(
        abs(a[0] - b[0]) <= 1e-9 * b[0] and abs(a[1] - b[1]) <= 1e-9 * b[1]
        for a, b in zip(mine, ref)), 'ν and metric equal one process')
    # The bound was active: it is what is being compared.
    common.assert_everywhere(min(s for s, _ in ref) < 0.5, 'bound active')
    common.assert_everywhere(diff < 1e-9, 'weights: {}'.format(diff))
    common.assert_everywhere(
        common.max_relative_diff(common.params(ref_model), initial) > 1e-3,
        'weights moved')
