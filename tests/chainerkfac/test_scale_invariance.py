"""Eq. (20) 'auto' against the definition it stands for: a weight is
rescaled if and only if multiplying it alone by a positive constant leaves
the network's training-mode output unchanged (up to BatchNormalization's
ε). The oracle multiplies each Linear / Convolution2D kernel by 3.7 in a
float64 model whose biases, γ and β are random (Chainer's zero biases would
make ReLU, padding and dropout look invariant) and compares the outputs.

BN's ε is set to 1e-12 so that invariant layers move the output by
float64 rounding times the network's conditioning (< 1e-9 relative; with
Chainer's ε = 2e-5 they moved it by up to 2e-5), others by more than
1e-2; the threshold 1e-6 lies between, with three decades on either side.
"""
import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import chainerkfac

SCALE = 3.7
THRESHOLD = 1e-6
N = 12


def _randomize(model, rng):
    """Random biases, γ and β (float64), so that a per-channel constant
    shows wherever it is not removed; BN's ε 1e-12 (module docstring)."""
    for link in model.links():
        if isinstance(link, L.BatchNormalization):
            link.eps = 1e-12
    for name, param in model.namedparams():
        if param.array is None:
            continue
        if name.endswith(('/b', '/beta')):
            param.array[...] = rng.uniform(0.5, 1.5, param.shape)
        elif name.endswith('/gamma'):
            param.array[...] = rng.uniform(0.5, 1.5, param.shape)


def _output(model, x):
    """The training-mode output (batch statistics: the running ones it
    updates do not enter it)."""
    with chainer.using_config('train', True):
        return model(x).array.copy()


def oracle(model, x) -> list:
    """The kernels (Linear, Convolution2D, grouped included) whose
    scaling alone leaves the output unchanged."""
    reference = _output(model, x)
    found = []
    for name, link in model.namedlinks(skipself=True):
        if not isinstance(link, (L.Linear, L.Convolution2D)):
            continue
        original = link.W.array.copy()
        link.W.array *= SCALE
        moved = _output(model, x)
        link.W.array[...] = original
        change = numpy.abs(moved - reference).max() / \
            numpy.abs(reference).max()
        assert change < THRESHOLD / 1000 or change > THRESHOLD * 1000, (
            name, change)             # the oracle itself is clear-cut
        if change < THRESHOLD:
            found.append('/predictor' + name + '/W')
    return sorted(found)


def conv(cin, cout, **kwargs):
    return L.Convolution2D(cin, cout, 3, pad=1, **kwargs)


class Net(chainer.Chain):
    """A net of named children (built in float64) and a forward given as a
    function of them."""

    def __init__(self, forward, **children):
        super().__init__()
        self._forward = forward
        with self.init_scope():
            for name, link in children.items():
                setattr(self, name, link)

    def forward(self, x):
        return self._forward(self, x)


def _head(n_in):
    return L.Linear(n_in, 3)


MODELS = {
    # -- layouts: the output channel must stay within one statistic ------
    # Linear on (N, T, D) (n_batch_axes=2) then BN over the T axis: the
    # bias is per D, BN's statistics per T: not invariant (was rescaled)
    'linear_batch_axes_bn_over_time': lambda: Net(
        lambda m, x: m.fc(F.relu(m.bn(m.lin(
            F.reshape(x, (N, 4, 8)), n_batch_axes=2)))),
        lin=L.Linear(8, 5), bn=L.BatchNormalization(4), fc=_head(20)),
    # the same with the channel moved to BN's axis: invariant
    'linear_batch_axes_transposed_bn': lambda: Net(
        lambda m, x: m.fc(F.relu(m.bn(F.transpose(m.lin(
            F.reshape(x, (N, 4, 8)), n_batch_axes=2), (0, 2, 1))))),
        lin=L.Linear(8, 5), bn=L.BatchNormalization(5), fc=_head(20)),
    # conv with H moved to the channel axis: not invariant (was rescaled)
    'conv_transposed_bn_over_height': lambda: Net(
        lambda m, x: m.fc(F.relu(m.bn(F.transpose(m.conv(x),
                                                  (0, 2, 1, 3))))),
        conv=conv(2, 3), bn=L.BatchNormalization(4), fc=_head(48)),
    # conv reshaped into 2 groups of channels: not invariant (was)
    'conv_reshaped_into_groups_bn': lambda: Net(
        lambda m, x: m.fc(F.relu(m.bn(F.reshape(m.conv(x), (N, 2, -1))))),
        conv=conv(2, 6), bn=L.BatchNormalization(2), fc=_head(96)),
    # conv flattened to features, BN per feature: invariant
    'conv_flattened_bn1d': lambda: Net(
        lambda m, x: m.fc(F.relu(m.bn(F.reshape(m.conv(x), (N, -1))))),
        conv=conv(2, 3), bn=L.BatchNormalization(48), fc=_head(48)),
    # BN over (N, C): its statistics mix the channels: not invariant
    'conv_bn_over_channels': lambda: Net(
        lambda m, x: m.fc(F.relu(m.bn2(m.bn(m.conv2(F.relu(m.bn2_in(
            m.conv(x)))))))),
        conv=conv(2, 3), bn2_in=L.BatchNormalization(3),
        conv2=conv(3, 4), bn=L.BatchNormalization((4, 4), axis=(0, 1)),
        bn2=L.BatchNormalization(4), fc=_head(64)),
    # a DenseNet's concatenation along the channels, then BN: invariant
    # (was not)
    'dense_concat_channels_bn': lambda: Net(
        lambda m, x: m.fc(F.relu(m.bn(F.concat([x, m.conv(x)], axis=1)))),
        conv=conv(2, 3), bn=L.BatchNormalization(5), fc=_head(80)),
    # concatenated along the width: other data in the channel's statistic
    'concat_width_bn': lambda: Net(
        lambda m, x: m.fc(F.relu(m.bn(F.concat([m.conv(x), m.conv2(x)],
                                                axis=3)))),
        conv=conv(2, 3), conv2=conv(2, 3), bn=L.BatchNormalization(3),
        fc=_head(96)),
    # -- every use of the weight ------------------------------------------
    # a tied decoder (the encoder's W transposed): not invariant (was)
    'tied_autoencoder': lambda: Net(
        lambda m, x: F.linear(F.relu(m.bn(m.enc(x))),
                              F.transpose(m.enc.W))[:, :3],
        enc=L.Linear(32, 6), bn=L.BatchNormalization(6)),
    # the kernel reused by a deconvolution: not invariant (was)
    'kernel_reused_by_deconvolution': lambda: Net(
        lambda m, x: m.fc(F.deconvolution_2d(F.relu(m.bn(m.conv(x))),
                                             m.conv.W, pad=1)),
        conv=conv(2, 3), bn=L.BatchNormalization(3), fc=_head(32)),
    # -- normalisations without a K-FAC block of their own ---------------
    # BN without γ, the model's only normaliser: invariant (was not)
    'bn_without_gamma_only': lambda: Net(
        lambda m, x: m.fc(F.relu(m.bn(m.conv(x)))),
        conv=conv(2, 3), bn=L.BatchNormalization(3, use_gamma=False),
        fc=_head(48)),
    # a grouped convolution with no plain one in the model: invariant
    # (was not)
    'grouped_conv_only': lambda: Net(
        lambda m, x: m.fc(F.relu(m.bn(m.conv(x)))),
        conv=conv(2, 4, groups=2), bn=L.BatchNormalization(4),
        fc=_head(64)),
    # -- unchanged: a stock conv-BN block and a plain head ---------------
    'conv_bn_pool': lambda: Net(
        lambda m, x: m.fc(F.relu(m.bn(F.max_pooling_2d(m.conv(x), 2)))),
        conv=conv(2, 3), bn=L.BatchNormalization(3), fc=_head(12)),
}


@pytest.mark.parametrize('name', sorted(MODELS))
def test_auto_rescales_exactly_the_scale_invariant_kernels(name):
    """``weight_rescale='auto'`` marks what the oracle finds, and a step at
    lr 0 leaves the training-mode output as it was (the user-visible
    property: eq. 20 must never change the function)."""
    rng = numpy.random.RandomState(0)
    x = rng.randn(N, 2, 4, 4)
    t = rng.randint(0, 3, N).astype(numpy.int32)
    numpy.random.seed(1)
    with chainer.using_config('dtype', numpy.float64):
        model = L.Classifier(MODELS[name]())
    _output(model.predictor, x)                   # lazy shapes, if any
    _randomize(model, rng)
    expected = oracle(model.predictor, x)
    before = _output(model.predictor, x)
    optimizer = chainerkfac.optimizers.KFAC(lr=0, momentum=0,
                                            verbose=False)
    optimizer.setup(model)
    optimizer.update(model, x, t)
    assert sorted(optimizer.rescaled_params()) == expected
    after = _output(model.predictor, x)
    numpy.testing.assert_allclose(after, before, rtol=0,
                                  atol=THRESHOLD * numpy.abs(before).max())
