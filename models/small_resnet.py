"""Small ResNets for 32x32 inputs (He et al. 2016, section 4.2, CIFAR).

Fast on a CPU: used by the demo and the tests. ``depth = 6 n + 2``: a 3x3
stem convolution, three stages of ``n`` basic blocks (``width``, ``2 width``,
``4 width`` channels; the last two stages halve the resolution), global
average pooling and a fully connected layer. Downsampling shortcuts are 1x1
projections + BN, so every K-FAC layer type (Convolution2D,
BatchNormalization, Linear) appears, with strided 1x1 and padded 3x3
convolutions.
"""
import chainer
import chainer.functions as F
import chainer.links as L

from models.blocks import BasicBlock, Stage, conv_bn, global_average_pooling


def check_size(depth, width):
    """Raise :class:`ValueError` unless ``depth`` and ``width`` make a
    :class:`SmallResNet` (``depth = 6 n + 2`` with ``n >= 1``, ``width >=
    1``); the training script checks its options with it."""
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 8 \
            or (depth - 2) % 6:
        raise ValueError('SmallResNet depth must be 6n+2 with n >= 1 '
                         '(8, 14, 20, ...), got {!r}'.format(depth))
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError('SmallResNet width must be an integer >= 1, got '
                         '{!r}'.format(width))


class SmallResNet(chainer.Chain):
    """CIFAR-style ResNet.

    Parameters
    ----------
    depth : int
        ``6 n + 2`` with ``n ≥ 1``: 8, 14, 20, 32, ...
    width : int
        Channels of the first stage.
    n_class : int
        Number of output classes.

    Notes
    -----
    ``model(x)`` takes ``(N, 3, H, W)`` (32x32 intended; any size works) and
    returns logits of shape ``(N, n_class)``.
    """

    def __init__(self, depth=8, width=16, n_class=10):
        super().__init__()
        check_size(depth, width)
        n_blocks = (depth - 2) // 6
        with self.init_scope():
            self.conv1, self.bn1 = conv_bn(3, width, 3, 1, 1)
            in_channels = width
            for i, stride in enumerate((1, 2, 2)):
                out = width * 2 ** i
                blocks = [BasicBlock(in_channels, out, stride)]
                blocks += [BasicBlock(out, out) for _ in range(n_blocks - 1)]
                setattr(self, 'stage{}'.format(i + 1), Stage(*blocks))
                in_channels = out
            self.fc = L.Linear(in_channels, n_class)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.stage3(self.stage2(self.stage1(h)))
        return self.fc(global_average_pooling(h))
