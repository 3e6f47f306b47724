"""reduce_scatter_v / all_gather_v over MPI against a NumPy reference.

Run on 1-4 ranks by ``tests/run_mpi.py``. Every test does all its
collectives first and asserts on values gathered from all ranks, so every
rank reaches the same verdict and none is left waiting in a collective.
"""
import numpy
import pytest
from mpi4py import MPI

import chainer

from chainerkfac.communicators import create_communicator

pytestmark = pytest.mark.mpi

world = MPI.COMM_WORLD


@pytest.fixture(scope='module', params=['float32', 'float16'])
def comm(request):
    return create_communicator('naive', wire_dtype=request.param)


def _problem(seed, size, n_arrays=10):
    """Shapes, owners and symmetric flags, the same on every rank."""
    rng = numpy.random.RandomState(seed)
    shapes, owners, symmetric = [], [], []
    for _ in range(n_arrays):
        sym = bool(rng.rand() < 0.5)
        if sym:
            n = int(rng.randint(1, 12))
            shapes.append((n, n))
        else:
            shapes.append(tuple(int(d) for d in
                                rng.randint(1, 6, size=rng.randint(1, 4))))
        symmetric.append(sym)
        k = int(rng.randint(1, size + 1))
        ranks = tuple(int(r) for r in rng.permutation(size)[:k])
        owners.append(ranks[0] if k == 1 else ranks)
    return shapes, owners, symmetric


def _arrays(shapes, symmetric, seed):
    """This rank's arrays, seeded per rank."""
    rng = numpy.random.RandomState(seed * 100 + world.rank)
    arrays = []
    for shape, sym in zip(shapes, symmetric):
        a = rng.randn(*shape).astype(numpy.float32)
        arrays.append(a + a.T if sym else a)
    return arrays


def _owner_tuple(owner):
    return (owner,) if isinstance(owner, int) else owner


def _tolerance(comm):
    # Largest |got - expected| / (1 + |expected|) measured over 20 such
    # problems on 1-4 ranks: 2.5e-3 on a float16 wire (inputs and partial
    # sums rounded to 11 bits), 2.4e-7 on float32; twice that here.
    return 5e-3 if comm.wire_dtype == numpy.float16 else 5e-7


def _assert_everywhere(local_problems):
    """Assert that no rank reported a problem (same verdict on all ranks)."""
    problems = [p for rank_problems in world.allgather(local_problems)
                for p in rank_problems]
    assert not problems, problems


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_reduce_scatter_v_matches_reference(comm, seed):
    shapes, owners, symmetric = _problem(seed, comm.size)
    arrays = _arrays(shapes, symmetric, seed)
    result = comm.reduce_scatter_v(arrays, owners, symmetric)
    everyone = world.allgather(arrays)
    problems = []
    for i, owner in enumerate(owners):
        if comm.rank in _owner_tuple(owner):
            expected = numpy.sum([a[i] for a in everyone], axis=0)
            got = result[i]
            if got is None or got.shape != expected.shape or \
                    got.dtype != numpy.float32 or not numpy.allclose(
                        got, expected, rtol=_tolerance(comm),
                        atol=_tolerance(comm)):
                problems.append((comm.rank, i, 'wrong sum'))
        elif result[i] is not None:
            problems.append((comm.rank, i, 'non-owner got an array'))
    _assert_everywhere(problems)


@pytest.mark.parametrize('seed', [0, 1, 2])
def test_all_gather_v_matches_reference(comm, seed):
    shapes, owners, symmetric = _problem(seed + 10, comm.size)
    arrays = _arrays(shapes, symmetric, seed)
    result = comm.all_gather_v(arrays, owners, symmetric)
    everyone = world.allgather(arrays)
    problems = []
    for i, owner in enumerate(owners):
        expected = everyone[_owner_tuple(owner)[0]][i]
        if result[i].dtype != numpy.float32 or not numpy.allclose(
                result[i], expected, rtol=1e-3, atol=1e-3):
            problems.append((comm.rank, i))
    _assert_everywhere(problems)


def test_float32_wire_all_gather_is_exact():
    comm = create_communicator('naive')
    shapes, owners, symmetric = _problem(7, comm.size)
    arrays = _arrays(shapes, symmetric, 7)
    result = comm.all_gather_v(arrays, owners, symmetric)
    everyone = world.allgather(arrays)
    exact = all(numpy.array_equal(result[i], everyone[_owner_tuple(o)[0]][i])
                for i, o in enumerate(owners))
    _assert_everywhere([] if exact else [comm.rank])


def test_byte_counters_equal_the_analytic_count(comm):
    shapes, owners, symmetric = _problem(3, comm.size)
    arrays = _arrays(shapes, symmetric, 3)
    comm.reset_byte_counts()
    comm.reduce_scatter_v(arrays, owners, symmetric)
    comm.all_gather_v(arrays, owners, symmetric)
    comm.all_gather_v(arrays, owners)  # unpacked
    itemsize = comm.wire_dtype.itemsize

    def wire(shape, sym):
        return shape[0] * (shape[0] + 1) // 2 if sym else int(
            numpy.prod(shape))

    rs = sum(len(_owner_tuple(o)) * wire(s, y)
             for s, o, y in zip(shapes, owners, symmetric))
    ag = sum(wire(s, y) + wire(s, False)
             for s, o, y in zip(shapes, owners, symmetric)
             if _owner_tuple(o)[0] == comm.rank)
    expected = {'reduce_scatter_v': rs * itemsize,
                'all_gather_v': ag * itemsize}
    got = comm.bytes_sent
    _assert_everywhere([] if got == expected else [(comm.rank, got,
                                                    expected)])


def test_packing_and_fp16_ratios():
    n = 64
    matrix = numpy.eye(n, dtype=numpy.float32)
    sent = {}
    for wire in ('float32', 'float16'):
        comm = create_communicator('naive', wire_dtype=wire)
        for sym in (True, False):
            comm.reset_byte_counts()
            comm.reduce_scatter_v([matrix], [0], [sym])
            sent[wire, sym] = comm.bytes_sent['reduce_scatter_v']
    assert sent['float32', True] / sent['float32', False] == \
        pytest.approx((n + 1) / (2 * n))
    assert sent['float16', True] / sent['float32', True] == 0.5
    assert sent['float16', False] / sent['float32', False] == 0.5


def test_results_keep_input_dtype_and_empty_calls_work():
    comm = create_communicator('naive')
    arrays = [numpy.full((3, 3), comm.rank + 1.0),
              numpy.ones(4, numpy.float16)]
    owners = [comm.size - 1, tuple(range(comm.size))]
    reduced = comm.reduce_scatter_v(arrays, owners, [True, False])
    gathered = comm.all_gather_v(arrays, owners)
    empty = (comm.reduce_scatter_v([], []), comm.all_gather_v([], []))
    total = comm.size * (comm.size + 1) / 2.0
    ok = (reduced[1].dtype == numpy.float16
          and numpy.array_equal(reduced[1], numpy.full(4, comm.size))
          and gathered[0].dtype == numpy.float64
          and numpy.array_equal(gathered[0], numpy.full((3, 3), comm.size))
          and empty == ([], []))
    if comm.rank == comm.size - 1:
        ok = ok and numpy.array_equal(reduced[0], numpy.full((3, 3), total))
    _assert_everywhere([] if ok else [comm.rank])


def test_mismatched_calls_are_detected_in_debug_mode():
    comm = create_communicator('naive')
    arrays = [numpy.zeros(2 + comm.rank, numpy.float32)]
    mismatch = comm.size > 1
    with chainer.using_config('debug', True):
        if mismatch:
            with pytest.raises(ValueError, match='differ'):
                comm.reduce_scatter_v(arrays, [0])
        else:
            comm.reduce_scatter_v(arrays, [0])


def test_unsupported_wire_dtype_is_rejected():
    with pytest.raises(ValueError, match='wire_dtype'):
        create_communicator('naive', wire_dtype='int8')


@pytest.mark.parametrize('flavour', ['chainerkfac', 'chainermn'])
def test_the_default_wire_follows_the_data(flavour):
    """No wire_dtype given: float64 arrays travel unrounded (a float64
    model's N processes take one process's step), float16 ones are summed
    in float32, on our communicator and beside ChainerMN's own."""
    import chainermn
    from chainerkfac.communicators import kfac_collectives
    if flavour == 'chainerkfac':
        comm = create_communicator('naive')
    else:
        comm = kfac_collectives(chainermn.create_communicator('naive'))
    assert comm.wire_dtype is None
    tiny = 2.0 ** -40           # lost in float32: 1 + tiny == 1
    # One buffer per call, at the call's common type (at least float32).
    reduced = comm.reduce_scatter_v([numpy.full(3, 1.0 + tiny)], [0])
    sent64 = comm.bytes_sent['reduce_scatter_v']
    reduced += comm.reduce_scatter_v([numpy.full(2, 0.5, numpy.float16)],
                                     [0])
    sent16 = comm.bytes_sent['reduce_scatter_v'] - sent64
    gathered = comm.all_gather_v([numpy.full(3, 1.0 + tiny * comm.rank)],
                                 [comm.size - 1])
    ok = (gathered[0][0] == 1.0 + tiny * (comm.size - 1)
          and (sent64, sent16) == (3 * 8, 2 * 4))
    if comm.rank == 0:
        ok = ok and (reduced[0][0] == comm.size * (1.0 + tiny)
                     and reduced[1].dtype == numpy.float16
                     and reduced[1][0] == comm.size * 0.5)
    _assert_everywhere([] if ok else [(comm.rank, reduced, gathered)])
