"""chainerkfac: distributed K-FAC for Chainer (Osawa et al., CVPR 2019)."""
from chainerkfac import _compat  # NOQA  (must run before chainer is imported)
from chainerkfac import schedules  # NOQA
from chainerkfac import optimizers  # NOQA
from chainerkfac.multi_node_optimizer import create_multi_node_optimizer  # NOQA


def __getattr__(name):
    # The communicators import ChainerMN and so mpi4py (MPI_Init): only
    # when asked for, not on ``import chainerkfac``.
    if name == 'create_communicator':
        from chainerkfac.communicators import create_communicator
        return create_communicator
    raise AttributeError('module {!r} has no attribute {!r}'.format(
        __name__, name))
