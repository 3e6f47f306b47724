"""Packing for ReduceScatterV / AllGatherV, in a simulated world of P ranks.

Each rank's buffer is built in this one process; summing the buffers and
slicing segments is what the collectives do, so the round trips here are the
collectives' results without MPI.
"""
import numpy
import pytest

from chainerkfac import packing


def _symmetric(rng, n, dtype=numpy.float32):
    m = rng.randn(n, n)
    return (m + m.T).astype(dtype)


@pytest.mark.parametrize('n', [1, 2, 3, 17, 64])
@pytest.mark.parametrize('dtype', [numpy.float16, numpy.float32,
                                   numpy.float64])
def test_triu_round_trip_is_exact(n, dtype):
    m = _symmetric(numpy.random.RandomState(n), n, dtype)
    v = packing.triu_pack(m)
    assert v.shape == (n * (n + 1) // 2,)
    assert v.dtype == dtype
    restored = packing.triu_unpack(v, n)
    assert restored.dtype == dtype
    numpy.testing.assert_array_equal(restored, m)


def test_triu_pack_order_is_row_major_upper():
    m = numpy.array([[1, 2, 3], [2, 4, 5], [3, 5, 6]], numpy.float32)
    numpy.testing.assert_array_equal(packing.triu_pack(m), [1, 2, 3, 4, 5, 6])


def test_triu_unpack_mirrors_upper_triangle():
    m = packing.triu_unpack(numpy.arange(1, 7, dtype=numpy.float32), 3)
    numpy.testing.assert_array_equal(m, m.T)
    numpy.testing.assert_array_equal(m[0], [1, 2, 3])


def test_triu_rejects_bad_shapes():
    with pytest.raises(ValueError):
        packing.triu_pack(numpy.zeros((2, 3)))
    with pytest.raises(ValueError):
        packing.triu_unpack(numpy.zeros(5), 3)


def _random_problem(seed, size, n_arrays=8):
    """Shapes, owners and symmetric flags (same on all ranks)."""
    rng = numpy.random.RandomState(seed)
    shapes, owners, symmetric = [], [], []
    for _ in range(n_arrays):
        sym = rng.rand() < 0.5
        if sym:
            n = rng.randint(1, 9)
            shapes.append((n, n))
        else:
            shapes.append(tuple(rng.randint(1, 6, size=rng.randint(0, 4))))
        symmetric.append(sym)
        k = rng.randint(1, size + 1)
        owner = tuple(int(r) for r in rng.permutation(size)[:k])
        owners.append(owner[0] if k == 1 and rng.rand() < 0.5 else owner)
    return shapes, owners, symmetric


def _rank_arrays(shapes, symmetric, rank, dtype=numpy.float32):
    rng = numpy.random.RandomState(1000 + rank)
    return [_symmetric(rng, s[0], dtype) if sym
            else numpy.asarray(rng.randn(*s), dtype=dtype)
            for s, sym in zip(shapes, symmetric)]


def _simulate_reduce_scatter(layout, world):
    buffers = [layout.pack_reduce_scatter(arrays) for arrays in world]
    for buffer in buffers:
        assert buffer.shape == (layout.reduce_scatter_size,)
        assert buffer.dtype == layout.wire_dtype
    total = numpy.sum(buffers, axis=0, dtype=layout.wire_dtype)
    results = []
    for rank in range(layout.size):
        start = layout.reduce_scatter_offsets[rank]
        segment = total[start:start + layout.reduce_scatter_counts[rank]]
        results.append(layout.unpack_reduce_scatter(segment, rank))
    return results


def _simulate_all_gather(layout, world):
    segments = [layout.pack_all_gather(world[r], r)
                for r in range(layout.size)]
    assert [s.size for s in segments] == list(layout.all_gather_counts)
    buffer = numpy.concatenate(segments)
    assert list(layout.all_gather_offsets) == \
        [int(o) for o in numpy.cumsum([0] + [s.size for s in segments])[:-1]]
    return layout.unpack_all_gather(buffer)


def _owner_tuple(owner):
    return (owner,) if isinstance(owner, int) else owner


@pytest.mark.parametrize('size', [1, 2, 3, 4])
@pytest.mark.parametrize('seed', [0, 1, 2])
@pytest.mark.parametrize('pad', [False, True])
def test_reduce_scatter_gives_each_owner_the_sum(size, seed, pad):
    shapes, owners, symmetric = _random_problem(seed, size)
    world = [_rank_arrays(shapes, symmetric, r) for r in range(size)]
    layout = packing.Layout(shapes, ['float32'] * len(shapes), owners,
                            symmetric, size, 'float32', pad=pad)
    results = _simulate_reduce_scatter(layout, world)
    for i, owner in enumerate(owners):
        expected = numpy.sum([arrays[i] for arrays in world], axis=0)
        for rank in range(size):
            got = results[rank][i]
            if rank in _owner_tuple(owner):
                assert got.shape == shapes[i]
                assert got.dtype == numpy.float32
                numpy.testing.assert_allclose(got, expected, rtol=1e-5,
                                              atol=1e-5)
            else:
                assert got is None


@pytest.mark.parametrize('size', [1, 2, 3, 4])
@pytest.mark.parametrize('seed', [0, 1, 2])
@pytest.mark.parametrize('pad', [False, True])
def test_all_gather_gives_everyone_the_first_owners_copy(size, seed, pad):
    shapes, owners, symmetric = _random_problem(seed, size)
    world = [_rank_arrays(shapes, symmetric, r) for r in range(size)]
    layout = packing.Layout(shapes, ['float32'] * len(shapes), owners,
                            symmetric, size, 'float32', pad=pad)
    gathered = _simulate_all_gather(layout, world)
    for i, owner in enumerate(owners):
        numpy.testing.assert_array_equal(
            gathered[i], world[_owner_tuple(owner)[0]][i])


def test_all_gather_reads_only_own_arrays():
    layout = packing.Layout([(2,), (3,)], ['float32'] * 2, [0, 1],
                            [False, False], 2)
    segment = layout.pack_all_gather([None, numpy.ones(3, 'f')], 1)
    numpy.testing.assert_array_equal(segment, numpy.ones(3))


def test_padding_makes_equal_zero_filled_segments():
    shapes = [(4, 4), (3, 5), (6, 6), (7,)]
    owners = [0, (1, 2), 2, (0, 1)]
    symmetric = [True, False, True, False]
    layout = packing.Layout(shapes, ['float32'] * 4, owners, symmetric, 3,
                            pad=True)
    # Unpadded segments: rank 0: 10 + 7, rank 1: 15 + 7, rank 2: 15 + 21.
    assert layout.reduce_scatter_counts == (36, 36, 36)
    assert layout.reduce_scatter_offsets == (0, 36, 72)
    # First owners: rank 0: 10 + 7, rank 1: 15, rank 2: 21.
    assert layout.all_gather_counts == (21, 21, 21)
    arrays = _rank_arrays(shapes, symmetric, 0)
    buffer = layout.pack_reduce_scatter(arrays)
    numpy.testing.assert_array_equal(buffer[17:36], 0)
    numpy.testing.assert_array_equal(buffer[36 + 22:72], 0)
    segment = layout.pack_all_gather(arrays, 1)
    numpy.testing.assert_array_equal(segment[15:], 0)


def test_duplicate_owners_are_placed_in_each_owners_segment():
    layout = packing.Layout([(5,)], ['float32'], [(2, 0)], [False], 3)
    assert layout.reduce_scatter_counts == (5, 0, 5)
    assert layout.all_gather_counts == (0, 0, 5)
    assert layout.reduce_scatter_nbytes == 2 * 5 * 4


def test_analytic_byte_counts():
    shapes = [(4, 4), (3, 5), (6, 6), (7,)]
    owners = [0, (1, 2), 2, (0, 1)]
    symmetric = [True, False, True, False]

    def layout(wire, sym=symmetric, pad=False):
        return packing.Layout(shapes, ['float32'] * 4, owners, sym, 3,
                              wire, pad=pad)

    # Wire elements: 10 + 2 * 15 + 21 + 2 * 7 = 75.
    assert layout('float32').reduce_scatter_nbytes == 75 * 4
    assert layout('float16').reduce_scatter_nbytes == 75 * 2
    assert [layout('float32').all_gather_nbytes(r) for r in range(3)] == \
        [17 * 4, 15 * 4, 21 * 4]
    # Unpacked: 16 + 2 * 15 + 36 + 2 * 7 = 96.
    assert layout('float32', sym=[False] * 4).reduce_scatter_nbytes == 96 * 4
    assert layout('float32', pad=True).reduce_scatter_nbytes == 3 * 36 * 4


def test_triangle_halves_a_large_factor():
    n = 256
    packed = packing.Layout([(n, n)], ['float32'], [0], [True], 2)
    full = packing.Layout([(n, n)], ['float32'], [0], [False], 2)
    assert packed.reduce_scatter_nbytes / full.reduce_scatter_nbytes == \
        pytest.approx((n + 1) / (2 * n))


@pytest.mark.parametrize('size', [1, 3])
def test_float16_wire(size):
    shapes, owners, symmetric = _random_problem(5, size)
    world = [_rank_arrays(shapes, symmetric, r) for r in range(size)]
    layout = packing.Layout(shapes, ['float32'] * len(shapes), owners,
                            symmetric, size, 'float16')
    assert layout.pack_reduce_scatter(world[0]).dtype == numpy.float16
    results = _simulate_reduce_scatter(layout, world)
    gathered = _simulate_all_gather(layout, world)
    for i, owner in enumerate(owners):
        owner = _owner_tuple(owner)
        expected = numpy.sum([arrays[i] for arrays in world], axis=0)
        got = results[owner[0]][i]
        assert got.dtype == numpy.float32
        numpy.testing.assert_allclose(got, expected, rtol=1e-2, atol=1e-2)
        assert gathered[i].dtype == numpy.float32
        numpy.testing.assert_allclose(gathered[i], world[owner[0]][i],
                                      rtol=1e-3, atol=1e-3)


def test_unpacking_casts_back_and_copies():
    layout = packing.Layout([(2, 2), (3,)], ['float64', 'float16'], [0, 0],
                            [True, False], 1, 'float32')
    arrays = [numpy.eye(2), numpy.ones(3, numpy.float16)]
    buffer = layout.pack_reduce_scatter(arrays)
    out = layout.unpack_reduce_scatter(buffer, 0)
    assert [a.dtype for a in out] == [numpy.float64, numpy.float16]
    assert not any(numpy.shares_memory(a, buffer) for a in out)
    gathered = layout.unpack_all_gather(buffer)
    assert not any(numpy.shares_memory(a, buffer) for a in gathered)


def test_layout_rejects_bad_input():
    def layout(shapes=((2, 2),), owners=(0,), symmetric=(False,), size=2):
        return packing.Layout(shapes, ['float32'] * len(shapes), owners,
                              symmetric, size)

    with pytest.raises(ValueError, match='outside'):
        layout(owners=[2])
    with pytest.raises(ValueError, match='twice'):
        layout(owners=[(1, 1)])
    with pytest.raises(ValueError, match='no owner'):
        layout(owners=[()])
    with pytest.raises(ValueError, match='symmetric'):
        layout(shapes=[(2, 3)], symmetric=[True])
    with pytest.raises(ValueError, match='one entry per array'):
        layout(owners=[0, 1])
    with pytest.raises(ValueError, match='shape'):
        layout().pack_reduce_scatter([numpy.zeros((3, 3), 'f')])


def test_gather_cast_twin_pads_with_zeros_and_casts():
    from chainerkfac.packing import gather_cast
    source = numpy.arange(5, dtype=numpy.float64) + 0.25
    index = numpy.array([4, -1, 0, 0, 2, -1], dtype=numpy.int64)
    out = gather_cast(source, index, numpy.float16)
    assert out.dtype == numpy.float16
    numpy.testing.assert_array_equal(
        out, numpy.array([4.25, 0, 0.25, 0.25, 2.25, 0], numpy.float16))
