"""Small float64 models and brute-force per-sample oracles for the tests."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import numpy

import chainer
import chainer.functions as F
import chainer.links as L


def float64_links():
    """Context in which new links get float64 parameters."""
    return chainer.using_config('dtype', numpy.float64)


class ConvNet(chainer.Chain):
    """conv → (BN) → relu → linear; float64."""

    def __init__(self, in_ch=2, out_ch=3, ksize=3, stride=2, pad=1,
                 dilate=1, n_out=4, bn=False, bias=True, size=5):
        super().__init__()
        with float64_links(), self.init_scope():
            self.conv = L.Convolution2D(in_ch, out_ch, ksize, stride, pad,
                                        nobias=not bias, dilate=dilate)
            if bn:
                self.bn = L.BatchNormalization(out_ch)
            self.fc = L.Linear(None, n_out)
        self.use_bn = bn
        with float64_links():
            self.fc(self.features(numpy.zeros((1, in_ch, size, size))))

    def features(self, x):
        h = self.conv(x)
        if self.use_bn:
            h = self.bn(h)
        return F.relu(h)

    def forward(self, x):
        return self.fc(self.features(x))


class MLP(chainer.Chain):
    def __init__(self, sizes=(5, 4, 3), bias=True):
        super().__init__()
        with float64_links(), self.init_scope():
            self.l1 = L.Linear(sizes[0], sizes[1], nobias=not bias)
            self.l2 = L.Linear(sizes[1], sizes[2])

    def forward(self, x):
        return self.l2(F.tanh(self.l1(x)))


def loss_of(model):
    def lossfun(x, t):
        return F.softmax_cross_entropy(model(x), t)
    return lossfun


def update(optimizer, model, lossfun, x, t, manual):
    """One ``optimizer.update`` the two ways training loops make it: by
    hand (``model.cleargrads(); lossfun(x, t).backward(); update()``, with
    ``manual``) or ``update(lossfun, x, t)``."""
    if manual:
        model.cleargrads()
        lossfun(x, t).backward()
        optimizer.update()
    else:
        optimizer.update(lossfun, x, t)


def kfac(**kwargs):
    """The tests' K-FAC: the step the oracles compute — every factor
    refreshed at every step, no bounded step (``kl_clip=None``), no eq.
    (20) — unless a test says otherwise; the library's defaults are
    stale factors with the step bounded."""
    kwargs.setdefault('verbose', False)
    kwargs.setdefault('weight_rescale', False)
    kwargs.setdefault('kl_clip', None)
    for name in ('refresh_interval_a', 'refresh_interval_g',
                 'refresh_interval_f'):
        kwargs.setdefault(name, 1)
    return chainerkfac.optimizers.KFAC(**kwargs)


def dense(value):
    """A factor or an inverse as a dense array (a low-rank factor ``U Uᵀ``,
    a Woodbury inverse formed; :mod:`chainerkfac.low_rank`)."""
    return value.dense() if hasattr(value, 'dense') else value


def block_named(optimizer, name):
    for block in optimizer.blocks:
        if block.name == name:
            return block
    raise KeyError(name)


def replace_captured_a(monkeypatch, block, value_of):
    """Patch ``block``'s capture: its A sum, where captured, replaced by
    ``value_of(total)`` (a factor that cannot be inverted, say). Returns
    the capture as it was."""
    original = block.captured

    def captured():
        factors = original()
        if 'A' in factors:
            total, count = factors['A']
            factors['A'] = (value_of(total), count)
        return factors
    monkeypatch.setattr(block, 'captured', captured)
    return original


def data(n=6, shape=(2, 5, 5), n_class=4, seed=0):
    rng = numpy.random.RandomState(seed)
    x = rng.randn(n, *shape)
    t = rng.randint(0, n_class, size=n).astype(numpy.int32)
    return x, t


def diagonal_fisher_step(model, param, x, t, damping):
    """Oracle of one K-FAC step (lr = 1, momentum = 0) of a parameter with a
    diagonal empirical Fisher: ``w − (∇L + γw) / (E[g_n²] + γ)``, the
    per-sample gradients g_n from one backward per sample."""
    per_sample = []
    for n in range(len(x)):
        model.cleargrads()
        F.softmax_cross_entropy(model(x[n:n + 1]), t[n:n + 1]).backward()
        per_sample.append(param.grad.copy())
    fisher = (numpy.array(per_sample) ** 2).mean(axis=0)
    model.cleargrads()
    F.softmax_cross_entropy(model(x), t).backward()
    weight = param.array.copy()
    return weight - (param.grad + damping * weight) / (fisher + damping)
