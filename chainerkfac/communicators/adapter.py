"""K-FAC's collectives for a plain ChainerMN communicator.

``chainerkfac.create_multi_node_optimizer(KFAC(), comm)`` accepts the
communicator a ChainerMN script already has
(``chainermn.create_communicator('naive')`` on CPU, ``'pure_nccl'`` on
GPU, or any other): :func:`kfac_collectives` gives it ``reduce_scatter_v``
and ``all_gather_v`` over the *same* processes, on the communicator's own
MPI communicator (or NCCL communicator for ``pure_nccl``), without a second
MPI initialisation and without changing the communicator object.
"""
from chainermn.communicators.pure_nccl_communicator import \
    PureNcclCommunicator

from chainerkfac.communicators import naive, pure_nccl
from chainerkfac.communicators.base import KfacCommunicatorMixin


class KfacCollectives(KfacCommunicatorMixin):
    """``reduce_scatter_v`` / ``all_gather_v`` beside a ChainerMN
    communicator.

    With a ``PureNcclCommunicator`` they run over its NCCL communicator
    (padded segments); with any other over its MPI communicator, staging
    CuPy arrays through host memory.

    Parameters
    ----------
    comm : chainermn.communicators.CommunicatorBase
    wire_dtype : str, numpy.dtype or None
        Element type on the wire: None (default) the arrays' common type,
        at least float32; or 'float16', 'float32', 'float64'.
    """

    def __init__(self, comm, wire_dtype=None):
        self.comm = comm
        self.mpi_comm = comm.mpi_comm
        self.rank = comm.rank
        self.size = comm.size
        self._nccl = isinstance(comm, PureNcclCommunicator)
        self._pad_segments = self._nccl
        self._init_kfac(wire_dtype)

    def _reduce_scatter(self, sendbuf, layout):
        if self._nccl:
            self.comm._init_comms()
            return pure_nccl.nccl_reduce_scatter(self.comm.nccl_comm,
                                                 self.rank, sendbuf, layout)
        return naive.mpi_reduce_scatter(self.mpi_comm, self.rank, sendbuf,
                                        layout)

    def _all_gather(self, segment, layout):
        if self._nccl:
            self.comm._init_comms()
            return pure_nccl.nccl_all_gather(self.comm.nccl_comm, segment,
                                             layout)
        return naive.mpi_all_gather(self.mpi_comm, segment, layout)


def kfac_collectives(comm):
    """The object that runs K-FAC's collectives for ``comm``: ``comm``
    itself if it has them (:func:`create_communicator`), else a
    :class:`KfacCollectives` beside it."""
    if hasattr(comm, 'reduce_scatter_v') and hasattr(comm, 'all_gather_v'):
        return comm
    if not hasattr(comm, 'mpi_comm') or not hasattr(comm, 'bcast_data'):
        raise TypeError(
            'K-FAC multi-node needs a ChainerMN communicator (from '
            'chainermn.create_communicator or chainerkfac.create_'
            'communicator), got {}'.format(type(comm).__name__))
    return KfacCollectives(comm)
