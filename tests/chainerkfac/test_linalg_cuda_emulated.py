"""``linalg.damped_inverses`` through linalg_cuda on the CPU, against the
emulated CuPy, cuSOLVER and cuBLAS of tests/chainerkfac/cuda_emulation.py:
the same results, retries and dampings as the per-factor reference, with
potri and with its potrs stand-in, with and without the batches of
equal-size factors (potrfBatched + trsmBatched), every factor on a worker
stream. The real GPU runs in tests/gpu."""
import collections
import sys

import numpy
import pytest

from chainerkfac import dtypes, linalg
from chainerkfac import linalg_cuda
from tests.chainerkfac import cuda_emulation
from tests.chainerkfac.test_linalg import _problem_factors, _reference_inverse
from tests.gpu import support

pytestmark = pytest.mark.skipif(
    support.SKIP_REASON is None,
    reason='a GPU is here: tests/gpu runs linalg_cuda for real')


@pytest.fixture
def emulated(monkeypatch):
    modules = cuda_emulation.modules()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    # damped_inverses takes the emulated arrays for CuPy arrays.
    monkeypatch.setattr(linalg, 'get_array_module',
                        lambda *arrays: modules['cupy'])
    for cached in (linalg_cuda._workers, linalg_cuda._kernels):
        cached.cache_clear()
    monkeypatch.setattr(linalg_cuda, '_LWORK', {})
    cuda_emulation.CALLS.clear()
    yield
    for cached in (linalg_cuda._workers, linalg_cuda._kernels):
        cached.cache_clear()


#: Of the largest entry: the error measured against the reference is at
#: most 1.1e-7 (float32) and 4.0e-16 (float64) of it; ten times that.
TOLERANCE = {numpy.float32: 1e-6, numpy.float64: 4e-15}


def _factors():
    factors = _problem_factors()
    rng = numpy.random.RandomState(0)
    for n in (1, 5, 33, 64, 64, 7, 100):
        m = rng.randn(n, 2 * n)
        factors.append(((m.dot(m.T) / (2 * n)).astype(numpy.float32), 1e-2))
    factors.append((numpy.abs(rng.randn(9)), 1e-3))
    return factors


@pytest.mark.parametrize('batched', [False, True],
                         ids=['per-factor', 'batched'])
@pytest.mark.parametrize('potri', [True, False], ids=['potri', 'potrs'])
def test_emulated_gpu_path_equals_the_reference(potri, batched, emulated,
                                                monkeypatch):
    monkeypatch.setattr(linalg_cuda, '_raw_potri',
                        cuda_emulation.raw_potri if potri else lambda: None)
    monkeypatch.setattr(linalg_cuda, 'BATCHED_MAX_DIM',
                        64 if batched else 0)
    factors = _factors()
    results = linalg.damped_inverses(
        [cuda_emulation.array(m) for m, _ in factors],
        [d for _, d in factors])
    for (matrix, damping), (inverse, used, retries) in zip(factors,
                                                          results):
        expected, expected_damping, expected_retries = _reference_inverse(
            matrix, damping)
        assert (retries, used) == (expected_retries, expected_damping)
        if expected is None:
            assert inverse is None
            continue
        inverse = numpy.asarray(inverse)
        assert inverse.dtype == expected.dtype
        numpy.testing.assert_allclose(
            inverse, expected, rtol=0,
            atol=TOLERANCE[expected.dtype.type] * abs(expected).max())
        if matrix.ndim == 2:
            numpy.testing.assert_array_equal(inverse, inverse.T)
    calls = [c for c in cuda_emulation.CALLS if c[0] != 'trsmBatched']
    used = {(handle, stream) for call, handle, stream in calls}
    batch = {'potrfBatched'} if batched else set()
    assert {call for call, _, _ in calls} == batch | (
        {'potrf', 'potri'} if potri else {'potrf', 'potrs'})
    # the sizes of two or more factors up to 64 go as one batch each: one
    # potrfBatched and two trsmBatched per size and try
    sizes = [(m.shape[0], linalg.inverse_dtype(m.dtype)) for m, _ in factors
             if m.ndim == 2 and m.shape[0] <= 64]
    groups = {key for key in sizes if sizes.count(key) > 1}
    counts = collections.Counter(c[0] for c in cuda_emulation.CALLS)
    if batched:
        assert len(groups) >= 2 and counts['potrfBatched'] >= len(groups)
    else:
        assert counts['potrfBatched'] == 0
    assert counts['trsmBatched'] == 2 * counts['potrfBatched']
    # One cuSOLVER handle per stream, several streams, every stream a
    # worker's (never the main one).
    assert len(used) == len({s for _, s in used})
    assert 1 < len(used) <= linalg_cuda.N_STREAMS
    assert cuda_emulation._STACK[0].ptr not in {s for _, s in used}


@pytest.mark.parametrize('route', linalg_cuda.CHOLESKY_INVERSES)
def test_cholesky_inverse_route_is_chosen(route, emulated, monkeypatch):
    """``CHOLESKY_INVERSE`` picks potri or potrs for the lone factors
    (potri bound either way), with the same results; an unknown route is
    an error naming the setting."""
    monkeypatch.setattr(linalg_cuda, '_raw_potri', cuda_emulation.raw_potri)
    monkeypatch.setattr(linalg_cuda, 'BATCHED_MAX_DIM', 0)
    monkeypatch.setattr(linalg_cuda, 'CHOLESKY_INVERSE', route)
    factors = _factors()
    results = linalg.damped_inverses(
        [cuda_emulation.array(m) for m, _ in factors],
        [d for _, d in factors])
    for (matrix, damping), (inverse, used, _) in zip(factors, results):
        expected, expected_damping, _ = _reference_inverse(matrix, damping)
        assert used == expected_damping
        if expected is not None:
            numpy.testing.assert_allclose(
                numpy.asarray(inverse), expected, rtol=0,
                atol=TOLERANCE[expected.dtype.type] * abs(expected).max())
    calls = {c[0] for c in cuda_emulation.CALLS}
    # 'auto' without chainer.config.autotune: potri
    assert calls == {'potrf', 'potri' if route == 'auto' else route}
    monkeypatch.setattr(linalg_cuda, 'CHOLESKY_INVERSE', 'lu')
    with pytest.raises(ValueError, match='CHOLESKY_INVERSE must be one of'):
        linalg.damped_inverses([cuda_emulation.array(factors[-2][0])], [0.1])


def _scripted_timing(monkeypatch, seconds):
    """``linalg_cuda._timed`` with the seconds of ``seconds[route]`` for a
    run whose last cuSOLVER call was that route's (no clock here)."""
    timed = []

    def fake(xp, run):
        before = len(cuda_emulation.CALLS)
        result = run()
        route = cuda_emulation.CALLS[-1][0]
        assert route in ('potri', 'potrs')
        assert before < len(cuda_emulation.CALLS)
        timed.append(route)
        return result, seconds[route](result.shape[0])
    monkeypatch.setattr(linalg_cuda, '_timed', fake)
    return timed


@pytest.mark.parametrize('faster', ['potri', 'potrs'])
def test_auto_route_times_each_size_once_and_keeps_the_faster(
        faster, emulated, monkeypatch):
    """Under autotune, ``'auto'`` inverts the first lone factor of each
    size both ways (timed), keeps the faster for that size, and uses it
    from then on: later tries time nothing. The inverses are the
    reference's either way."""
    import chainer
    monkeypatch.setattr(linalg_cuda, '_raw_potri', cuda_emulation.raw_potri)
    monkeypatch.setattr(linalg_cuda, 'BATCHED_MAX_DIM', 0)
    monkeypatch.setattr(linalg_cuda, 'CHOLESKY_INVERSE', 'auto')
    monkeypatch.setattr(linalg_cuda, '_TIMED_ROUTES', {})
    slower = 'potrs' if faster == 'potri' else 'potri'
    timed = _scripted_timing(monkeypatch, {faster: lambda n: 1.0,
                                           slower: lambda n: 2.0})
    factors = [(m, d) for m, d in _factors() if m.ndim == 2]
    sizes = {(m.shape[0], dtypes.inverse_dtype(m.dtype).name)
             for m, _ in factors}
    with chainer.using_config('autotune', True):
        for repeat in range(2):
            cuda_emulation.CALLS.clear()
            results = linalg.damped_inverses(
                [cuda_emulation.array(m) for m, _ in factors],
                [d for _, d in factors])
            for (matrix, damping), (inverse, used, _) in zip(factors,
                                                             results):
                expected, expected_damping, _ = _reference_inverse(matrix,
                                                                   damping)
                assert used == expected_damping
                if expected is not None:
                    numpy.testing.assert_allclose(
                        numpy.asarray(inverse), expected, rtol=0,
                        atol=TOLERANCE[expected.dtype.type] *
                        abs(expected).max())
            # each size and dtype timed once, both ways, on the first
            # call (retries included); nothing on the second
            assert len(timed) == 2 * len(sizes)
            assert timed.count('potri') == timed.count('potrs')
            if repeat == 1:
                assert {c[0] for c in cuda_emulation.CALLS} == {'potrf',
                                                                faster}
    chosen = linalg_cuda.timed_routes()
    assert {(n, dtype) for n, dtype, _ in chosen} == sizes
    assert set(chosen.values()) == {faster}


def test_auto_route_keeps_potri_where_the_ways_disagree(emulated,
                                                        monkeypatch,
                                                        caplog):
    """A potrs whose inverse is not potri's (a wrong binding, a broken
    library) is not chosen however fast, and the reason is logged."""
    import chainer
    import logging
    monkeypatch.setattr(linalg_cuda, '_raw_potri', cuda_emulation.raw_potri)
    monkeypatch.setattr(linalg_cuda, 'BATCHED_MAX_DIM', 0)
    monkeypatch.setattr(linalg_cuda, 'CHOLESKY_INVERSE', 'auto')
    monkeypatch.setattr(linalg_cuda, '_TIMED_ROUTES', {})
    def timed(xp, run):
        result = run()
        if cuda_emulation.CALLS[-1][0] == 'potrs':
            result = result * 1.01           # not the inverse
            return result, 0.5
        return result, 1.0
    monkeypatch.setattr(linalg_cuda, '_timed', timed)
    rng = numpy.random.RandomState(3)
    m = rng.randn(20, 40)
    matrix = (m.dot(m.T) / 40).astype(numpy.float32)
    with chainer.using_config('autotune', True), \
            caplog.at_level(logging.WARNING):
        [(inverse, used, _)] = linalg.damped_inverses(
            [cuda_emulation.array(matrix)], [1e-2])
    assert 'potri is kept' in caplog.text
    assert linalg_cuda.timed_routes() == {(20, 'float32', 0): 'potri'}
    expected, _, _ = _reference_inverse(matrix, 1e-2)
    numpy.testing.assert_allclose(numpy.asarray(inverse), expected, rtol=0,
                                  atol=1e-6 * abs(expected).max())


def test_potri_check_accepts_a_correct_potri(emulated):
    assert linalg_cuda._check_potri(cuda_emulation.raw_potri()) is None


def test_potri_check_rejects_a_wrong_triangle(emulated):
    functions = cuda_emulation.raw_potri()
    right = functions['spotri']

    def upper_only(handle, uplo, n, a, lda, work, lwork, info):
        status = right(handle, uplo, n, a, lda, work, lwork, info)
        matrix = cuda_emulation._column_major(a, n, numpy.float32)
        matrix[numpy.tril_indices(n, -1)] = 0.0   # lower triangle lost
        return status
    functions['spotri'] = upper_only
    assert 'differs' in linalg_cuda._check_potri(functions)
