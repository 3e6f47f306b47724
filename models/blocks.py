"""Residual building blocks shared by the ResNet variants.

Every convolution has no bias and is followed by batch normalization (as in
Chainer's ImageNet example): the BN shift makes a convolution bias redundant,
and each Conv/BN pair is two K-FAC layers (one Kronecker-factored block, one
BN Fisher block).
"""
import chainer
import chainer.functions as F
import chainer.links as L
from chainer import initializers


def conv_bn(in_channels, out_channels, ksize, stride=1, pad=0):
    """A ``Convolution2D`` without bias and the ``BatchNormalization`` after.

    Returns
    -------
    (chainer.links.Convolution2D, chainer.links.BatchNormalization)
    """
    conv = L.Convolution2D(in_channels, out_channels, ksize, stride, pad,
                           nobias=True, initialW=initializers.HeNormal())
    return conv, L.BatchNormalization(out_channels)


def avg_pool_2x2_ceil(h):
    """2x2 average pooling with stride 2, ceil mode, padding not counted.

    The ResNet-D shortcut pools before its 1x1 convolution; for an odd height
    or width the last window is partial and is averaged over its real
    elements only, so the output size matches the stride-2 convolution of the
    residual branch (``ceil(H / 2)``).

    Parameters
    ----------
    h : chainer.Variable
        Feature map of shape ``(N, C, H, W)``.
    """
    height, width = h.shape[2:]
    pad_h, pad_w = height % 2, width % 2
    if not (pad_h or pad_w):
        return F.average_pooling_2d(h, 2, 2)
    xp = chainer.backend.get_array_module(h)
    widths = ((0, 0), (0, 0), (0, pad_h), (0, pad_w))
    pooled = F.average_pooling_2d(F.pad(h, widths, 'constant'), 2, 2)
    # Fraction of real (unpadded) elements in each window; a constant, so the
    # gradient flows only through ``pooled``.
    real = xp.pad(xp.ones((1, 1, height, width), dtype=h.dtype), widths,
                  'constant')
    fraction = real.reshape(1, 1, (height + pad_h) // 2, 2,
                            (width + pad_w) // 2, 2).mean(axis=(3, 5))
    return pooled * xp.broadcast_to(1 / fraction, pooled.shape)


class Bottleneck(chainer.Chain):
    """Bottleneck residual block: 1x1 → 3x3 → 1x1 convolutions, each + BN.

    Parameters
    ----------
    in_channels, mid_channels, out_channels : int
        Channels of the input, of the 3x3 convolution, and of the output.
    stride : int
        Spatial stride of the block.
    stride_on_3x3 : bool
        ``False``: the stride sits on the first 1x1 convolution (He et al.
        2016, ResNet v1). ``True``: on the 3x3 convolution (ResNet-B/D, Bag of
        Tricks), so no input pixel is skipped.
    avg_down : bool
        ResNet-D shortcut: 2x2 average pooling (stride 2) then a stride-1 1x1
        projection, instead of a stride-2 1x1 projection.

    A projection shortcut (1x1 convolution + BN) is built when the stride or
    the number of channels changes; otherwise the shortcut is the identity.
    """

    def __init__(self, in_channels, mid_channels, out_channels, stride=1,
                 stride_on_3x3=False, avg_down=False):
        super().__init__()
        self.stride = stride
        self.avg_down = avg_down
        stride_1x1, stride_3x3 = (1, stride) if stride_on_3x3 else (stride, 1)
        with self.init_scope():
            self.conv1, self.bn1 = conv_bn(in_channels, mid_channels, 1,
                                           stride_1x1)
            self.conv2, self.bn2 = conv_bn(mid_channels, mid_channels, 3,
                                           stride_3x3, 1)
            self.conv3, self.bn3 = conv_bn(mid_channels, out_channels, 1)
            if stride != 1 or in_channels != out_channels:
                shortcut_stride = 1 if avg_down else stride
                self.conv_shortcut, self.bn_shortcut = conv_bn(
                    in_channels, out_channels, 1, shortcut_stride)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        return F.relu(h + self._shortcut(x))

    def _shortcut(self, x):
        if not hasattr(self, 'conv_shortcut'):
            return x
        if self.avg_down and self.stride != 1:
            x = avg_pool_2x2_ceil(x)
        return self.bn_shortcut(self.conv_shortcut(x))


class BasicBlock(chainer.Chain):
    """Two 3x3 convolutions, each + BN (CIFAR ResNets, He et al. 2016 §4.2).

    The shortcut is a 1x1 projection + BN when the stride or the number of
    channels changes ("option B"), otherwise the identity.

    Parameters
    ----------
    in_channels, out_channels : int
    stride : int
        Stride of the first 3x3 convolution and of the projection.
    """

    def __init__(self, in_channels, out_channels, stride=1):
        super().__init__()
        with self.init_scope():
            self.conv1, self.bn1 = conv_bn(in_channels, out_channels, 3,
                                           stride, 1)
            self.conv2, self.bn2 = conv_bn(out_channels, out_channels, 3, 1, 1)
            if stride != 1 or in_channels != out_channels:
                self.conv_shortcut, self.bn_shortcut = conv_bn(
                    in_channels, out_channels, 1, stride)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        if hasattr(self, 'conv_shortcut'):
            x = self.bn_shortcut(self.conv_shortcut(x))
        return F.relu(h + x)


class Stage(chainer.ChainList):
    """A sequence of residual blocks applied in order (one ResNet stage)."""

    def forward(self, x):
        for block in self:
            x = block(x)
        return x


def bottleneck_stage(in_channels, mid_channels, out_channels, n_blocks,
                     stride, stride_on_3x3=False, avg_down=False):
    """A :class:`Stage` of ``n_blocks`` bottlenecks; the first one strides."""
    blocks = [Bottleneck(in_channels, mid_channels, out_channels, stride,
                         stride_on_3x3, avg_down)]
    blocks += [Bottleneck(out_channels, mid_channels, out_channels, 1,
                          stride_on_3x3, avg_down)
               for _ in range(n_blocks - 1)]
    return Stage(*blocks)


def global_average_pooling(h):
    """``(N, C, H, W) → (N, C)`` mean over all spatial positions."""
    return F.mean(h, axis=(2, 3))
