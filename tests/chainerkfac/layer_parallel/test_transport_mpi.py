"""MGRIT's transport stages device arrays through host memory (run under
mpiexec by tests/run_mpi.py): here a NumPy stand-in for a CuPy array (it
has CuPy's ``get`` and ``set``, which NumPy arrays lack) travels every way
the solver sends states; on a GPU, tests/gpu/test_layer_parallel_gpu.py
runs MGRIT itself on CuPy arrays."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import numpy
import pytest
from mpi4py import MPI

from chainerkfac.layer_parallel import transport as transport_module

pytestmark = pytest.mark.mpi

world = MPI.COMM_WORLD


class DeviceLike(numpy.ndarray):
    """Not host memory as far as the transport can tell."""

    def get(self):
        return numpy.array(self)

    def set(self, host):
        self[...] = host


def device(array):
    return numpy.ascontiguousarray(array).view(DeviceLike)


def test_device_arrays_travel_through_host_buffers():
    transport = transport_module.transport_for(world)
    if world.size == 1:
        assert isinstance(transport, transport_module.LocalTransport)
        return
    rank, size = transport.rank, transport.size
    right, left = (rank + 1) % size, (rank - 1) % size
    sent = device(numpy.full((3, 4), rank, dtype=numpy.float64))
    got = device(numpy.zeros((3, 4)))
    transport.waitall([transport.irecv(got, left, 7),
                       transport.isend(sent, right, 7)])
    failures = []
    if not (got == left).all():
        failures.append('irecv/isend: {}'.format(got[0, 0]))
    single = device(numpy.zeros(5))
    if rank == 0:
        transport.waitall([transport.isend(device(numpy.arange(5.0)), 1, 8)])
    elif rank == 1:
        transport.recv(single, 0, 8)
        if not (single == numpy.arange(5.0)).all():
            failures.append('recv: {}'.format(single))
    broadcast = device(numpy.full(4, float(rank)))
    transport.bcast_array(broadcast, root=size - 1)
    if not (broadcast == size - 1).all():
        failures.append('bcast_array: {}'.format(broadcast))
    summed = device(numpy.full(6, rank + 1.0))
    transport.allreduce_sum(summed)
    if not (summed == size * (size + 1) / 2).all():
        failures.append('allreduce_sum: {}'.format(summed))
    if transport.staged != transport.messages or not transport.staged:
        failures.append('staged {} of {} sends'.format(transport.staged,
                                                       transport.messages))
    everyone = world.allgather(failures)
    assert not any(everyone), everyone
