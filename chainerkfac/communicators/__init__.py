"""ChainerMN communicators extended with K-FAC's ReduceScatterV / AllGatherV.

``create_communicator`` returns subclasses of ChainerMN's own communicator
classes, so ``bcast_data``, ``scatter_dataset``, the multi-node evaluator and
``multi_node_mean_grad`` keep working, plus ``reduce_scatter_v`` and
``all_gather_v`` (see :class:`~chainerkfac.communicators.base.\
KfacCommunicatorMixin`). A plain ChainerMN communicator works too:
:func:`kfac_collectives` puts K-FAC's collectives beside it.
"""
import warnings

from chainermn import global_except_hook
from chainermn import nccl

from chainerkfac.communicators.adapter import kfac_collectives  # NOQA
from chainerkfac.communicators.base import KfacCommunicatorMixin  # NOQA
from chainerkfac.communicators.base import WIRE_DTYPES  # NOQA


COMMUNICATOR_NAMES = ('naive', 'pure_nccl', 'host_staged')


def create_communicator(name: str = 'naive', mpi_comm=None,
                        wire_dtype=None):
    """Create a ChainerMN communicator with K-FAC's collectives.

    Also installs ChainerMN's global except hook, so that an uncaught
    exception on one rank calls ``MPI_Abort`` and ends the whole job instead
    of leaving the other ranks waiting in a collective forever.

    Parameters
    ----------
    name : str
        'naive' (MPI, NumPy arrays; works on CPU), 'pure_nccl' (NCCL, CuPy
        arrays; needs CuPy with NCCL) or 'host_staged' (MPI, CuPy arrays
        through host memory: several ranks on one GPU, or no NCCL).
    mpi_comm : mpi4py.MPI.Comm, optional
        Defaults to ``MPI.COMM_WORLD``.
    wire_dtype : str, numpy.dtype or None
        Element type of ``reduce_scatter_v`` / ``all_gather_v`` on the wire:
        None (default) sends each call's arrays at their common type, at
        least float32 (a float64 model's factors and gradients unrounded,
        float16 factors summed in float32); 'float16', 'float32' or
        'float64' fix it (``'float16'`` halves a float32 model's bytes). ChainerMN's own
        collectives are unaffected (``pure_nccl`` has its own
        ``allreduce_grad_dtype`` config for gradients).

    Returns
    -------
    KfacNaiveCommunicator, KfacPureNcclCommunicator or
    KfacHostStagedCommunicator
    """
    if name not in COMMUNICATOR_NAMES:
        raise ValueError('unknown communicator {!r}; valid names: {}'.format(
            name, ', '.join(COMMUNICATOR_NAMES)))
    if name == 'pure_nccl' and not nccl._available:
        raise RuntimeError(
            "the 'pure_nccl' communicator needs CuPy with NCCL "
            "(cupy.cuda.nccl), which cannot be imported here; use 'naive' "
            "on CPU")
    if mpi_comm is None:
        from mpi4py import MPI
        mpi_comm = MPI.COMM_WORLD
    if name == 'naive':
        from chainerkfac.communicators.naive import KfacNaiveCommunicator
        comm = KfacNaiveCommunicator(mpi_comm, wire_dtype=wire_dtype)
    elif name == 'host_staged':
        from chainerkfac.communicators.host_staged import \
            KfacHostStagedCommunicator
        comm = KfacHostStagedCommunicator(mpi_comm, wire_dtype=wire_dtype)
    else:
        from chainerkfac.communicators.pure_nccl import \
            KfacPureNcclCommunicator
        comm = KfacPureNcclCommunicator(mpi_comm, wire_dtype=wire_dtype)
    install_except_hook()
    return comm


def install_except_hook() -> None:
    """Make an uncaught exception on one process end the whole job
    (ChainerMN's global except hook, which calls ``MPI_Abort``)."""
    # add_hook() warns and does nothing when the hook is already installed
    # (by an earlier communicator, or CHAINERMN_FORCE_ABORT_ON_EXCEPTION).
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        global_except_hook.add_hook()
