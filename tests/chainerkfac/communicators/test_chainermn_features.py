"""ChainerMN's own features still work on our communicator."""
import numpy
import pytest
from mpi4py import MPI

import chainer
import chainer.links as L
import chainermn

from chainerkfac.communicators import create_communicator

pytestmark = pytest.mark.mpi


def _assert_everywhere(ok):
    assert all(MPI.COMM_WORLD.allgather(bool(ok)))


def test_is_a_chainermn_communicator():
    comm = create_communicator('naive')
    assert isinstance(comm, chainermn.communicators.CommunicatorBase)
    assert isinstance(
        comm, chainermn.communicators.naive_communicator.NaiveCommunicator)


def test_bcast_data():
    comm = create_communicator('naive')
    numpy.random.seed(comm.rank)
    link = L.Linear(3, 2)
    comm.bcast_data(link)
    root = comm.mpi_comm.bcast(link.W.array if comm.rank == 0 else None)
    _assert_everywhere(numpy.array_equal(link.W.array, root))


def test_multi_node_mean_grad():
    comm = create_communicator('naive')
    link = L.Linear(3, 2)
    link.cleargrads()
    link.W.grad = numpy.full((2, 3), comm.rank, numpy.float32)
    link.b.grad = numpy.zeros(2, numpy.float32)
    comm.multi_node_mean_grad(link)
    _assert_everywhere(numpy.allclose(link.W.grad, (comm.size - 1) / 2.0))


def test_scatter_dataset():
    comm = create_communicator('naive')
    dataset = list(range(10)) if comm.rank == 0 else None
    mine = chainermn.scatter_dataset(dataset, comm)
    everyone = comm.mpi_comm.allgather(list(mine))
    # force_equal_length (the default) repeats examples to equal lengths.
    _assert_everywhere(set(sum(everyone, [])) == set(range(10))
                       and len({len(part) for part in everyone}) == 1)


def test_split_keeps_wire_dtype():
    comm = create_communicator('naive', wire_dtype='float16')
    half = comm.split(comm.rank % 2, comm.rank)
    result = half.all_gather_v([numpy.full(3, comm.rank, numpy.float32)],
                               [0])
    expected = comm.rank % 2
    _assert_everywhere(type(half) is type(comm)
                       and half.wire_dtype == numpy.float16
                       and numpy.array_equal(result[0],
                                             numpy.full(3, expected)))


def test_multi_node_evaluator():
    comm = create_communicator('naive')

    class Constant(chainer.Chain):
        def forward(self, x):
            chainer.report({'value': float(comm.rank)}, self)
            return x

    model = Constant()
    dataset = chainer.datasets.TupleDataset(numpy.zeros((2, 1), 'f'))
    iterator = chainer.iterators.SerialIterator(dataset, 1, repeat=False,
                                                shuffle=False)
    evaluator = chainermn.create_multi_node_evaluator(
        chainer.training.extensions.Evaluator(iterator, model), comm)
    result = evaluator()
    _assert_everywhere(numpy.isclose(result['main/value'],
                                     (comm.size - 1) / 2.0))
