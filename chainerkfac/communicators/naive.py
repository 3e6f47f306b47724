"""K-FAC collectives over MPI (CPU, or GPU arrays staged through the host).

One ``MPI.Reduce_scatter`` with per-rank counts and one ``Allgatherv`` move
one packed buffer per call. CuPy buffers are copied to the host and back
(MPI is not assumed to be CUDA-aware).

MPI has no float16 type nor float16 sum, so a float16 wire sends the bytes
as 16-bit integers and reduces them with a user-defined, commutative
``MPI.Op`` that views them as float16 and adds them in NumPy. That op runs in
Python and is slow: it exists to measure the halved volume on CPU, not to
speed anything up (on GPU, NCCL sums float16 natively).
"""
import numpy
from mpi4py import MPI

import chainer
from chainermn.communicators.naive_communicator import NaiveCommunicator

from chainerkfac.communicators.base import KfacCommunicatorMixin


def _sum_float16(inbuf, inoutbuf, datatype) -> None:
    del datatype  # always the 16-bit carrier
    inout = numpy.frombuffer(inoutbuf, dtype=numpy.float16)
    inout += numpy.frombuffer(inbuf, dtype=numpy.float16)


_float16_sum = None


def _mpi_type_and_sum(dtype: numpy.dtype):
    """MPI datatype and summing op for a wire dtype."""
    global _float16_sum
    if dtype == numpy.float16:
        if _float16_sum is None:
            _float16_sum = MPI.Op.Create(_sum_float16, commute=True)
        return MPI.UINT16_T, _float16_sum
    return {numpy.float32: MPI.FLOAT, numpy.float64: MPI.DOUBLE}[
        dtype.type], MPI.SUM


def _to_host(buffer):
    if isinstance(buffer, numpy.ndarray):
        return buffer, None
    device = chainer.backend.get_device_from_array(buffer)
    return chainer.backend.CpuDevice().send(buffer), device


def mpi_reduce_scatter(mpi_comm, rank: int, sendbuf, layout):
    """This rank's summed segment of a packed reduce-scatter buffer."""
    host, device = _to_host(sendbuf)
    datatype, op = _mpi_type_and_sum(layout.wire_dtype)
    segment = numpy.empty(layout.reduce_scatter_counts[rank],
                          dtype=layout.wire_dtype)
    mpi_comm.Reduce_scatter([host, datatype], [segment, datatype],
                            list(layout.reduce_scatter_counts), op)
    return segment if device is None else device.send(segment)


def mpi_all_gather(mpi_comm, segment, layout):
    """The whole buffer of an all-gather of per-rank segments."""
    host, device = _to_host(segment)
    datatype, _ = _mpi_type_and_sum(layout.wire_dtype)
    buffer = numpy.empty(layout.all_gather_size, dtype=layout.wire_dtype)
    mpi_comm.Allgatherv(
        [host, datatype],
        [buffer, (list(layout.all_gather_counts),
                  list(layout.all_gather_offsets)), datatype])
    return buffer if device is None else device.send(buffer)


class KfacNaiveCommunicator(KfacCommunicatorMixin, NaiveCommunicator):
    """ChainerMN's ``NaiveCommunicator`` with K-FAC's collectives over MPI.

    Parameters
    ----------
    mpi_comm : mpi4py.MPI.Comm
    wire_dtype : str or numpy.dtype
        Element type on the wire: 'float32' (default), 'float16' or
        'float64'.
    """

    def __init__(self, mpi_comm, wire_dtype=None):
        super(KfacNaiveCommunicator, self).__init__(mpi_comm)
        self._init_kfac(wire_dtype)

    def _reduce_scatter(self, sendbuf, layout):
        return mpi_reduce_scatter(self.mpi_comm, self.rank, sendbuf, layout)

    def _all_gather(self, segment, layout):
        return mpi_all_gather(self.mpi_comm, segment, layout)
