"""ChainerMN's MultiNodeBatchNormalization (``create_mnbn_model``) under
distributed K-FAC: the BN block, as ``L.BatchNormalization`` gets (it got
the plain gradient, and eq. (20) 'auto' no longer rescaled the
convolutions before it), so that N processes with synchronised BN take the
steps of one process with BatchNormalization on the global batch.

Tolerance: float64, 3 steps of damped (γ ≥ 2e-3) inverses of matrices of
size ≤ 37: the two runs add the same numbers in other orders (rounding
~1e-16 per operation, amplified by the inverses' condition ≲ 1e4).
"""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import numpy
import pytest

import chainermn

from tests.chainerkfac import helpers
from tests.chainerkfac.multi_node import common

STEPS = 3
TOLERANCE = 1e-10


@pytest.mark.mpi
def test_synchronised_bn_on_n_processes_is_bn_on_the_global_batch():
    comm = common.naive()
    options = dict(weight_rescale='auto', refresh_interval_a=1,
                   refresh_interval_g=1, refresh_interval_f=1)
    model = chainermn.links.create_mnbn_model(common.ConvBNNet(seed=0),
                                              comm)
    optimizer = chainerkfac.create_multi_node_optimizer(
        helpers.kfac(**common.kfac_options(**options)), comm)
    optimizer.setup(model)
    reference = common.ConvBNNet(seed=0)
    single = helpers.kfac(**common.kfac_options(process_local=True,
                                                **options))
    single.setup(reference)
    for step in range(STEPS):
        batch = common.chunks(step, comm.size)
        optimizer.update(helpers.loss_of(model), *batch[comm.rank])
        x = numpy.concatenate([x for x, _ in batch])
        t = numpy.concatenate([t for _, t in batch])
        single.update(helpers.loss_of(reference), x, t)
    kinds = {block.name: block.kind for block in optimizer.blocks}
    common.assert_everywhere(kinds['/bn1'] == kinds['/bn2'] ==
                             'BN (full Fisher)', 'the BN block: {}'.format(
                                 kinds))
    rescaled = sorted(optimizer.rescaled_params())
    common.assert_everywhere(rescaled == sorted(single.rescaled_params()) ==
                             ['/conv1/W', '/conv2/W'],
                             'eq. (20): {}'.format(rescaled))
    diff = common.max_relative_diff(common.params(model),
                                    common.params(reference))
    common.assert_everywhere(diff < TOLERANCE, 'parameters {}'.format(diff))
