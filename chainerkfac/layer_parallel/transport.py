"""The messages MGRIT sends: point-to-point states and a few collectives,
over mpi4py, or nothing at all for one process.

:func:`transport_for` accepts what users hold: ``None`` (one process, MPI
is not even imported), an mpi4py communicator, or a ChainerMN communicator
(its ``mpi_comm``, e.g. of ``chainerkfac.create_communicator(
'host_staged')``).

Device (CuPy) arrays travel through host memory, as the ``host_staged``
communicator does for K-FAC: a send copies the array to the host first, a
receive lands in a host buffer that :meth:`MPITransport.waitall` copies to
the device. The MPI needs no CUDA support, and several processes may share
one GPU.
"""
import math
from typing import Any, List, Optional


class LocalTransport:
    """One process: there is never anyone to send to (a null object, so
    one and many processes share the solver's code path)."""

    rank = 0
    size = 1

    def isend(self, array, dest: int, tag: int):
        raise RuntimeError('a single process has no rank {} to send to'
                           .format(dest))

    def recv(self, array, source: int, tag: int) -> None:
        raise RuntimeError('a single process has no rank {} to receive from'
                           .format(source))

    def irecv(self, array, source: int, tag: int):
        self.recv(array, source, tag)

    def waitall(self, requests: List[Any]) -> None:
        assert not requests

    def allgather(self, value):
        return [value]

    def bcast(self, value, root: int):
        return value

    def bcast_array(self, array, root: int) -> None:
        pass

    def allreduce_sum(self, array) -> None:
        pass

    def split(self, color: int, key: int) -> 'LocalTransport':
        return self


class _Staged:
    """A message of a device array through a host buffer: a send keeps its
    host copy alive until the wait; a receive copies to the device after
    it."""

    def __init__(self, request, host, device=None):
        self.request = request
        self.host = host
        self.device = device

    def finish(self) -> None:
        if self.device is not None:
            self.device.set(self.host)


class MPITransport:
    """Point-to-point and collectives on an mpi4py communicator.

    Arrays travel as raw buffers (uppercase mpi4py calls: no pickling);
    every array this module sends or receives is C-contiguous; device
    arrays are staged through host memory (module docstring). The
    messages sent are counted (the performance model's test compares them
    with its schedule), and so are the staged ones.
    """

    def __init__(self, mpi_comm):
        self.comm = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.messages = 0
        self.staged = 0

    def isend(self, array, dest: int, tag: int):
        self.messages += 1
        if _on_device(array):
            self.staged += 1
            host = _contiguous(array).get()
            return _Staged(self.comm.Isend(host, dest=dest, tag=tag), host)
        return self.comm.Isend(_contiguous(array), dest=dest, tag=tag)

    def recv(self, array, source: int, tag: int) -> None:
        if _on_device(array):
            host = _host_buffer(array)
            self.comm.Recv(host, source=source, tag=tag)
            array.set(host)
            return
        self.comm.Recv(_contiguous(array), source=source, tag=tag)

    def irecv(self, array, source: int, tag: int):
        if _on_device(array):
            host = _host_buffer(array)
            return _Staged(self.comm.Irecv(host, source=source, tag=tag),
                           host, array)
        return self.comm.Irecv(_contiguous(array), source=source, tag=tag)

    def waitall(self, requests) -> None:
        from mpi4py import MPI
        MPI.Request.Waitall([getattr(r, 'request', r) for r in requests])
        for request in requests:
            if isinstance(request, _Staged):
                request.finish()

    def allgather(self, value) -> list:
        return self.comm.allgather(value)

    def bcast(self, value, root: int):
        return self.comm.bcast(value, root=root)

    def bcast_array(self, array, root: int) -> None:
        if _on_device(array):
            host = _contiguous(array).get()
            self.comm.Bcast(host, root=root)
            array.set(host)
            return
        self.comm.Bcast(_contiguous(array), root=root)

    def allreduce_sum(self, array) -> None:
        from mpi4py import MPI
        if _on_device(array):
            host = _contiguous(array).get()
            self.comm.Allreduce(MPI.IN_PLACE, host, op=MPI.SUM)
            array.set(host)
            return
        self.comm.Allreduce(MPI.IN_PLACE, _contiguous(array), op=MPI.SUM)

    def split(self, color: int, key: int):
        return transport_for(self.comm.Split(color, key))


def _contiguous(array):
    if not array.flags.c_contiguous:
        raise ValueError('MPI buffers must be C-contiguous')
    return array


def _on_device(array) -> bool:
    """A device (CuPy) array: it has ``get`` and ``set`` for host copies,
    which NumPy arrays do not."""
    return hasattr(array, 'get') and hasattr(array, 'set')


def _host_buffer(array):
    import numpy
    _contiguous(array)
    return numpy.empty(array.shape, dtype=array.dtype)


def transport_for(comm: Optional[Any]):
    """A transport on ``comm``: ``None``, an mpi4py communicator, a
    ChainerMN communicator (anything with ``mpi_comm``), or a transport."""
    if comm is None:
        return LocalTransport()
    if isinstance(comm, (LocalTransport, MPITransport)):
        return comm
    mpi_comm = getattr(comm, 'mpi_comm', comm)
    if not hasattr(mpi_comm, 'Get_rank'):
        raise TypeError('comm must be None, an mpi4py or a ChainerMN '
                        'communicator, not {!r}'.format(type(comm)))
    if mpi_comm.Get_size() == 1:
        return LocalTransport()
    return MPITransport(mpi_comm)


def agree_on_weights(transport, link) -> bool:
    """Make the parameters of ``link`` (the same network on every process
    of ``transport``) rank 0's wherever they differ anywhere: one digest
    each process, all gathered; rank 0's arrays broadcast only where the
    digests differ. Returns whether they did."""
    if transport.size == 1:
        return False
    import hashlib
    import numpy
    from chainer import backend
    arrays = [p.array for _, p in sorted(link.namedparams())
              if p.array is not None]
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(numpy.ascontiguousarray(
            backend.CpuDevice().send(array)).tobytes())
    if len(set(transport.allgather(digest.hexdigest()))) == 1:
        return False
    for array in arrays:
        transport.bcast_array(array, 0)
    return True


def norm_of_squares(parts: List[List[float]]) -> float:
    """sqrt of the sum of squared norms gathered from all processes.

    ``math.fsum`` rounds the exact sum once, so the norm does not depend on
    how the points were distributed: residual histories are bitwise equal
    on any number of processes.
    """
    return math.sqrt(math.fsum(value for part in parts for value in part))


def squared_norm(array) -> float:
    """‖array‖² (Frobenius) as a Python float."""
    return float((array * array).sum())
