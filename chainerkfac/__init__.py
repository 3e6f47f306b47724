"""chainerkfac: distributed K-FAC for Chainer (Osawa et al., CVPR 2019).

The one-line swap, in any Chainer training loop or Trainer::

    import chainerkfac
    optimizer = chainerkfac.optimizers.KFAC()   # was MomentumSGD(...)
    optimizer.setup(model)

``import chainerkfac`` before ``import chainer`` on NumPy 2 / Python 3.12
(it installs the compatibility shims of :mod:`chainerkfac._compat`).

* :class:`chainerkfac.optimizers.KFAC` — the optimizer, a sibling of
  ``chainer.optimizers.MomentumSGD``; ``GuardedOptimizer`` and ``LARS``
  (the first-order baselines), ``FusedMomentumSGD``;
* :func:`create_multi_node_optimizer` — distributed K-FAC over a ChainerMN
  communicator; ``create_communicator`` — ChainerMN's, with this
  library's transports (imports mpi4py when first used);
* :func:`register_block` — Fisher blocks for more link types
  (:class:`FisherBlock`, :class:`FactorKind`, :class:`Unsupported`);
* :mod:`chainerkfac.curvature` — BackPACK's quantities (per-sample
  gradients, DiagGGN, KFAC, KFLR, KFRA, ...) from one backward pass;
* :mod:`chainerkfac.layer_parallel` — layer-parallel training by
  multigrid in time (MGRIT) over processes;
* :mod:`chainerkfac.serializers` — ``load_npz`` with pickle off;
* :mod:`chainerkfac.training` — Trainer extensions (schedules, run logs);
* :mod:`chainerkfac.cudnn` — cuDNN 9 for Chainer on CuPy >= 14 (on by
  default where found; ``CHAINERKFAC_CUDNN=0`` turns it off);
* :mod:`chainerkfac.graphs` — steady-state steps replayed as CUDA graphs
  (``chainerkfac.graphs.graphed(optimizer)``).
"""
from chainerkfac import _compat  # NOQA  (must run before chainer is imported)
from chainerkfac import cudnn  # NOQA  (so must this: it installs cuDNN)
from chainerkfac import equations  # NOQA
from chainerkfac import graphs  # NOQA
from chainerkfac import optimizers  # NOQA
from chainerkfac import serializers  # NOQA
from chainerkfac import training  # NOQA
from chainerkfac.fisher_blocks import FactorKind  # NOQA
from chainerkfac.fisher_blocks import FisherBlock  # NOQA
from chainerkfac.fisher_blocks import Unsupported  # NOQA
from chainerkfac.fisher_blocks import register_block  # NOQA
from chainerkfac.multi_node_optimizer import create_multi_node_optimizer  # NOQA

__version__ = '0.3.0'


def __dir__():
    # create_communicator is served on first use (:func:`__getattr__`)
    return sorted(set(globals()) | {'create_communicator'})


def __getattr__(name):
    # The communicators import ChainerMN and so mpi4py (MPI_Init): only
    # when asked for, not on ``import chainerkfac``.
    if name == 'create_communicator':
        from chainerkfac.communicators import create_communicator
        return create_communicator
    raise AttributeError('module {!r} has no attribute {!r}'.format(
        __name__, name))
