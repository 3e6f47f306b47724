"""Simultaneous training: with exact solves it is layer-serial training;
with m1 = m2 = 2 it still learns."""
import numpy

import chainer
import chainer.functions as F

from chainerkfac import layer_parallel as lp
from chainerkfac.layer_parallel import data
from tests.chainerkfac.layer_parallel import common


def test_converged_solves_train_exactly_like_the_serial_network():
    net = common.dense_net(n_layers=16)
    serial_net = net.copy(mode='copy')
    x, t = common.batch(net, size=10)
    training = lp.SimultaneousTraining(
        lp.MGRIT(net, tol=1e-14), chainer.optimizers.Adam(alpha=1e-2),
        m1=40, m2=40)
    serial = chainer.optimizers.Adam(alpha=1e-2).setup(serial_net)
    for _ in range(5):
        result = training.step(x, t)
        serial.update(lambda: F.softmax_cross_entropy(serial_net(x), t))
    assert result.state_residual <= 1e-14
    reference = dict(serial_net.namedparams())
    for name, param in net.namedparams():
        numpy.testing.assert_allclose(param.array, reference[name].array,
                                      rtol=1e-10, atol=1e-12, err_msg=name)


def test_two_iterations_per_step_learn_peaks():
    x, t = data.peaks_dataset(40, seed=0)
    net = common.dense_net(n_layers=32, width=8, n_out=5)
    training = lp.SimultaneousTraining(
        lp.MGRIT(net), chainer.optimizers.Adam(alpha=2e-2), m1=2, m2=2)
    results = [training.step(x, t) for _ in range(60)]
    assert results[-1].loss < 0.7 * results[0].loss
    assert results[-1].accuracy > results[0].accuracy + 0.2


def test_options_are_checked_also_when_set_later():
    """``smoothness`` was never checked (-1 rewarded rough weights; NaN
    made every weight NaN after one step), and ``m1`` / ``m2`` only at
    construction (``m1 = True`` ran one iteration)."""
    import pytest
    net = common.dense_net(n_layers=8)
    optimizer = chainer.optimizers.Adam(alpha=1e-2)
    for value in (-1.0, float('nan'), float('inf'), True,
                  numpy.complex128(1)):
        with pytest.raises(ValueError, match='smoothness'):
            lp.SimultaneousTraining(lp.MGRIT(net), optimizer,
                                    smoothness=value)
    training = lp.SimultaneousTraining(lp.MGRIT(net), optimizer)
    for name, value in [('smoothness', float('nan')), ('m1', True),
                        ('m2', 0), ('m1', 2.0)]:
        with pytest.raises(ValueError, match=name):
            setattr(training, name, value)
    training.smoothness, training.m1 = 0.5, 3
    assert (training.smoothness, training.m1) == (0.5, 3)
