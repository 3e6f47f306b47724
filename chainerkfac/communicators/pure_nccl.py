"""K-FAC collectives over NCCL for CuPy arrays (GPU).

NCCL has no variable-count collectives, so the layout pads every rank's
segment to the longest one and the transport is one true ``reduceScatter``
and one ``allGather`` over equal counts, not an all-reduce of the whole
buffer (which moves about twice the bytes). float16 is summed natively.

Importing this module does not need CuPy; constructing the communicator
does (ChainerMN checks for NCCL).
"""
import chainer
from chainermn import nccl
from chainermn.communicators import _communication_utility
from chainermn.communicators.pure_nccl_communicator import \
    PureNcclCommunicator

from chainerkfac.communicators.base import KfacCommunicatorMixin


def nccl_reduce_scatter(nccl_comm, rank: int, sendbuf, layout):
    """This rank's summed segment of a padded reduce-scatter buffer."""
    count = layout.reduce_scatter_counts[rank]  # equal on all ranks
    segment = chainer.cuda.cupy.empty(count, dtype=layout.wire_dtype)
    nccl_comm.reduceScatter(
        sendbuf.data.ptr, segment.data.ptr, count,
        _communication_utility._get_nccl_type_id(layout.wire_dtype),
        nccl.NCCL_SUM, chainer.cuda.Stream.null.ptr)
    return segment


def nccl_all_gather(nccl_comm, segment, layout):
    """The whole buffer of an all-gather of equal (padded) segments."""
    buffer = chainer.cuda.cupy.empty(layout.all_gather_size,
                                     dtype=layout.wire_dtype)
    nccl_comm.allGather(
        segment.data.ptr, buffer.data.ptr, segment.size,
        _communication_utility._get_nccl_type_id(layout.wire_dtype),
        chainer.cuda.Stream.null.ptr)
    return buffer


class KfacPureNcclCommunicator(KfacCommunicatorMixin, PureNcclCommunicator):
    """ChainerMN's ``PureNcclCommunicator`` with K-FAC's collectives.

    Parameters
    ----------
    mpi_comm : mpi4py.MPI.Comm
    wire_dtype : str, numpy.dtype or None
        Element type on the wire: None (default) the arrays' common type,
        at least float32; or 'float16', 'float32', 'float64'.
    """

    _pad_segments = True

    def __init__(self, mpi_comm, wire_dtype=None):
        super(KfacPureNcclCommunicator, self).__init__(mpi_comm)
        self._init_kfac(wire_dtype)

    def _reduce_scatter(self, sendbuf, layout):
        self._init_comms()
        return nccl_reduce_scatter(self.nccl_comm, self.rank, sendbuf, layout)

    def _all_gather(self, segment, layout):
        self._init_comms()
        return nccl_all_gather(self.nccl_comm, segment, layout)
