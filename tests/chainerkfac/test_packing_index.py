"""The index maps of ``packing.Layout`` against the implementation they
replaced (kept here as the reference): every pack and unpack kind, with and
without padding, duplicated owners, ranks that own nothing, and triangles of
repeated and distinct sizes."""
import numpy
import pytest

from chainerkfac import packing
from tests.chainerkfac.test_packing import _random_problem


class ReferenceIndex(object):
    """The index maps as built before: ``numpy.indices`` over every
    symmetric matrix, one array at a time, int64."""

    def __init__(self, layout):
        self.layout = layout

    def wire_positions(self, i, base):
        shape = self.layout.shapes[i]
        if self.layout.symmetric[i]:
            n = shape[0]
            rows, cols = numpy.triu_indices(n)
            return base + rows * n + cols
        return base + numpy.arange(int(numpy.prod(shape)))

    def array_positions(self, i, base):
        shape = self.layout.shapes[i]
        if self.layout.symmetric[i]:
            n = shape[0]
            rows, cols = numpy.indices((n, n))
            low, high = numpy.minimum(rows, cols), numpy.maximum(rows, cols)
            return (base + low * n - low * (low - 1) // 2 + high - low
                    ).ravel()
        return base + numpy.arange(int(numpy.prod(shape)))

    def starts(self, indices):
        sizes = [int(numpy.prod(self.layout.shapes[i])) for i in indices]
        return dict(zip(indices, numpy.concatenate(
            [[0], numpy.cumsum(sizes)[:-1]]).astype(int))) if sizes else {}

    def build(self, kind, rank):
        lay = self.layout
        if kind == 'pack_rs':
            starts = self.starts(range(len(lay.shapes)))
            index = numpy.full(lay.reduce_scatter_size, -1, numpy.int64)
            for r in range(lay.size):
                for i, offset in lay._rs_slots[r]:
                    at = lay.reduce_scatter_offsets[r] + offset
                    index[at:at + lay.wire_lengths[i]] = \
                        self.wire_positions(i, starts[i])
            return index
        if kind == 'pack_ag':
            slots = lay._ag_slots[rank]
            starts = self.starts([i for i, _ in slots])
            index = numpy.full(lay.all_gather_counts[rank], -1, numpy.int64)
            for i, offset in slots:
                index[offset:offset + lay.wire_lengths[i]] = \
                    self.wire_positions(i, starts[i])
            return index
        if kind == 'unpack_rs':
            return _concat([self.array_positions(i, offset)
                            for i, offset in lay._rs_slots[rank]])
        base = {}
        for r in range(lay.size):
            for i, offset in lay._ag_slots[r]:
                base[i] = lay.all_gather_offsets[r] + offset
        return _concat([self.array_positions(i, base[i])
                        for i in range(len(lay.shapes))])


def _concat(parts):
    return (numpy.concatenate(parts).astype(numpy.int64) if parts
            else numpy.zeros(0, numpy.int64))


KINDS = [('pack_rs', False), ('unpack_rs', True), ('pack_ag', True),
         ('unpack_ag', False)]


def _layouts():
    for size in (1, 2, 3, 4):
        for seed in range(4):
            shapes, owners, symmetric = _random_problem(seed, size,
                                                        n_arrays=10)
            for pad in (False, True):
                yield packing.Layout(shapes, ['float32'] * len(shapes),
                                     owners, symmetric, size, pad=pad)
    # Rank 2 owns nothing; repeated triangle sizes; a 1x1 triangle.
    shapes = [(5, 5), (3,), (5, 5), (1, 1), (2, 3), (5, 5), (7, 7)]
    owners = [0, (1, 0), 1, 0, 3, (0, 1, 3), 3]
    for pad in (False, True):
        yield packing.Layout(shapes, ['float32', 'float64', 'float16',
                                      'float32', 'float64', 'float32',
                                      'float32'],
                             owners, [True, False, True, True, False, True,
                                      True], 4, wire_dtype='float16',
                             pad=pad)


@pytest.mark.parametrize('wide', [False, True], ids=['int32', 'int64'])
def test_index_maps_equal_the_reference_for_every_kind(wide, monkeypatch):
    if wide:  # as for sources of 2^31 elements or more: int64 maps filled
        # from int32 templates
        monkeypatch.setattr(packing, '_index_dtype',
                            lambda size: numpy.dtype(numpy.int64))
        for name in ('_wire_template', '_mirror_template'):
            template = getattr(packing, name)
            monkeypatch.setattr(packing, name, lambda n, t=template: t(
                n).astype(numpy.int32))
    checked = 0
    for layout in _layouts():
        reference = ReferenceIndex(layout)
        for kind, per_rank in KINDS:
            for rank in (range(layout.size) if per_rank else [None]):
                got = layout._build_index((kind, rank))
                expected = reference.build(kind, rank)
                assert got.dtype == (numpy.int64 if wide else numpy.int32)
                assert got.shape == expected.shape, (kind, rank)
                numpy.testing.assert_array_equal(got, expected)
                checked += 1
    assert checked > 200


@pytest.mark.parametrize('n', [1, 2, 3, 8, 31, 64, 65])
def test_templates_equal_the_direct_formulas(n):
    rows, cols = numpy.triu_indices(n)
    numpy.testing.assert_array_equal(packing._wire_template(n),
                                     rows * n + cols)
    r, c = numpy.indices((n, n))
    low, high = numpy.minimum(r, c), numpy.maximum(r, c)
    expected = low * n - low * (low - 1) // 2 + high - low
    numpy.testing.assert_array_equal(packing._mirror_template(n),
                                     expected.ravel())
    # The mirror template reads back what the wire template packed.
    m = numpy.arange(n * n).reshape(n, n)
    symmetric = numpy.triu(m) + numpy.triu(m, 1).T
    packed = symmetric.ravel()[packing._wire_template(n)]
    numpy.testing.assert_array_equal(
        packed[packing._mirror_template(n)].reshape(n, n), symmetric)


def test_index_dtype_widens_past_int32():
    limit = numpy.iinfo(numpy.int32).max
    assert packing._index_dtype(limit - 1) == numpy.int32
    assert packing._index_dtype(limit) == numpy.int64
    assert packing._index_dtype(10 ** 10) == numpy.int64


def test_numpy_path_equals_the_index_map_gather():
    """On the CPU, packing and unpacking go array by array (no
    layout-sized maps); the GPU gathers through the maps in one kernel.
    Both give the same buffers and arrays, for every layout kind."""
    rng = numpy.random.RandomState(5)
    checked = 0
    for layout in _layouts():
        arrays = []
        for shape, sym, dtype in zip(layout.shapes, layout.symmetric,
                                     layout.dtypes):
            a = numpy.asarray(rng.randn(*shape))
            arrays.append(((a + a.T) if sym else a).astype(dtype))
        source = numpy.concatenate([a.ravel() for a in arrays])
        expected = packing.gather_cast(
            source, layout._build_index(('pack_rs', None)),
            layout.wire_dtype)
        got = layout.pack_reduce_scatter(arrays)
        assert got.dtype == expected.dtype
        numpy.testing.assert_array_equal(got, expected)
        for rank in range(layout.size):
            owned = [i for i, _ in layout._rs_slots[rank]]
            segment = got[layout.reduce_scatter_offsets[rank]:][
                :layout.reduce_scatter_counts[rank]]
            unpacked = layout.unpack_reduce_scatter(segment, rank)
            if owned:
                flat = packing.gather_cast(
                    segment, layout._build_index(('unpack_rs', rank)),
                    numpy.result_type(*[layout.dtypes[i] for i in owned]))
                split = layout._split(flat, owned)
                for i in owned:
                    assert unpacked[i].dtype == layout.dtypes[i]
                    numpy.testing.assert_array_equal(unpacked[i], split[i])
            assert all(unpacked[i] is None for i in range(len(arrays))
                       if i not in owned)
            mine = [i for i, _ in layout._ag_slots[rank]]
            sent = layout.pack_all_gather(arrays, rank)
            if mine:
                numpy.testing.assert_array_equal(sent, packing.gather_cast(
                    numpy.concatenate([arrays[i].ravel() for i in mine]),
                    layout._build_index(('pack_ag', rank)),
                    layout.wire_dtype))
            checked += 1
        gathered = numpy.concatenate([
            layout.pack_all_gather(arrays, r) for r in range(layout.size)])
        flat = packing.gather_cast(gathered,
                                   layout._build_index(('unpack_ag', None)),
                                   numpy.result_type(*layout.dtypes))
        split = layout._split(flat, range(len(arrays)))
        for i, array in enumerate(layout.unpack_all_gather(gathered)):
            numpy.testing.assert_array_equal(array, split[i])
    assert checked > 50
