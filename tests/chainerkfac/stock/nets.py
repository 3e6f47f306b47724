"""The stock architectures of issue 16, written here (Chainer's example
code is not ours to copy) with the layers and calling patterns of Chainer's
example scripts, and small stand-in data for each.

Each architecture is a :class:`Stock` entry: a model factory, a batch
factory and a *loop* that runs one training iteration the way the stock
script does (a ``StandardUpdater``'s ``update(lossfun, *batch)``, PTB's
BPTT updater, DCGAN's two-optimizer updater, ChainerMN's wrapper). The
tests (:mod:`tests.chainerkfac.stock`) and the benchmark
(:mod:`benchmarks.stock_models`) share them: only the optimizer line
changes between the stock optimizer and K-FAC.

All models are float32 (Chainer's default), as the stock scripts.
"""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

from typing import Callable, Dict, NamedTuple

import numpy

import chainer
import chainer.functions as F
import chainer.links as L


# -- PTB language model (examples/ptb) ----------------------------------------
class RNNLM(chainer.Chain):
    """EmbedID → dropout → LSTM → dropout → LSTM → dropout → Linear."""

    def __init__(self, n_vocab, n_units):
        super().__init__()
        with self.init_scope():
            self.embed = L.EmbedID(n_vocab, n_units)
            self.l1 = L.LSTM(n_units, n_units)
            self.l2 = L.LSTM(n_units, n_units)
            self.l3 = L.Linear(n_units, n_vocab)
        for param in self.params():
            param.array[...] = numpy.random.uniform(
                -0.1, 0.1, param.shape).astype(param.dtype)

    def reset_state(self):
        self.l1.reset_state()
        self.l2.reset_state()

    def forward(self, x):
        h0 = self.embed(x)
        h1 = self.l1(F.dropout(h0))
        h2 = self.l2(F.dropout(h1))
        return self.l3(F.dropout(h2))


class PTBCorpus:
    """A random word stream read as PTB's ``ParallelSequentialIterator``:
    ``batch`` cursors spread over the stream, each yielding (word, next
    word)."""

    def __init__(self, n_vocab, length=2000, batch=4, seed=0):
        self.words = numpy.random.RandomState(seed).randint(
            0, n_vocab, size=length).astype(numpy.int32)
        self.batch = batch
        self.offsets = [i * length // batch for i in range(batch)]
        self.position = 0

    def next(self):
        n = len(self.words)
        x = self.words[[(o + self.position) % n for o in self.offsets]]
        t = self.words[[(o + self.position + 1) % n for o in self.offsets]]
        self.position += 1
        return x, t


def bptt_iteration(model, optimizer, corpus, bprop_len):
    """PTB's ``BPTTUpdater.update_core``: the loss summed over
    ``bprop_len`` time steps, then ``cleargrads(); backward();
    unchain_backward(); update()``."""
    loss = 0
    for _ in range(bprop_len):
        x, t = corpus.next()
        loss += model(x, t)
    model.cleargrads()
    loss.backward()
    loss.unchain_backward()
    optimizer.update()
    return loss


# -- DCGAN (examples/dcgan) ---------------------------------------------------
class Generator(chainer.Chain):
    """Linear → BN → (Deconvolution2D → BN → relu) × 3 → Deconvolution2D
    → sigmoid; a 32² image from ``n_hidden`` uniform noise."""

    def __init__(self, n_hidden=100, bottom_width=4, ch=512, wscale=0.02):
        super().__init__()
        self.n_hidden, self.ch, self.bottom_width = n_hidden, ch, bottom_width
        with self.init_scope():
            w = chainer.initializers.Normal(wscale)
            self.l0 = L.Linear(n_hidden, bottom_width * bottom_width * ch,
                               initialW=w)
            self.dc1 = L.Deconvolution2D(ch, ch // 2, 4, 2, 1, initialW=w)
            self.dc2 = L.Deconvolution2D(ch // 2, ch // 4, 4, 2, 1,
                                         initialW=w)
            self.dc3 = L.Deconvolution2D(ch // 4, ch // 8, 4, 2, 1,
                                         initialW=w)
            self.dc4 = L.Deconvolution2D(ch // 8, 3, 3, 1, 1, initialW=w)
            self.bn0 = L.BatchNormalization(bottom_width * bottom_width * ch)
            self.bn1 = L.BatchNormalization(ch // 2)
            self.bn2 = L.BatchNormalization(ch // 4)
            self.bn3 = L.BatchNormalization(ch // 8)

    def make_hidden(self, batch, rng):
        return rng.uniform(-1, 1, (batch, self.n_hidden, 1, 1)).astype(
            numpy.float32)

    def forward(self, z):
        h = F.reshape(F.relu(self.bn0(self.l0(z))),
                      (len(z), self.ch, self.bottom_width, self.bottom_width))
        h = F.relu(self.bn1(self.dc1(h)))
        h = F.relu(self.bn2(self.dc2(h)))
        h = F.relu(self.bn3(self.dc3(h)))
        return F.sigmoid(self.dc4(h))


class Discriminator(chainer.Chain):
    """Convolutions with leaky relu, BN without γ after the first, noise
    on every activation, one logit."""

    def __init__(self, bottom_width=4, ch=512, wscale=0.02):
        super().__init__()
        w = chainer.initializers.Normal(wscale)
        with self.init_scope():
            self.c0_0 = L.Convolution2D(3, ch // 8, 3, 1, 1, initialW=w)
            self.c0_1 = L.Convolution2D(ch // 8, ch // 4, 4, 2, 1, initialW=w)
            self.c1_0 = L.Convolution2D(ch // 4, ch // 4, 3, 1, 1, initialW=w)
            self.c1_1 = L.Convolution2D(ch // 4, ch // 2, 4, 2, 1, initialW=w)
            self.c2_0 = L.Convolution2D(ch // 2, ch // 2, 3, 1, 1, initialW=w)
            self.c2_1 = L.Convolution2D(ch // 2, ch // 1, 4, 2, 1, initialW=w)
            self.c3_0 = L.Convolution2D(ch // 1, ch // 1, 3, 1, 1, initialW=w)
            self.l4 = L.Linear(bottom_width * bottom_width * ch, 1,
                               initialW=w)
            self.bn0_1 = L.BatchNormalization(ch // 4, use_gamma=False)
            self.bn1_0 = L.BatchNormalization(ch // 4, use_gamma=False)
            self.bn1_1 = L.BatchNormalization(ch // 2, use_gamma=False)
            self.bn2_0 = L.BatchNormalization(ch // 2, use_gamma=False)
            self.bn2_1 = L.BatchNormalization(ch // 1, use_gamma=False)
            self.bn3_0 = L.BatchNormalization(ch // 1, use_gamma=False)

    def forward(self, x):
        noisy = _add_noise
        h = noisy(F.leaky_relu(noisy(self.c0_0(x))))
        h = noisy(F.leaky_relu(noisy(self.bn0_1(self.c0_1(h)))))
        h = noisy(F.leaky_relu(noisy(self.bn1_0(self.c1_0(h)))))
        h = noisy(F.leaky_relu(noisy(self.bn1_1(self.c1_1(h)))))
        h = noisy(F.leaky_relu(noisy(self.bn2_0(self.c2_0(h)))))
        h = noisy(F.leaky_relu(noisy(self.bn2_1(self.c2_1(h)))))
        h = noisy(F.leaky_relu(noisy(self.bn3_0(self.c3_0(h)))))
        return self.l4(h)


def _add_noise(h, sigma=0.2):
    if not chainer.config.train:
        return h
    noise = numpy.random.randn(*h.shape).astype(h.dtype)
    return h + sigma * noise


def loss_dis(y_fake, y_real):
    batch = len(y_fake)
    real = F.sum(F.softplus(-y_real)) / batch
    fake = F.sum(F.softplus(y_fake)) / batch
    return real + fake


def loss_gen(y_fake):
    return F.sum(F.softplus(-y_fake)) / len(y_fake)


def dcgan_iteration(gen, dis, opt_gen, opt_dis, x_real, rng):
    """DCGAN's updater: the discriminator on the real and the fake batch,
    then ``update(loss_dis, ...)`` and ``update(loss_gen, ...)``, the
    generator's loss backpropagated through the updated discriminator."""
    y_real = dis(x_real)
    z = gen.make_hidden(len(x_real), rng)
    x_fake = gen(z)
    y_fake = dis(x_fake)
    opt_dis.update(loss_dis, y_fake, y_real)
    opt_gen.update(loss_gen, y_fake)


# -- Chainer's MNIST MLP (examples/mnist) -------------------------------------
class MLP(chainer.Chain):
    """Linear(None, n_units) → relu → Linear → relu → Linear(n_out)."""

    def __init__(self, n_units=1000, n_out=10):
        super().__init__()
        with self.init_scope():
            self.l1 = L.Linear(None, n_units)
            self.l2 = L.Linear(None, n_units)
            self.l3 = L.Linear(None, n_out)

    def forward(self, x):
        h1 = F.relu(self.l1(x))
        h2 = F.relu(self.l2(h1))
        return self.l3(h2)


# -- CIFAR VGG with BN (examples/cifar) ---------------------------------------
class DigitsConvBN(chainer.Chain):
    """The digits conv + BN net of the bounded-step benchmark and tests:
    conv 16 → BN → relu → conv 32 → BN → relu → max pool 2 → Linear 10,
    for 1×8×8 digits."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.conv1 = L.Convolution2D(1, 16, 3, pad=1)
            self.bn1 = L.BatchNormalization(16)
            self.conv2 = L.Convolution2D(16, 32, 3, pad=1)
            self.bn2 = L.BatchNormalization(32)
            self.fc = L.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.max_pooling_2d(F.relu(self.bn2(self.conv2(h))), 2)
        return self.fc(h)


class VGGBlock(chainer.Chain):
    """Convolution (no bias) → BN → relu."""

    def __init__(self, out_channels, ksize=3, pad=1):
        super().__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(None, out_channels, ksize, pad=pad,
                                        nobias=True)
            self.bn = L.BatchNormalization(out_channels)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class CifarVGG(chainer.Chain):
    """VGG-16 for 32² images with BN and dropout: 13 convolutions in five
    stages (64, 128, 256, 512, 512), then 512 → BN → 10."""

    STAGES = ((64, 2, 0.3), (128, 2, 0.4), (256, 3, 0.4), (512, 3, 0.4),
              (512, 3, 0.4))

    def __init__(self, n_class=10):
        super().__init__()
        self.stages = []
        with self.init_scope():
            for s, (width, depth, _) in enumerate(self.STAGES):
                names = []
                for d in range(depth):
                    name = 'block{}_{}'.format(s + 1, d + 1)
                    setattr(self, name, VGGBlock(width))
                    names.append(name)
                self.stages.append(names)
            self.fc1 = L.Linear(None, 512, nobias=True)
            self.bn_fc1 = L.BatchNormalization(512)
            self.fc2 = L.Linear(None, n_class, nobias=True)

    def forward(self, x):
        h = x
        for names, (_, _, ratio) in zip(self.stages, self.STAGES):
            for i, name in enumerate(names):
                h = getattr(self, name)(h)
                if i < len(names) - 1:
                    h = F.dropout(h, ratio)
            h = F.max_pooling_2d(h, ksize=2, stride=2)
        h = F.dropout(h, 0.5)
        h = F.relu(self.bn_fc1(self.fc1(h)))
        h = F.dropout(h, 0.5)
        return self.fc2(h)


# -- VAE (examples/vae) -------------------------------------------------------
class VAE(chainer.Chain):
    """Encoder 784 → 500 → (μ, ln σ²) of 20 latents, decoder 20 → 500 →
    784 Bernoulli logits; the loss is the negative ELBO per sample:
    Bernoulli reconstruction over ``k`` draws plus the Gaussian KL."""

    def __init__(self, n_in=784, n_latent=20, n_h=500, k=1, beta=1.0):
        super().__init__()
        self.k, self.beta = k, beta
        with self.init_scope():
            self.le1 = L.Linear(n_in, n_h)
            self.le2_mu = L.Linear(n_h, n_latent)
            self.le2_ln_var = L.Linear(n_h, n_latent)
            self.ld1 = L.Linear(n_latent, n_h)
            self.ld2 = L.Linear(n_h, n_in)

    def encode(self, x):
        h1 = F.tanh(self.le1(x))
        return self.le2_mu(h1), self.le2_ln_var(h1)

    def decode(self, z):
        return self.ld2(F.tanh(self.ld1(z)))

    def forward(self, x):
        """The loss (the ``loss_func`` of the example's updater)."""
        mu, ln_var = self.encode(x)
        batch = len(x)
        reconstruction = 0
        for _ in range(self.k):
            z = F.gaussian(mu, ln_var)
            reconstruction += F.bernoulli_nll(x, self.decode(z)) / (
                self.k * batch)
        kl = F.gaussian_kl_divergence(mu, ln_var) / batch
        loss = reconstruction + self.beta * kl
        chainer.report({'loss': loss, 'rec': reconstruction}, self)
        return loss


# -- ImageNet example networks (examples/imagenet) ----------------------------
class AlexNet(chainer.Chain):
    """Five convolutions with LRN and max pooling, fc 4096-4096-1000 with
    dropout; 227² input."""

    insize = 227

    def __init__(self, n_class=1000):
        super().__init__()
        with self.init_scope():
            self.conv1 = L.Convolution2D(None, 96, 11, stride=4)
            self.conv2 = L.Convolution2D(None, 256, 5, pad=2)
            self.conv3 = L.Convolution2D(None, 384, 3, pad=1)
            self.conv4 = L.Convolution2D(None, 384, 3, pad=1)
            self.conv5 = L.Convolution2D(None, 256, 3, pad=1)
            self.fc6 = L.Linear(None, 4096)
            self.fc7 = L.Linear(None, 4096)
            self.fc8 = L.Linear(None, n_class)

    def forward(self, x):
        h = F.max_pooling_2d(F.local_response_normalization(
            F.relu(self.conv1(x))), 3, stride=2)
        h = F.max_pooling_2d(F.local_response_normalization(
            F.relu(self.conv2(h))), 3, stride=2)
        h = F.relu(self.conv3(h))
        h = F.relu(self.conv4(h))
        h = F.max_pooling_2d(F.relu(self.conv5(h)), 3, stride=2)
        h = F.dropout(F.relu(self.fc6(h)))
        h = F.dropout(F.relu(self.fc7(h)))
        return self.fc8(h)


class NIN(chainer.Chain):
    """Network in network: four mlpconv stacks (a convolution and two 1×1
    convolutions each), global average of the last; 227² input."""

    insize = 227

    def __init__(self, n_class=1000):
        super().__init__()
        w = chainer.initializers.HeNormal()
        with self.init_scope():
            self.mlpconv1 = L.MLPConvolution2D(None, (96, 96, 96), 11,
                                               stride=4, conv_init=w)
            self.mlpconv2 = L.MLPConvolution2D(None, (256, 256, 256), 5,
                                               pad=2, conv_init=w)
            self.mlpconv3 = L.MLPConvolution2D(None, (384, 384, 384), 3,
                                               pad=1, conv_init=w)
            self.mlpconv4 = L.MLPConvolution2D(None, (1024, 1024, n_class),
                                               3, pad=1, conv_init=w)

    def forward(self, x):
        h = F.max_pooling_2d(F.relu(self.mlpconv1(x)), 3, stride=2)
        h = F.max_pooling_2d(F.relu(self.mlpconv2(h)), 3, stride=2)
        h = F.max_pooling_2d(F.relu(self.mlpconv3(h)), 3, stride=2)
        h = self.mlpconv4(F.dropout(h))
        h = F.average_pooling_2d(h, 6)
        return F.reshape(h, (len(x), -1))


class GoogLeNetTrainer(chainer.Chain):
    """``L.GoogLeNet(pretrained_model=None)`` trained with its auxiliary
    heads, as the ImageNet example: ``loss3 + 0.3 (loss1 + loss2)``;
    224² input."""

    insize = 224

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.net = L.GoogLeNet(pretrained_model=None)

    def forward(self, x, t):
        out = self.net(x, layers=['loss1_fc2', 'loss2_fc2', 'loss3_fc'])
        loss1 = F.softmax_cross_entropy(out['loss1_fc2'], t)
        loss2 = F.softmax_cross_entropy(out['loss2_fc2'], t)
        loss3 = F.softmax_cross_entropy(out['loss3_fc'], t)
        loss = 0.3 * (loss1 + loss2) + loss3
        chainer.report({'loss': loss}, self)
        return loss


class GoogLeNetBN(chainer.Chain):
    """GoogLeNet with BN (Inception-BN modules, ``L.InceptionBN``) and
    two auxiliary heads; 224² input."""

    insize = 224

    def __init__(self, n_class=1000):
        super().__init__()
        with self.init_scope():
            self.conv1 = L.Convolution2D(None, 64, 7, stride=2, pad=3,
                                         nobias=True)
            self.norm1 = L.BatchNormalization(64)
            self.conv2 = L.Convolution2D(None, 192, 3, pad=1, nobias=True)
            self.norm2 = L.BatchNormalization(192)
            self.inc3a = L.InceptionBN(None, 64, 64, 64, 64, 96, 'avg', 32)
            self.inc3b = L.InceptionBN(None, 64, 64, 96, 64, 96, 'avg', 64)
            self.inc3c = L.InceptionBN(None, 0, 128, 160, 64, 96, 'max',
                                       stride=2)
            self.inc4a = L.InceptionBN(None, 224, 64, 96, 96, 128, 'avg', 128)
            self.inc4b = L.InceptionBN(None, 192, 96, 128, 96, 128, 'avg',
                                       128)
            self.inc4c = L.InceptionBN(None, 128, 128, 160, 128, 160, 'avg',
                                       128)
            self.inc4d = L.InceptionBN(None, 64, 128, 192, 160, 192, 'avg',
                                       128)
            self.inc4e = L.InceptionBN(None, 0, 128, 192, 192, 256, 'max',
                                       stride=2)
            self.inc5a = L.InceptionBN(None, 352, 192, 320, 160, 224, 'avg',
                                       128)
            self.inc5b = L.InceptionBN(None, 352, 192, 320, 192, 224, 'max',
                                       128)
            self.out = L.Linear(None, n_class)

            self.conva = L.Convolution2D(None, 128, 1, nobias=True)
            self.norma = L.BatchNormalization(128)
            self.lina = L.Linear(None, 1024, nobias=True)
            self.norma2 = L.BatchNormalization(1024)
            self.outa = L.Linear(None, n_class)

            self.convb = L.Convolution2D(None, 128, 1, nobias=True)
            self.normb = L.BatchNormalization(128)
            self.linb = L.Linear(None, 1024, nobias=True)
            self.normb2 = L.BatchNormalization(1024)
            self.outb = L.Linear(None, n_class)

    def _aux(self, h, conv, norm, lin, norm2, out):
        h = F.average_pooling_2d(h, 5, stride=3)
        h = F.relu(norm(conv(h)))
        h = F.relu(norm2(lin(h)))
        return out(h)

    def forward(self, x, t):
        h = F.max_pooling_2d(F.relu(self.norm1(self.conv1(x))), 3, stride=2,
                             pad=1)
        h = F.max_pooling_2d(F.relu(self.norm2(self.conv2(h))), 3, stride=2,
                             pad=1)
        h = self.inc3c(self.inc3b(self.inc3a(h)))
        h = self.inc4a(h)
        loss1 = F.softmax_cross_entropy(self._aux(
            h, self.conva, self.norma, self.lina, self.norma2, self.outa), t)
        h = self.inc4d(self.inc4c(self.inc4b(h)))
        loss2 = F.softmax_cross_entropy(self._aux(
            h, self.convb, self.normb, self.linb, self.normb2, self.outb), t)
        h = self.inc5b(self.inc5a(self.inc4e(h)))
        h = F.average_pooling_2d(h, 7)
        loss3 = F.softmax_cross_entropy(self.out(h), t)
        loss = 0.3 * (loss1 + loss2) + loss3
        chainer.report({'loss': loss}, self)
        return loss


class ResNeXtBottleneck(chainer.Chain):
    """1×1 → grouped 3×3 (cardinality 32) → 1×1, BN after each, projected
    shortcut in the first block of a stage."""

    def __init__(self, in_ch, mid_ch, out_ch, stride, groups, project):
        super().__init__()
        w = chainer.initializers.HeNormal()
        with self.init_scope():
            self.conv1 = L.Convolution2D(in_ch, mid_ch, 1, 1, 0, initialW=w,
                                         nobias=True)
            self.bn1 = L.BatchNormalization(mid_ch)
            self.conv2 = L.Convolution2D(mid_ch, mid_ch, 3, stride, 1,
                                         initialW=w, nobias=True,
                                         groups=groups)
            self.bn2 = L.BatchNormalization(mid_ch)
            self.conv3 = L.Convolution2D(mid_ch, out_ch, 1, 1, 0, initialW=w,
                                         nobias=True)
            self.bn3 = L.BatchNormalization(out_ch)
            if project:
                self.conv4 = L.Convolution2D(in_ch, out_ch, 1, stride, 0,
                                             initialW=w, nobias=True)
                self.bn4 = L.BatchNormalization(out_ch)
        self.project = project

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        shortcut = self.bn4(self.conv4(x)) if self.project else x
        return F.relu(h + shortcut)


class ResNeXt50(chainer.Chain):
    """ResNeXt-50 (32×4d): stages of 3, 4, 6, 3 bottlenecks."""

    insize = 224

    def __init__(self, n_class=1000, groups=32):
        super().__init__()
        w = chainer.initializers.HeNormal()
        with self.init_scope():
            self.conv1 = L.Convolution2D(3, 64, 7, 2, 3, initialW=w,
                                         nobias=True)
            self.bn1 = L.BatchNormalization(64)
            in_ch = 64
            self.stages = []
            for s, (depth, mid, out, stride) in enumerate((
                    (3, 128, 256, 1), (4, 256, 512, 2), (6, 512, 1024, 2),
                    (3, 1024, 2048, 2))):
                blocks = chainer.ChainList(*[
                    ResNeXtBottleneck(in_ch if i == 0 else out, mid, out,
                                      stride if i == 0 else 1, groups,
                                      project=i == 0)
                    for i in range(depth)])
                setattr(self, 'res{}'.format(s + 2), blocks)
                self.stages.append(blocks)
                in_ch = out
            self.fc = L.Linear(2048, n_class)

    def forward(self, x):
        h = F.max_pooling_2d(F.relu(self.bn1(self.conv1(x))), 3, stride=2)
        for blocks in self.stages:
            for block in blocks:
                h = block(h)
        h = F.average(h, axis=(2, 3))
        return self.fc(h)


class VisionHead(chainer.Chain):
    """A ``chainer.links.model.vision`` network (``pretrained_model=None``)
    as a classifier: its last layer's logits."""

    def __init__(self, network, layer):
        super().__init__()
        self.layer = layer
        with self.init_scope():
            self.net = network

    def forward(self, x):
        return self.net(x, layers=[self.layer])[self.layer]


# -- the registry of stock architectures --------------------------------------
class Stock(NamedTuple):
    """One stock architecture as its example script trains it.

    Attributes
    ----------
    name : str
    stock_optimizer : callable
        The optimizer of the stock script (Adam or MomentumSGD).
    build : callable
        ``build() -> Trainee``: the model(s), the data and the loop.
    description : str
    """

    name: str
    stock_optimizer: Callable
    build: Callable
    description: str


class Trainee:
    """Model(s), the optimizer(s) on them and a ``step()`` that runs one
    iteration of the stock loop.

    Attributes
    ----------
    targets : list of chainer.Link
        What the optimizers are set up on (one, or DCGAN's two).
    optimizers : list of chainer.Optimizer
    hooks : list of callables
        Optimizer hooks of the stock script (PTB's gradient clipping),
        added to every optimizer.
    """

    def __init__(self, targets, step_fn, hooks=()):
        self.targets = list(targets)
        self.optimizers = []
        self.hooks = list(hooks)
        self._step = step_fn

    def setup(self, make_optimizer):
        """``make_optimizer()`` once per target, set up on it."""
        self.optimizers = []
        for target in self.targets:
            optimizer = make_optimizer()
            optimizer.setup(target)
            for hook in self.hooks:
                optimizer.add_hook(hook())
            self.optimizers.append(optimizer)
        return self

    def step(self):
        """One iteration of the stock loop."""
        self._step(self)


def adam():
    return chainer.optimizers.Adam()


def momentum_sgd():
    return chainer.optimizers.MomentumSGD(lr=0.01, momentum=0.9)


def _classifier_trainee(predictor, batch, in_shape, n_class, seed=0):
    """A ``L.Classifier`` fed one fixed random batch per step by
    ``update(model, x, t)`` (what a ``StandardUpdater`` calls)."""
    rng = numpy.random.RandomState(seed)
    x = rng.rand(batch, *in_shape).astype(numpy.float32)
    t = rng.randint(0, n_class, size=batch).astype(numpy.int32)
    model = L.Classifier(predictor)

    def step(trainee):
        trainee.optimizers[0].update(model, x, t)
    return Trainee([model], step)


def _loss_trainee(model, batch, in_shape, n_class, seed=0):
    """A model whose forward is its loss (GoogLeNet's auxiliary heads),
    fed by ``update(model, x, t)``."""
    rng = numpy.random.RandomState(seed)
    x = rng.rand(batch, *in_shape).astype(numpy.float32)
    t = rng.randint(0, n_class, size=batch).astype(numpy.int32)

    def step(trainee):
        trainee.optimizers[0].update(model, x, t)
    return Trainee([model], step)


def ptb(n_vocab=1000, n_units=650, batch=20, bprop_len=35, seed=0,
        clip=5.0):
    """PTB's ``RNNLM`` (650 units), BPTT over ``bprop_len`` steps, gradient
    clipping at ``clip`` as the example; a random word stream."""
    def build():
        numpy.random.seed(seed)
        rnn = RNNLM(n_vocab, n_units)
        model = L.Classifier(rnn)
        corpus = PTBCorpus(n_vocab, batch=batch, seed=seed)

        def step(trainee):
            bptt_iteration(model, trainee.optimizers[0], corpus, bprop_len)
        return Trainee([model], step, hooks=[
            lambda: chainer.optimizer_hooks.GradientClipping(clip)])
    return build


def dcgan(batch=8, ch=512, n_hidden=100, seed=0):
    """DCGAN at 32² (CIFAR's example size), a random 'real' batch."""
    def build():
        numpy.random.seed(seed)
        gen = Generator(n_hidden=n_hidden, ch=ch)
        dis = Discriminator(ch=ch)
        rng = numpy.random.RandomState(seed)
        x_real = rng.rand(batch, 3, 32, 32).astype(numpy.float32)

        def step(trainee):
            opt_dis, opt_gen = trainee.optimizers
            dcgan_iteration(gen, dis, opt_gen, opt_dis, x_real, rng)
        # In the order the iteration updates them.
        return Trainee([dis, gen], step)
    return build


def mnist_mlp(batch=100, n_in=784, n_units=1000, seed=0):
    def build():
        numpy.random.seed(seed)
        return _classifier_trainee(MLP(n_units), batch, (n_in,), 10, seed)
    return build


def cifar_vgg(batch=64, seed=0):
    def build():
        numpy.random.seed(seed)
        return _classifier_trainee(CifarVGG(), batch, (3, 32, 32), 10, seed)
    return build


def vae(batch=100, seed=0):
    def build():
        numpy.random.seed(seed)
        model = VAE()
        x = (numpy.random.RandomState(seed).rand(batch, 784) > 0.5).astype(
            numpy.float32)

        def step(trainee):
            trainee.optimizers[0].update(model, x)
        return Trainee([model], step)
    return build


def image_classifier(make_net, batch, size, n_class=1000, seed=0):
    def build():
        numpy.random.seed(seed)
        return _classifier_trainee(make_net(), batch, (3, size, size),
                                   n_class, seed)
    return build


def image_loss(make_net, batch, size, n_class=1000, seed=0):
    def build():
        numpy.random.seed(seed)
        return _loss_trainee(make_net(), batch, (3, size, size), n_class,
                             seed)
    return build


def vgg16_layers():
    return VisionHead(L.VGG16Layers(pretrained_model=None), 'fc8')


def resnet101_layers():
    return VisionHead(L.ResNet101Layers(pretrained_model=None), 'fc6')


#: The stock architectures of issue 16 at the sizes the tests and the
#: benchmark use. ChainerMN's MNIST is the MLP through ChainerMN's wrapper
#: (tests/chainerkfac/multi_node/test_chainermn_wrapper.py).
STOCK: Dict[str, Stock] = {s.name: s for s in [
    Stock('ptb', adam, ptb(),
          'PTB RNNLM: EmbedID(1000) + 2 LSTM(650) + Linear, BPTT 35, '
          'batch 20, clip 5'),
    Stock('dcgan', adam, dcgan(),
          'DCGAN 32², ch 512, batch 8, two optimizers'),
    Stock('mnist_mlp', adam, mnist_mlp(),
          'MNIST MLP 784-1000-1000-10, batch 100'),
    Stock('cifar_vgg', momentum_sgd, cifar_vgg(),
          'CIFAR VGG-16 + BN, 32², batch 64'),
    Stock('vae', adam, vae(),
          'VAE 784-500-20, batch 100'),
    Stock('vgg16', momentum_sgd, image_classifier(vgg16_layers, 2, 224),
          'L.VGG16Layers, 224², batch 2'),
    Stock('alexnet', momentum_sgd, image_classifier(AlexNet, 2, 227),
          'AlexNet, 227², batch 2'),
    Stock('resnext50', momentum_sgd, image_classifier(ResNeXt50, 4, 32),
          'ResNeXt-50 (32×4d), 32², batch 4'),
    Stock('resnet101', momentum_sgd,
          image_classifier(resnet101_layers, 4, 32),
          'L.ResNet101Layers, 32², batch 4'),
    Stock('googlenet', momentum_sgd,
          image_loss(GoogLeNetTrainer, 2, 224),
          'L.GoogLeNet + auxiliary heads, 224², batch 2'),
    Stock('googlenet_bn', momentum_sgd, image_loss(GoogLeNetBN, 2, 224),
          'GoogLeNet-BN + auxiliary heads, 224², batch 2'),
    Stock('nin', momentum_sgd, image_classifier(NIN, 2, 227),
          'NiN, 227², batch 2'),
]}
