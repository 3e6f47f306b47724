"""The host-staged flavour on NumPy arrays under mpiexec: the same results as
the naive flavour, with and without NCCL's padded segments (its CuPy side
is in tests/gpu/test_multi_node_gpu.py)."""
import numpy
import pytest
from mpi4py import MPI

import chainer.links as L
import chainermn

from chainerkfac.communicators import create_communicator
from chainerkfac.communicators.host_staged import KfacHostStagedCommunicator
from tests.chainerkfac.communicators.test_collectives import _problem
from tests.chainerkfac.multi_node import common
from tests.chainerkfac.multi_node.test_equivalence import STALE, _compare

pytestmark = pytest.mark.mpi

world = MPI.COMM_WORLD


def _integer_arrays(shapes, symmetric, seed):
    """Small integers: every summation order gives the same exact sums, even
    on a float16 wire."""
    rng = numpy.random.RandomState(seed * 100 + world.rank)
    arrays = []
    for shape, sym in zip(shapes, symmetric):
        a = rng.randint(-8, 9, size=shape).astype(numpy.float32)
        arrays.append(a + a.T if sym else a)
    return arrays


def _same(a, b):
    return (a is None and b is None) or (
        a is not None and b is not None and a.dtype == b.dtype and
        numpy.array_equal(a, b))


@pytest.mark.parametrize('wire_dtype', ['float16', 'float32', 'float64'])
@pytest.mark.parametrize('pad', [False, True], ids=['packed', 'padded'])
@pytest.mark.parametrize('seed', [0, 1])
def test_collectives_equal_the_naive_flavour(wire_dtype, pad, seed):
    staged = KfacHostStagedCommunicator(world, wire_dtype, pad_segments=pad)
    naive = create_communicator('naive', wire_dtype=wire_dtype)
    shapes, owners, symmetric = _problem(seed, world.size)
    arrays = _integer_arrays(shapes, symmetric, seed)
    got = (staged.reduce_scatter_v(arrays, owners, symmetric),
           staged.all_gather_v(arrays, owners, symmetric))
    expected = (naive.reduce_scatter_v(arrays, owners, symmetric),
                naive.all_gather_v(arrays, owners, symmetric))
    ok = all(_same(a, b) for g, e in zip(got, expected)
             for a, b in zip(g, e))
    common.assert_everywhere(ok, 'host-staged == naive')


def test_padded_segments_are_equal_and_their_padding_is_counted():
    comm = KfacHostStagedCommunicator(world, pad_segments=True)
    shapes, owners, symmetric = _problem(5, world.size)
    arrays = _integer_arrays(shapes, symmetric, 5)
    comm.reduce_scatter_v(arrays, owners, symmetric)
    layout = comm._layout(arrays, owners, symmetric)
    wire = sum(len((o,) if isinstance(o, int) else o) *
               (s[0] * (s[0] + 1) // 2 if y else int(numpy.prod(s)))
               for s, o, y in zip(shapes, owners, symmetric))
    common.assert_everywhere(
        layout.pad and len(set(layout.reduce_scatter_counts)) == 1 and
        len(set(layout.all_gather_counts)) == 1 and
        comm.bytes_sent['reduce_scatter_v'] ==
        layout.reduce_scatter_size * 4 >= wire * 4, 'padded layout')


def test_bcast_data_and_mean_grad_on_numpy():
    comm = create_communicator('host_staged')
    numpy.random.seed(comm.rank)
    link = L.Linear(3, 2)
    comm.bcast_data(link)
    root = comm.mpi_comm.bcast(link.W.array if comm.rank == 0 else None)
    link.cleargrads()
    link.W.grad = numpy.full((2, 3), comm.rank, numpy.float32)
    comm.multi_node_mean_grad(link, zero_fill=True)
    common.assert_everywhere(
        numpy.array_equal(link.W.array, root) and
        numpy.allclose(link.W.grad, (comm.size - 1) / 2.0) and
        numpy.array_equal(link.b.grad, numpy.zeros(2, numpy.float32)),
        'bcast_data / multi_node_mean_grad')


def test_is_a_chainermn_naive_communicator_and_split_keeps_padding():
    comm = create_communicator('host_staged', wire_dtype='float16')
    padded = KfacHostStagedCommunicator(world, pad_segments=True)
    half = padded.split(world.rank % 2, world.rank)
    common.assert_everywhere(
        isinstance(comm, KfacHostStagedCommunicator) and
        isinstance(comm, chainermn.communicators.naive_communicator
                   .NaiveCommunicator) and
        comm.wire_dtype == numpy.float16 and not comm.pad_segments and
        type(half) is KfacHostStagedCommunicator and half.pad_segments,
        'communicator type')


@pytest.mark.parametrize('bn_fisher', ['full', 'diag'])
def test_n_ranks_equal_one_process_with_padded_segments(bn_fisher):
    """Distributed K-FAC through the padded layout (NumPy side)."""
    comm = KfacHostStagedCommunicator(world, 'float64', pad_segments=True)
    _compare(comm, 4, bn_fisher=bn_fisher, **STALE)
