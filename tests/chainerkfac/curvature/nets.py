"""Tiny float64 predictors for the curvature tests: one per kind of graph
the issue names (a conv/pool/linear stack, a residual block, shared
weights, grouped convolutions, BatchNormalization, a parameter without an
adapter)."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)
import numpy

import chainer
import chainer.functions as F
import chainer.links as L

from tests.chainerkfac.helpers import float64_links

N_CLASS = 4
IN_SHAPE = (2, 4, 4)


def seeded(build):
    """Build links with NumPy's global generator seeded (Chainer's
    initialisers draw from it)."""
    state = numpy.random.get_state()
    numpy.random.seed(0)
    try:
        with float64_links():
            build()
    finally:
        numpy.random.set_state(state)


class ConvPool(chainer.Chain):
    """conv → act → max pool → linear; ``act`` relu (piecewise linear) or
    a curved one."""

    def __init__(self, act=F.relu, stride=1, pad=1, dilate=1):
        super().__init__()

        self.act = act

        def build():
            with self.init_scope():
                self.conv = L.Convolution2D(2, 3, 3, stride, pad,
                                            dilate=dilate)
                self.fc = L.Linear(None, N_CLASS)
            self(numpy.zeros((1,) + IN_SHAPE))
        seeded(build)

    def head(self, z):
        return self.fc(F.max_pooling_2d(self.act(z), 2))

    def forward(self, x):
        return self.head(self.conv(x))


class Residual(chainer.Chain):
    """conv → relu → (conv → tanh) + skip → average pool → linear."""

    def __init__(self):
        super().__init__()

        def build():
            with self.init_scope():
                self.conv1 = L.Convolution2D(2, 3, 3, 1, 1)
                self.conv2 = L.Convolution2D(3, 3, 3, 1, 1)
                self.fc = L.Linear(12, N_CLASS)
        seeded(build)

    def forward(self, x):
        h = F.relu(self.conv1(x))
        h = h + F.tanh(self.conv2(h))
        return self.fc(F.average_pooling_2d(h, 2))


class Shared(chainer.Chain):
    """One Linear applied twice in sequence and once more on a side
    branch (shared weights), then a classifier."""

    def __init__(self):
        super().__init__()

        def build():
            with self.init_scope():
                self.embed = L.Linear(32, 5)
                self.shared = L.Linear(5, 5)
                self.fc = L.Linear(5, N_CLASS)
        seeded(build)

    def forward(self, x):
        h = F.tanh(self.embed(x))
        a = F.tanh(self.shared(F.tanh(self.shared(h))))
        return self.fc(a + self.shared(h * 0.5))


class Grouped(chainer.Chain):
    """Grouped convolutions (2 and 3 groups) → linear."""

    def __init__(self):
        super().__init__()

        def build():
            with self.init_scope():
                self.conv1 = L.Convolution2D(2, 6, 3, 1, 1, groups=2)
                self.conv2 = L.Convolution2D(6, 3, 1, groups=3)
                self.fc = L.Linear(48, N_CLASS)
        seeded(build)

    def forward(self, x):
        return self.fc(F.relu(self.conv2(F.relu(self.conv1(x)))))


class WithBN(chainer.Chain):
    """conv → BatchNormalization → relu → linear, with non-trivial
    running statistics, γ and β."""

    def __init__(self):
        super().__init__()

        def build():
            with self.init_scope():
                self.conv = L.Convolution2D(2, 3, 3, 1, 1, nobias=True)
                self.bn = L.BatchNormalization(3)
                self.fc = L.Linear(48, N_CLASS)
        seeded(build)
        rng = numpy.random.RandomState(5)
        self.bn.gamma.array[...] = 1 + 0.2 * rng.randn(3)
        self.bn.beta.array[...] = 0.2 * rng.randn(3)
        self.bn.avg_mean[...] = 0.1 * rng.randn(3)
        self.bn.avg_var[...] = 1 + 0.3 * rng.rand(3)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))))


class Unmodelled(chainer.Chain):
    """Parameters of functions without an adapter: PReLU's slopes, a
    learned scale (``F.scale``), a parameter in an expression."""

    def __init__(self):
        super().__init__()

        def build():
            with self.init_scope():
                self.l1 = L.Linear(32, 5)
                self.act = L.PReLU((5,))
                self.scale = L.Scale(axis=1, W_shape=(5,))
                self.fc = L.Linear(5, N_CLASS)
                self.offset = chainer.Parameter(
                    numpy.linspace(-0.3, 0.3, 5))
        seeded(build)
        self.act.W.array[...] = numpy.linspace(0.1, 0.4, 5)
        self.scale.W.array[...] = numpy.linspace(0.5, 1.5, 5)

    def forward(self, x):
        h = self.scale(self.act(self.l1(x)))
        h = h + F.broadcast_to(self.offset, h.shape) * h
        return self.fc(h)


class Chain(chainer.Chain):
    """A chain for KFRA: conv → sigmoid → max pool → linear → tanh →
    linear. :attr:`steps` are its functions, for oracles that walk it."""

    def __init__(self):
        super().__init__()

        def build():
            with self.init_scope():
                self.conv = L.Convolution2D(2, 3, 3, 1, 1)
                self.fc1 = L.Linear(12, 5)
                self.fc2 = L.Linear(5, N_CLASS)
        seeded(build)
        self.steps = [self.conv, F.sigmoid,
                      lambda h: F.max_pooling_2d(h, 2),
                      lambda h: F.reshape(h, (len(h), -1)),
                      self.fc1, F.tanh, self.fc2]

    def forward(self, x):
        for step in self.steps:
            x = step(x)
        return x


def data(n=5, shape=IN_SHAPE, seed=0):
    rng = numpy.random.RandomState(seed)
    x = rng.randn(n, *shape)
    t = rng.randint(0, N_CLASS, size=n).astype(numpy.int32)
    return x, t


#: name → (constructor, input shape); the graphs of the issue.
GRAPHS = {
    'conv_pool_linear': (ConvPool, IN_SHAPE),
    'residual': (Residual, IN_SHAPE),
    'shared_weights': (Shared, (32,)),
    'grouped_conv': (Grouped, IN_SHAPE),
    'bn_test_mode': (WithBN, IN_SHAPE),
    'unmodelled_params': (Unmodelled, (32,)),
}


def build(name, n=5, seed=0):
    """``(model, x, t)`` of a graph of :data:`GRAPHS`."""
    cls, shape = GRAPHS[name]
    x, t = data(n, shape, seed)
    return cls(), x, t


class Embedding(chainer.Chain):
    """EmbedID (no adapter) → a Linear over two batch axes (its function
    sees N·T rows: no adapter either) → average → linear."""

    def __init__(self):
        super().__init__()

        def build():
            with self.init_scope():
                self.embed = L.EmbedID(7, 4)
                self.mix = L.Linear(4, 3)
                self.fc = L.Linear(3, N_CLASS)
        seeded(build)

    def forward(self, ids):
        h = F.tanh(self.mix(self.embed(ids), n_batch_axes=2))
        return self.fc(F.mean(h, axis=1))


def ids(n=5, length=3, seed=0):
    rng = numpy.random.RandomState(seed)
    return (rng.randint(0, 7, size=(n, length)).astype(numpy.int32),
            rng.randint(0, N_CLASS, size=n).astype(numpy.int32))


class BNChain(chainer.Chain):
    """A chain through BatchNormalization (test mode) for KFRA: conv →
    BN → relu → linear, with :attr:`steps`."""

    def __init__(self):
        super().__init__()

        def build():
            with self.init_scope():
                self.conv = L.Convolution2D(2, 3, 3, 1, 1)
                self.bn = L.BatchNormalization(3)
                self.fc = L.Linear(48, N_CLASS)
        seeded(build)
        rng = numpy.random.RandomState(6)
        self.bn.gamma.array[...] = 1 + 0.2 * rng.randn(3)
        self.bn.avg_mean[...] = 0.1 * rng.randn(3)
        self.bn.avg_var[...] = 1 + 0.3 * rng.rand(3)
        self.steps = [self.conv, self.bn, F.relu, self.fc]

    def forward(self, x):
        for step in self.steps:
            x = step(x)
        return x
