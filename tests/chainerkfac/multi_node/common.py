"""A small float64 conv + BN + linear net and helpers for the multi-node
tests.

Every helper that asserts gathers the values of all ranks first, so all
ranks reach the same verdict and none is left waiting in a collective.
"""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)
import numpy
from mpi4py import MPI

import chainer
import chainer.functions as F
import chainer.links as L

from chainerkfac.communicators import create_communicator
from chainerkfac.multi_node_optimizer import create_multi_node_optimizer
from tests.chainerkfac import helpers

world = MPI.COMM_WORLD

#: Local mini-batch of one process (one chunk of the global batch).
CHUNK = 4
IN_SHAPE = (2, 5, 5)
N_CLASS = 3


class ConvBNNet(chainer.Chain):
    """conv → BN → relu → strided conv (no bias) → BN → PReLU → linear.

    Five K-FAC blocks (more than 4 ranks) and one block without curvature
    (PReLU), float64, every parameter initialised at construction from
    ``seed``.
    """

    in_shape = IN_SHAPE

    def __init__(self, seed=0, n_out=N_CLASS):
        super().__init__()
        rng_state = numpy.random.get_state()
        numpy.random.seed(seed)
        with helpers.float64_links(), self.init_scope():
            self.conv1 = L.Convolution2D(2, 4, 3, 1, 1)
            self.bn1 = L.BatchNormalization(4)
            self.conv2 = L.Convolution2D(4, 4, 3, 2, 1, nobias=True)
            self.bn2 = L.BatchNormalization(4)
            self.act = L.PReLU((4,))
            self.fc = L.Linear(4 * 3 * 3, n_out)
        numpy.random.set_state(rng_state)
        # Non-trivial γ, β and PReLU slopes, so their updates matter.
        rng = numpy.random.RandomState(seed + 1000)
        for link in (self.bn1, self.bn2):
            link.gamma.array[...] = 1 + 0.1 * rng.randn(4)
            link.beta.array[...] = 0.1 * rng.randn(4)
        self.act.W.array[...] = 0.25 + 0.05 * rng.randn(4)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.act(self.bn2(self.conv2(h)))
        return self.fc(h)


class SmallMLP(helpers.MLP):
    """Two K-FAC blocks (fewer than 3 or 4 ranks: redundancy), float64."""

    in_shape = (5,)

    def __init__(self, seed=0):
        rng_state = numpy.random.get_state()
        numpy.random.seed(seed)
        super().__init__(sizes=(5, 4, N_CLASS))
        numpy.random.set_state(rng_state)



def chunks(step, n_chunks, seed=0, in_shape=IN_SHAPE):
    """The global batch of ``step``, split into ``n_chunks`` local batches
    (the same on every rank)."""
    rng = numpy.random.RandomState(seed * 7919 + step)
    x = rng.randn(n_chunks * CHUNK, *in_shape)
    t = rng.randint(0, N_CLASS, size=n_chunks * CHUNK).astype(numpy.int32)
    return [(x[i * CHUNK:(i + 1) * CHUNK], t[i * CHUNK:(i + 1) * CHUNK])
            for i in range(n_chunks)]


def kfac_options(**overrides):
    options = dict(lr=0.05, momentum=0.9, damping=1e-2,
                   damping_target=2e-3, damping_warmup_steps=8,
                   weight_rescale=True, verbose=False)
    options.update(overrides)
    return options


def distributed(comm, seed=0, net=ConvBNNet, **options):
    """Model (rank-dependent initial values) and a multi-node KFAC."""
    model = net(seed=seed + comm.rank)
    optimizer = create_multi_node_optimizer(
        helpers.kfac(**kfac_options(**options)), comm)
    optimizer.setup(model)
    return model, optimizer


def single(seed=0, net=ConvBNNet, **options):
    """Reference: one process with rank 0's initial values (on every rank:
    process-local factors on purpose)."""
    model = net(seed=seed)
    optimizer = helpers.kfac(**kfac_options(process_local=True, **options))
    optimizer.setup(model)
    return model, optimizer


def train_distributed(model, optimizer, comm, steps, first_step=0,
                      data_seed=0):
    acc = optimizer.acc_iters
    for step in range(first_step, first_step + steps):
        batch = chunks(step, comm.size * acc, data_seed, model.in_shape)
        for j in range(acc):
            optimizer.update(helpers.loss_of(model),
                             *batch[comm.rank * acc + j])


def train_single(model, optimizer, n_chunks, steps, first_step=0,
                 data_seed=0):
    for step in range(first_step, first_step + steps):
        for x, t in chunks(step, n_chunks, data_seed, model.in_shape):
            optimizer.update(helpers.loss_of(model), x, t)


def params(model):
    return {name: p.array.copy() for name, p in sorted(model.namedparams())}


def max_relative_diff(a, b):
    return max(float(numpy.max(numpy.abs(a[k] - b[k]) /
                                (1.0 + numpy.abs(b[k])))) for k in a)


def gathered(value):
    """``value`` of every rank, on every rank."""
    return world.allgather(value)


def assert_everywhere(ok, what=''):
    flags = gathered(bool(ok))
    assert all(flags), '{} fails on ranks {}'.format(
        what, [r for r, f in enumerate(flags) if not f])


def naive(wire_dtype=None):
    """The default wire sends float64 arrays unrounded."""
    return create_communicator('naive', wire_dtype=wire_dtype)
