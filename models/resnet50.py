"""ResNet-50 (He et al., CVPR 2016), the network of the paper.

Bottleneck v1: the stride of a downsampling block sits on its first 1x1
convolution, and the four downsampling / widening shortcuts are 1x1
projections. With the stem, that is 53 convolutions, 53 batch
normalizations and 1 fully connected layer: the 107 K-FAC layers of the paper
(section 5.2, Figure 4).
"""
import chainer
import chainer.functions as F
import chainer.links as L

from models.blocks import bottleneck_stage, conv_bn, global_average_pooling

#: (mid channels, out channels, blocks, stride) of stages res2 ... res5.
RESNET50_STAGES = ((64, 256, 3, 1), (128, 512, 4, 2), (256, 1024, 6, 2),
                   (512, 2048, 3, 2))


class ResNet50(chainer.Chain):
    """ResNet-50 for ImageNet-size inputs.

    Parameters
    ----------
    n_class : int
        Number of output classes (1000 for ImageNet).

    Notes
    -----
    ``model(x)`` takes ``x`` of shape ``(N, 3, H, W)`` (224x224 in the paper;
    any size ≥ 32 works thanks to global average pooling) and returns logits
    of shape ``(N, n_class)``. Stem: 7x7/2 convolution, BN, ReLU, 3x3/2 max
    pooling (padding 1).
    """

    def __init__(self, n_class=1000):
        super().__init__()
        with self.init_scope():
            self.conv1, self.bn1 = conv_bn(3, 64, 7, 2, 3)
            in_channels = 64
            for i, (mid, out, n_blocks, stride) in enumerate(RESNET50_STAGES):
                setattr(self, 'res{}'.format(i + 2),
                        bottleneck_stage(in_channels, mid, out, n_blocks,
                                         stride))
                in_channels = out
            self.fc = L.Linear(in_channels, n_class)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.max_pooling_2d(h, 3, 2, 1, cover_all=False)
        h = self.res5(self.res4(self.res3(self.res2(h))))
        return self.fc(global_average_pooling(h))
