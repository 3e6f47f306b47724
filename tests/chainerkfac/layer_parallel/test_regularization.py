"""The time-derivative regularisation: the layer-parallel gradient is
Chainer's of the layer-serial penalty; smooth initial weights are linear
in the layer index."""
import numpy
import pytest

from chainerkfac import layer_parallel as lp
from tests.chainerkfac.layer_parallel import common


def test_layer_parallel_penalty_and_gradient_are_chainers():
    net = common.dense_net(n_layers=10)
    rng = numpy.random.RandomState(2)
    for param in net.params():
        param.array += 0.1 * rng.standard_normal(param.shape)
    net.cleargrads()
    penalty = lp.time_smoothness(net, 0.3)
    penalty.backward()
    expected = {name: param.grad.copy()
                for name, param in net.namedparams() if '/layers/' in name}
    net.cleargrads()
    value = lp.accumulate_time_smoothness(lp.MGRIT(net), 0.3)
    assert value == pytest.approx(float(penalty.array), rel=1e-13)
    for name, param in net.namedparams():
        if '/layers/' in name:
            numpy.testing.assert_allclose(param.grad, expected[name],
                                          rtol=1e-12, atol=1e-14)
        else:
            assert param.grad is None         # only residual layers


def test_smooth_weights_are_linear_in_the_layer_index():
    net = common.dense_net(n_layers=7, weights='smooth')
    weights = numpy.stack([link.W.array for link in net.layers])
    steps = numpy.diff(weights, axis=0)
    numpy.testing.assert_allclose(steps, steps[:1].repeat(6, axis=0),
                                  atol=1e-15)
    assert abs(steps).max() > 0
    with pytest.raises(ValueError, match='weights must be'):
        common.dense_net(weights='rough')
