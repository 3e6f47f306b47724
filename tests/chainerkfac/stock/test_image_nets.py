"""The image classifiers of Chainer's examples, each trained as its
script does (``update(model, x, t)`` from a ``StandardUpdater``) with
only the optimizer line changed: 3 updates at the cost guard
``max_factor_dim`` = :data:`common.MAX_FACTOR_DIM`.

The ImageNet-sized ones at their input size (224² / 227², batch 2; VGG16
batch 1) or at 32² (ResNet-101, ResNeXt-50, batch 4) are slow on a CPU
and marked so; the largest (VGG16, GoogLeNet-BN, ResNet-101, ResNeXt-50)
run with the tighter guard :data:`common.CPU_MAX_FACTOR_DIM` to stay
near 30 s.
"""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import pytest

from tests.chainerkfac.stock import common
from tests.chainerkfac.stock import nets


def _train(build, caplog, limit=common.MAX_FACTOR_DIM):
    trainee = build().setup(lambda: common.kfac(max_factor_dim=limit))
    before, reports, warnings = common.train(trainee, caplog)
    [table] = common.check_trained(trainee, before, reports, warnings,
                                   max_factor_dim=limit)
    return trainee.optimizers[0], common.rows_of(table)


def test_cifar_vgg_with_bn(caplog):
    optimizer, rows = _train(nets.cifar_vgg(batch=8), caplog)
    assert sum('Conv2D (K-FAC)' in r for r in rows.values()) == 13
    assert sum('BN (full Fisher)' in r for r in rows.values()) == 14
    # 512 channels after 256 or 512: A of 2304 or 4608 > the limit.
    assert 'A 4608 (diag), G 512x512' in rows['/predictor/block5_3/conv']
    assert 'A 2304 (diag), G 512x512' in rows['/predictor/block4_1/conv']
    assert 'A 1152x1152, G 256x256' in rows['/predictor/block3_1/conv']


def test_nin(caplog):
    optimizer, rows = _train(nets.image_classifier(nets.NIN, 2, 227),
                             caplog)
    # Every convolution of the four mlpconv stacks.
    assert sum('Conv2D (K-FAC)' in r for r in rows.values()) == 12


@pytest.mark.slow
def test_alexnet(caplog):
    optimizer, rows = _train(nets.image_classifier(nets.AlexNet, 2, 227),
                             caplog)
    assert 'A 9217 (diag), G 4096 (diag)' in rows['/predictor/fc6']
    assert 'A 4097 (diag), G 1000x1000' in rows['/predictor/fc8']


@pytest.mark.slow
def test_googlenet_bn_with_auxiliary_heads(caplog):
    optimizer, rows = _train(nets.image_loss(nets.GoogLeNetBN, 2, 224),
                             caplog, limit=common.CPU_MAX_FACTOR_DIM)
    # The auxiliary heads' links are preconditioned like the rest.
    for name in ('/conva', '/lina', '/outa', '/convb', '/linb', '/outb',
                 '/norma', '/norma2', '/normb', '/normb2'):
        assert 'K-FAC' in rows[name] or 'BN (' in rows[name], rows[name]
    # The heads' BN of 1024 channels: a 2048² Fisher.
    assert 'BN (diagonal Fisher)' in rows['/norma2']


@pytest.mark.slow
def test_googlenet_with_auxiliary_heads(caplog):
    optimizer, rows = _train(nets.image_loss(nets.GoogLeNetTrainer, 2, 224),
                             caplog)
    for name in ('/net/loss1_conv', '/net/loss1_fc1', '/net/loss1_fc2',
                 '/net/loss2_conv', '/net/loss2_fc1', '/net/loss2_fc2',
                 '/net/loss3_fc'):
        assert 'K-FAC' in rows[name], rows[name]


@pytest.mark.slow
def test_vgg16_layers_at_224(caplog):
    optimizer, rows = _train(
        nets.image_classifier(nets.vgg16_layers, 1, 224), caplog,
        limit=common.CPU_MAX_FACTOR_DIM)
    # fc6's A would be 25089² (2.5 GB in float32).
    assert 'A 25089 (diag), G 4096 (diag)' in rows['/predictor/net/fc6']
    assert 'A diagonal (25089 > max_factor_dim=' in rows['/predictor/net/fc6']


@pytest.mark.slow
def test_resnet101_layers(caplog):
    optimizer, rows = _train(
        nets.image_classifier(nets.resnet101_layers, 4, 32), caplog,
        limit=common.CPU_MAX_FACTOR_DIM)
    assert sum('Conv2D (K-FAC)' in r for r in rows.values()) == 104
    assert 'BN (diagonal Fisher)' in rows['/predictor/net/res5/a/bn3']


@pytest.mark.slow
def test_resnext50(caplog):
    optimizer, rows = _train(nets.image_classifier(nets.ResNeXt50, 4, 32),
                             caplog, limit=common.CPU_MAX_FACTOR_DIM)
    grouped = [r for r in rows.values() if 'grouped convolution' in r]
    assert len(grouped) == 16       # one 3×3 per bottleneck: plain
    assert sum('Conv2D (K-FAC)' in r for r in rows.values()) == 1 + 16 * 2 + 4
