"""K-FAC on layer-parallel training, one process: with converged solves it
is serial K-FAC training of the same ResidualODE; with two iterations per
step it still learns; the factors are those of the serial graph.

Tolerances: converged MGRIT reproduces the serial states, adjoints and
gradients to ~1e-14 (test_mgrit.py); K-FAC's damped inverses (damping
1e-2 here, a condition number below ~1e3) and five steps keep that under
1e-10, the issue's bound.
"""
import numpy
import pytest

import chainer
import chainer.functions as F

from chainerkfac.optimizers import KFAC
from chainerkfac import layer_parallel as lp
from chainerkfac import low_rank
from chainerkfac.layer_parallel import data
from tests.chainerkfac.layer_parallel import common

KFAC_OPTIONS = dict(lr=0.05, momentum=0.9, damping=1e-2, verbose=False)


def serial_kfac(net, x, t, steps):
    optimizer = KFAC(**KFAC_OPTIONS).setup(net)
    for _ in range(steps):
        optimizer.update(lambda: F.softmax_cross_entropy(net(x), t))
    return optimizer


@pytest.mark.parametrize('make', [
    lambda: common.dense_net(n_layers=16),
    lambda: common.conv_net(n_layers=9, width=2),
])
def test_converged_mgrit_with_kfac_is_serial_kfac(make):
    net, serial_net = make(), make()
    x, t = common.batch(net, size=10)
    training = lp.SimultaneousTraining(
        lp.MGRIT(net, tol=1e-14, max_iter=60), KFAC(**KFAC_OPTIONS),
        m1=60, m2=60)
    for _ in range(5):
        result = training.step(x, t)
    assert result.state_residual <= 1e-14
    assert result.adjoint_residual <= 1e-14
    serial = serial_kfac(serial_net, x, t, 5)
    reference = dict(serial_net.namedparams())
    for name, param in net.namedparams():
        numpy.testing.assert_allclose(param.array, reference[name].array,
                                      rtol=0, atol=1e-10, err_msg=name)
    # K-FAC preconditioned every layer (it is not the plain gradient).
    blocks = [b for b in training.optimizer.blocks if b.factor_names]
    assert len(blocks) == net.n_layers + 2
    assert all(b.has_inverses() for b in blocks)
    for block, serial_block in zip(blocks, [
            b for b in serial.blocks if b.factor_names]):
        assert block.name == serial_block.name
        for factor in ('A', 'G'):
            numpy.testing.assert_allclose(
                low_rank.dense(block.factors[factor]),
                low_rank.dense(serial_block.factors[factor]),
                rtol=1e-10, atol=1e-13, err_msg=block.name + factor)
    moved = max(float(abs(p.array - q.array).max()) for p, q in zip(
        net.params(), make().params()))
    assert moved > 1e-3


def test_two_iterations_per_step_with_kfac_learn_peaks():
    x, t = data.peaks_dataset(40, seed=0)
    net = common.dense_net(n_layers=32, width=8, n_out=5)
    training = lp.SimultaneousTraining(
        lp.MGRIT(net), KFAC(lr=0.05, momentum=0.9, damping=1e-2,
                            verbose=False), m1=2, m2=2)
    results = [training.step(x, t) for _ in range(40)]
    assert results[-1].loss < 0.7 * results[0].loss
    assert results[-1].accuracy > results[0].accuracy + 0.2


def test_setup_errors_name_the_problem():
    net = common.dense_net(n_layers=4)
    with pytest.raises(ValueError, match="fisher='emp' only"):
        lp.setup_kfac(KFAC(fisher='mc'), lp.MGRIT(net))
    optimizer = KFAC().setup(net)
    with pytest.raises(ValueError, match='before optimizer.setup'):
        lp.setup_kfac(optimizer, lp.MGRIT(net))
    with pytest.raises(TypeError, match='KFAC'):
        lp.setup_kfac(chainer.optimizers.Adam(), lp.MGRIT(net))


def test_fisher_set_after_setup_kfac_is_refused_as_at_setup():
    """``optimizer.fisher = 'mc'`` after ``setup_kfac`` used to fail at the
    next step, advising ``optimizer.update(lossfun)``, which layer-parallel
    training cannot take. It is refused at once, with the reason setup
    gives; 'emp' is still taken, and K-FAC alone still takes 'mc'."""
    net = common.dense_net(n_layers=4)
    x, t = common.batch(net, size=6)
    optimizer = KFAC(**KFAC_OPTIONS)
    training = lp.SimultaneousTraining(lp.MGRIT(net), optimizer)
    training.step(x, t)
    for value in ('mc', 'exact'):
        with pytest.raises(ValueError, match="fisher='emp' only, not '{}'"
                           .format(value)):
            optimizer.fisher = value
    assert optimizer.fisher == 'emp'
    optimizer.fisher = 'emp'
    training.step(x, t)
    alone = KFAC(**KFAC_OPTIONS).setup(common.dense_net(n_layers=4))
    alone.fisher = 'mc'
    assert alone.fisher == 'mc'
