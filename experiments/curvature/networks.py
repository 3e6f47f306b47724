"""The seed's benchmark networks as Chainer links (DeepOBS' definitions).

* :class:`ThreeCThreeD` — 3C3D for CIFAR-10: three convolutions (64 5×5
  valid, 96 3×3 valid, 128 3×3 same), each followed by ReLU and a 3×3 max
  pooling of stride 2 ("same": ``cover_all``), then dense layers of 512,
  256 and 10 units; 895,210 parameters.
* :class:`AllCNNC` — All-CNN-C for CIFAR-100 (Springenberg et al. 2015):
  nine convolutions (96, 96, 96/2, 192, 192, 192/2, 192 valid, 192 1×1,
  100 1×1) with ReLU, global average pooling; 1,387,108 parameters. The
  dropout layers of DeepOBS are left out (the benchmark times one step on
  fixed inputs).
"""
import chainer
import chainer.functions as F
import chainer.links as L


class ThreeCThreeD(chainer.Chain):
    """3C3D on 3×32×32 inputs, ``n_out`` classes."""

    def __init__(self, n_out: int = 10):
        super().__init__()
        with self.init_scope():
            self.conv1 = L.Convolution2D(3, 64, 5)
            self.conv2 = L.Convolution2D(64, 96, 3)
            self.conv3 = L.Convolution2D(96, 128, 3, pad=1)
            self.fc1 = L.Linear(3 * 3 * 128, 512)
            self.fc2 = L.Linear(512, 256)
            self.fc3 = L.Linear(256, n_out)

    def forward(self, x):
        for conv in (self.conv1, self.conv2, self.conv3):
            x = F.max_pooling_2d(F.relu(conv(x)), 3, 2, cover_all=True)
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))


class AllCNNC(chainer.Chain):
    """All-CNN-C on 3×32×32 inputs, ``n_out`` classes."""

    def __init__(self, n_out: int = 100):
        super().__init__()
        with self.init_scope():
            self.conv1 = L.Convolution2D(3, 96, 3, pad=1)
            self.conv2 = L.Convolution2D(96, 96, 3, pad=1)
            self.conv3 = L.Convolution2D(96, 96, 3, stride=2, pad=1)
            self.conv4 = L.Convolution2D(96, 192, 3, pad=1)
            self.conv5 = L.Convolution2D(192, 192, 3, pad=1)
            self.conv6 = L.Convolution2D(192, 192, 3, stride=2, pad=1)
            self.conv7 = L.Convolution2D(192, 192, 3)
            self.conv8 = L.Convolution2D(192, 192, 1)
            self.conv9 = L.Convolution2D(192, n_out, 1)

    def forward(self, x):
        for i in range(1, 10):
            x = F.relu(getattr(self, 'conv{}'.format(i))(x))
        return F.mean(x, axis=(2, 3))


def parameter_count(link) -> int:
    return sum(p.size for p in link.params())
