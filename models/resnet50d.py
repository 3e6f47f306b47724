"""ResNet-50-D (He et al., "Bag of Tricks for Image Classification", 2019).

Three changes to :class:`models.ResNet50`:

* deep stem: three 3x3 convolutions (32, 32, 64 channels; the first with
  stride 2) instead of one 7x7 convolution;
* ResNet-B: the stride of a downsampling bottleneck is on its 3x3
  convolution, not on the first 1x1;
* ResNet-D: the downsampling shortcut is a 2x2 average pooling (stride 2)
  followed by a stride-1 1x1 projection.
"""
import chainer
import chainer.functions as F
import chainer.links as L

from models.blocks import bottleneck_stage, conv_bn, global_average_pooling
from models.resnet50 import RESNET50_STAGES


class ResNet50D(chainer.Chain):
    """ResNet-50-D; same call convention as :class:`models.ResNet50`.

    Parameters
    ----------
    n_class : int
        Number of output classes.
    """

    def __init__(self, n_class=1000):
        super().__init__()
        with self.init_scope():
            self.conv1_1, self.bn1_1 = conv_bn(3, 32, 3, 2, 1)
            self.conv1_2, self.bn1_2 = conv_bn(32, 32, 3, 1, 1)
            self.conv1_3, self.bn1_3 = conv_bn(32, 64, 3, 1, 1)
            in_channels = 64
            for i, (mid, out, n_blocks, stride) in enumerate(RESNET50_STAGES):
                setattr(self, 'res{}'.format(i + 2),
                        bottleneck_stage(in_channels, mid, out, n_blocks,
                                         stride, stride_on_3x3=True,
                                         avg_down=True))
                in_channels = out
            self.fc = L.Linear(in_channels, n_class)

    def forward(self, x):
        h = F.relu(self.bn1_1(self.conv1_1(x)))
        h = F.relu(self.bn1_2(self.conv1_2(h)))
        h = F.relu(self.bn1_3(self.conv1_3(h)))
        h = F.max_pooling_2d(h, 3, 2, 1, cover_all=False)
        h = self.res5(self.res4(self.res3(self.res2(h))))
        return self.fc(global_average_pooling(h))
