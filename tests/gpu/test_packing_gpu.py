"""The gather-and-cast kernel against its NumPy twin: every pack and unpack
kind of a layout (triangles, padding, duplicated owners, empty segments,
mixed array dtypes, every wire dtype), and the index maps built on the
device against those built on the host."""
import itertools

import numpy
import pytest

from chainerkfac import packing
from tests.chainerkfac.test_packing import _random_problem
from tests.chainerkfac.test_packing_index import KINDS, _layouts
from tests.gpu import support

pytestmark = support.MARKS

DTYPES = ('float16', 'float32', 'float64')


def _mixed_layouts():
    """Every wire dtype with arrays of every dtype, padded or not."""
    for wire, pad, size in itertools.product(DTYPES, (False, True),
                                             (1, 2, 3)):
        shapes, owners, symmetric = _random_problem(size + 7, size,
                                                    n_arrays=9)
        dtypes = [DTYPES[k % 3] for k in range(len(shapes))]
        yield packing.Layout(shapes, dtypes, owners, symmetric, size,
                             wire_dtype=wire, pad=pad)


def _all_layouts():
    return list(_layouts()) + list(_mixed_layouts())


def _arrays(layout, seed):
    rng = numpy.random.RandomState(seed)
    arrays = []
    for shape, dtype, sym in zip(layout.shapes, layout.dtypes,
                                 layout.symmetric):
        a = numpy.asarray(rng.randn(*shape) * 10)
        if sym:
            a = a + a.T
        arrays.append(a.astype(dtype))
    return arrays


def _assert_same(got, expected, what, from_float64_to_half=False):
    """Exact, but for a float64 → float16 cast: CUDA's half conversion may
    round through float32 (double rounding), one fp16 ulp at most."""
    if expected is None:
        assert got is None, what
        return
    assert support.is_cupy(got), what
    got = support.to_cpu(got)
    assert got.dtype == expected.dtype and got.shape == expected.shape, what
    if from_float64_to_half:
        numpy.testing.assert_allclose(got, expected, rtol=2.0 ** -10,
                                      atol=2.0 ** -24, err_msg=str(what))
    else:
        numpy.testing.assert_array_equal(got, expected, err_msg=str(what))


def test_pack_and_unpack_equal_the_numpy_twin():
    checked = 0
    for n, layout in enumerate(_all_layouts()):
        # Where a float64 → float16 cast happens (packing or unpacking).
        pack_rounds_twice = layout.wire_dtype == numpy.float16 and any(
            d == numpy.float64 for d in layout.dtypes)
        unpack_rounds_twice = layout.wire_dtype == numpy.float64 and any(
            d == numpy.float16 for d in layout.dtypes)
        for rank in range(layout.size):
            arrays = _arrays(layout, 100 * n + rank)
            gpu_arrays = [support.to_gpu(a) for a in arrays]
            what = (n, rank, layout.wire_dtype.name, layout.pad)
            _assert_same(layout.pack_reduce_scatter(gpu_arrays),
                         layout.pack_reduce_scatter(arrays),
                         what + ('pack_rs',), pack_rounds_twice)
            _assert_same(layout.pack_all_gather(gpu_arrays, rank),
                         layout.pack_all_gather(arrays, rank),
                         what + ('pack_ag',), pack_rounds_twice)
            rng = numpy.random.RandomState(n + 7 * rank)
            segment = rng.randn(layout.reduce_scatter_counts[rank]).astype(
                layout.wire_dtype)
            for got, expected in zip(
                    layout.unpack_reduce_scatter(support.to_gpu(segment),
                                                 rank),
                    layout.unpack_reduce_scatter(segment, rank)):
                _assert_same(got, expected, what + ('unpack_rs',),
                             unpack_rounds_twice)
            buffer = rng.randn(layout.all_gather_size).astype(
                layout.wire_dtype)
            for got, expected in zip(
                    layout.unpack_all_gather(support.to_gpu(buffer)),
                    layout.unpack_all_gather(buffer)):
                _assert_same(got, expected, what + ('unpack_ag',),
                             unpack_rounds_twice)
            checked += 1
    assert checked > 50


def test_index_maps_built_on_the_device_equal_the_host_ones():
    import cupy
    for layout in _all_layouts():
        for kind, per_rank in KINDS:
            for rank in (range(layout.size) if per_rank else [None]):
                on_device = layout._index(cupy, kind, rank)
                on_host = layout._build_index((kind, rank))
                assert support.is_cupy(on_device)
                assert on_device.dtype == on_host.dtype
                numpy.testing.assert_array_equal(support.to_cpu(on_device),
                                                 on_host)


@pytest.mark.parametrize('index_dtype', [numpy.int32, numpy.int64])
@pytest.mark.parametrize('source_dtype,out_dtype', [
    ('float64', 'float32'), ('float32', 'float16'), ('float16', 'float64'),
    ('float32', 'float32')])
def test_gather_cast_kernel_pads_with_zeros_and_casts(index_dtype,
                                                      source_dtype,
                                                      out_dtype):
    rng = numpy.random.RandomState(0)
    source = (rng.randn(1000) * 100).astype(source_dtype)
    index = rng.randint(-1, 1000, size=5000).astype(index_dtype)
    expected = packing.gather_cast(source, index, out_dtype)
    got = packing.gather_cast(support.to_gpu(source), support.to_gpu(index),
                              out_dtype)
    _assert_same(got, expected, (index_dtype, source_dtype, out_dtype))
    assert (support.to_cpu(got)[index < 0] == 0).all()
