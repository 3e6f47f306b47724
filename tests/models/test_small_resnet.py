import chainer
import chainer.links as L
import numpy as np
import pytest

from models import SmallResNet
from tests.models.test_resnet import count_layers, run


@pytest.mark.parametrize('depth, n_blocks', [(8, 1), (14, 2), (20, 3)])
def test_depth_and_layers(depth, n_blocks):
    model = SmallResNet(depth=depth, width=4, n_class=3)
    counts = count_layers(model)
    n_convs = 1 + 3 * n_blocks * 2 + 2  # stem, blocks, 2 projections
    assert counts == {'Convolution2D': n_convs,
                      'BatchNormalization': n_convs, 'Linear': 1}
    # depth counts the weighted layers of the main path
    assert n_convs - 2 + 1 == depth
    assert run(model, (2, 3, 32, 32)).shape == (2, 3)


def test_width_and_strides():
    model = SmallResNet(depth=8, width=16, n_class=10)
    assert model.stage3[0].conv1.W.shape == (64, 32, 3, 3)
    assert model.stage2[0].conv1.stride == (2, 2)
    assert model.fc.W.shape == (10, 64)


@pytest.mark.parametrize('depth', [0, 7, 9, 10])
def test_bad_depth(depth):
    with pytest.raises(ValueError, match='6n\\+2'):
        SmallResNet(depth=depth)


def test_trains_one_step():
    model = L.Classifier(SmallResNet(depth=8, width=4, n_class=3))
    optimizer = chainer.optimizers.MomentumSGD(lr=0.1)
    optimizer.setup(model)
    rng = np.random.RandomState(0)
    x = rng.randn(4, 3, 32, 32).astype(np.float32)
    t = np.array([0, 1, 2, 0], dtype=np.int32)
    before = {n: p.array.copy() for n, p in model.namedparams()}
    optimizer.update(model, x, t)
    assert all(p.grad is not None and np.all(np.isfinite(p.grad))
               for p in model.params())
    # The step changed every parameter (finite gradients of a step that did
    # nothing would pass the line above).
    for name, param in model.namedparams():
        assert np.abs(param.array - before[name]).max() > 0, name
