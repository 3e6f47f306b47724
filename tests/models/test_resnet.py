import collections

import chainer
import chainer.links as L
import numpy as np

from models import ResNet50, ResNet50D


def count_layers(model):
    counts = collections.Counter()
    for _, link in model.namedlinks(skipself=True):
        for cls in (L.Convolution2D, L.BatchNormalization, L.Linear):
            if type(link) is cls:
                counts[cls.__name__] += 1
    return counts


def run(model, shape):
    x = np.random.RandomState(0).randn(*shape).astype(np.float32)
    with chainer.using_config('train', False), \
            chainer.no_backprop_mode():
        return model(x)


def test_resnet50_has_the_107_kfac_layers_of_the_paper():
    model = ResNet50()
    counts = count_layers(model)
    assert counts == {'Convolution2D': 53, 'BatchNormalization': 53,
                      'Linear': 1}
    assert sum(counts.values()) == 107


def test_resnet50_structure():
    model = ResNet50(n_class=7)
    convs = [link for _, link in model.namedlinks()
             if isinstance(link, L.Convolution2D)]
    assert all(conv.b is None for conv in convs)
    assert model.conv1.W.shape == (64, 3, 7, 7)
    assert model.conv1.stride == (2, 2) and model.conv1.pad == (3, 3)
    assert [len(stage) for stage in
            (model.res2, model.res3, model.res4, model.res5)] == [3, 4, 6, 3]
    # v1: the downsampling stride is on the first 1x1 convolution.
    first = model.res3[0]
    assert first.conv1.stride == (2, 2) and first.conv2.stride == (1, 1)
    assert first.conv_shortcut.stride == (2, 2)
    assert model.fc.W.shape == (7, 2048)
    n_params = sum(p.size for p in ResNet50().params())
    assert n_params == 25557032  # torchvision's resnet50, also bias-free


def test_resnet50_forward_shape():
    y = run(ResNet50(n_class=5), (1, 3, 64, 64))
    assert y.shape == (1, 5)
    assert np.all(np.isfinite(y.array))


def test_resnet50d_structure_and_forward():
    model = ResNet50D(n_class=5)
    counts = count_layers(model)
    assert counts == {'Convolution2D': 55, 'BatchNormalization': 55,
                      'Linear': 1}
    first = model.res3[0]
    assert first.conv1.stride == (1, 1) and first.conv2.stride == (2, 2)
    assert first.conv_shortcut.stride == (1, 1) and first.avg_down
    assert model.conv1_1.W.shape == (32, 3, 3, 3)
    assert run(model, (1, 3, 64, 64)).shape == (1, 5)
    # Odd sizes inside the network (56 → 28 → 14 → 7 → 4 → 2).
    assert run(model, (1, 3, 56, 56)).shape == (1, 5)


def test_resnet50_registers_107_kfac_layers_in_the_optimizer():
    import chainerkfac
    # The paper's blocks: no cost guard, as the ImageNet configs.
    optimizer = chainerkfac.optimizers.KFAC(verbose=False,
                                            max_factor_dim=None)
    optimizer.setup(ResNet50())
    kinds = [b.kind for b in optimizer.blocks if b.factor_names]
    assert len(kinds) == 107
    assert kinds.count('Conv2D (K-FAC)') == 53
    assert kinds.count('BN (full Fisher)') == 53
    assert kinds.count('Linear (K-FAC)') == 1
    assert 'with the plain gradient' in optimizer.registration_table()
    assert all(b.factor_names for b in optimizer.blocks)


def test_resnet50_auto_rescale_is_every_conv_and_not_the_fc():
    """Eq. (20) with weight_rescale='auto': every convolution of ResNet-50
    feeds a BatchNormalization (scale invariant); the FC feeds the softmax
    and is left alone (the paper rescales it too: weight_rescale=True)."""
    import chainerkfac
    import chainer.functions as F
    model = ResNet50(n_class=4)
    optimizer = chainerkfac.optimizers.KFAC(lr=0.0, momentum=0.0,
                                            verbose=False,
                                            refresh_interval_a=100,
                                            refresh_interval_g=100,
                                            refresh_interval_f=100)
    optimizer.setup(model)
    x = np.random.RandomState(0).rand(2, 3, 32, 32).astype(np.float32)
    t = np.array([0, 1], np.int32)
    optimizer.update(lambda x, t: F.softmax_cross_entropy(model(x), t), x, t)
    rescaled = set(optimizer.rescaled_params())
    convs = {name for name, _ in model.namedparams()
             if name.endswith('/W') and 'conv' in name}
    assert len(convs) == 53
    assert rescaled == convs
    paper = chainerkfac.optimizers.KFAC(weight_rescale=True, verbose=False)
    paper.setup(ResNet50(n_class=4))
    assert set(paper.rescaled_params()) == convs | {'/fc/W'}
