"""``inverse_method='cholesky_solve'``: the damped factors' Cholesky factors
kept, stage 5 solving with them, against fp64 formed inverses (the
oracle) and the ``'cholesky'`` route's steps."""
import chainer
import numpy
import pytest

from chainerkfac import linalg
from chainerkfac import low_rank

from tests.chainerkfac import helpers
from tests.chainerkfac.test_linalg import _problem_factors, spd


def relative(a, b):
    return numpy.abs(a - b).max() / numpy.abs(b).max()


@pytest.mark.parametrize('dtype,tol', [(numpy.float64, 1e-12),
                                       (numpy.float32, 2e-5)])
def test_left_and_right_equal_the_formed_inverse(dtype, tol):
    """F⁻¹ M, M F⁻¹ and F⁻¹ v by two triangular solves against the fp64
    inverse of F = M₀ + d I (κ ≈ 1e3: fp32 keeps ~1e-4 · κ-free digits
    in the solves' backward error, 2e-5 leaves room)."""
    matrix, damping = spd(40, seed=3).astype(dtype), 1e-2
    result = linalg.damped_inverses([matrix], [damping],
                                    method='cholesky_solve')[0]
    assert isinstance(result.inverse, linalg.CholeskyInverse)
    assert (result.retries, result.damping) == (0, damping)
    exact = numpy.linalg.inv(matrix.astype(numpy.float64) +
                             damping * numpy.eye(40))
    rng = numpy.random.RandomState(0)
    left, right = rng.randn(40, 7).astype(dtype), rng.randn(5, 40)
    right = right.astype(dtype)
    got = low_rank.left_multiply(result.inverse, left)
    assert got.dtype == dtype and got.shape == (40, 7)
    assert relative(got, exact.dot(left)) < tol
    got = low_rank.right_multiply(right, result.inverse)
    assert got.dtype == dtype and got.shape == (5, 40)
    assert relative(got, right.dot(exact)) < tol
    assert relative(result.inverse.dense(), exact) < tol
    # a half-precision right-hand side is solved in the factor's dtype
    half = left.astype(numpy.float16)
    got = low_rank.left_multiply(result.inverse, half)
    assert got.dtype == numpy.float16
    assert relative(got.astype(numpy.float64),
                    exact.dot(half.astype(numpy.float64))) < 2e-3


def test_problem_factors_get_the_retries_and_dampings_of_cholesky():
    """−I, indefinite diagonals, NaN, Inf, BN diagonals, fp32 and fp64 mixed:
    the same retries, dampings and None as by formed inverses; the
    factors' inverses equal theirs; diagonals stay 1-D arrays."""
    pairs = _problem_factors()
    matrices, dampings = [m for m, _ in pairs], [d for _, d in pairs]
    solved = linalg.damped_inverses(matrices, dampings,
                                    method='cholesky_solve')
    formed = linalg.damped_inverses(matrices, dampings)
    for matrix, got, expected in zip(matrices, solved, formed):
        assert (got.retries, got.damping) == (expected.retries,
                                              expected.damping)
        if expected.inverse is None:
            assert got.inverse is None
            continue
        if matrix.ndim == 1:
            numpy.testing.assert_array_equal(got.inverse, expected.inverse)
            continue
        assert isinstance(got.inverse, linalg.CholeskyInverse)
        assert got.inverse.dtype == expected.inverse.dtype
        tol = 1e-12 if expected.inverse.dtype == numpy.float64 else 1e-5
        assert relative(got.inverse.dense(), expected.inverse) < tol


def test_refused_on_anything_but_numpy_arrays(monkeypatch):
    optimizer = helpers.kfac(inverse_method='cholesky_solve')
    model = helpers.MLP()
    optimizer.setup(model)

    class DeviceArray:
        """Stands in for a parameter on a GPU."""
    monkeypatch.setattr(optimizer, '_like', lambda: DeviceArray())
    x, t = helpers.data(n=4, shape=(5,), n_class=3)
    with pytest.raises(ValueError, match="'cholesky_solve'.*CPU only"):
        optimizer.update(helpers.loss_of(model), x, t)


def _train(method, steps, **options):
    x, t = helpers.data(n=8)
    model = helpers.ConvNet(bn=True)
    for k, (_, param) in enumerate(sorted(model.namedparams())):
        param.array[...] = numpy.random.RandomState(k).randn(
            *param.shape) * 0.3
    optimizer = helpers.kfac(inverse_method=method, lr=0.1, **options)
    optimizer.setup(model)
    for _ in range(steps):
        optimizer.update(helpers.loss_of(model), x, t)
    return model, optimizer


@pytest.mark.parametrize('options', [
    {},
    {'refresh_interval_a': 2, 'refresh_interval_g': 3,
     'refresh_interval_f': 2},
    {'low_rank': True, 'kl_clip': 1e-3},
    {'bn_fisher': 'diag', 'max_factor_dim': 20},
], ids=['every-step', 'stale', 'low-rank-bounded', 'diagonals'])
def test_kfac_steps_equal_the_formed_inverses(options):
    """Six float64 K-FAC steps of a conv + BN + linear model: the weights
    of either route agree to 1e-12 (each step's preconditioned gradient
    differs by rounding only: ≈ κ · 1e-16)."""
    solved, optimizer = _train('cholesky_solve', 6, **options)
    formed, _ = _train('cholesky', 6, **options)
    kinds = {type(inverse).__name__ for block in optimizer.blocks
             for inverse in block.inverses.values()}
    assert 'CholeskyInverse' in kinds
    for (name, mine), (_, theirs) in zip(sorted(solved.namedparams()),
                                         sorted(formed.namedparams())):
        numpy.testing.assert_allclose(mine.array, theirs.array, rtol=0,
                                      atol=1e-12 * abs(theirs.array).max(),
                                      err_msg=name)


def test_a_restored_run_goes_on_to_the_bit(tmp_path):
    """A snapshot taken between refreshes: its inverses are restored as
    Cholesky factors again, and the run goes on as the uninterrupted one,
    bit for bit."""
    options = {'refresh_interval_a': 3, 'refresh_interval_g': 3,
               'refresh_interval_f': 3}
    x, t = helpers.data(n=8)
    model, optimizer = _train('cholesky_solve', 4, **options)
    chainer.serializers.save_npz(str(tmp_path / 'o.npz'), optimizer)
    chainer.serializers.save_npz(str(tmp_path / 'm.npz'), model)
    for _ in range(4):
        optimizer.update(helpers.loss_of(model), x, t)

    resumed = helpers.ConvNet(bn=True)
    fresh = helpers.kfac(inverse_method='cholesky_solve', lr=0.1, **options)
    fresh.setup(resumed)
    chainer.serializers.load_npz(str(tmp_path / 'o.npz'), fresh)
    chainer.serializers.load_npz(str(tmp_path / 'm.npz'), resumed)
    for _ in range(4):
        fresh.update(helpers.loss_of(resumed), x, t)
    assert any(isinstance(inverse, linalg.CholeskyInverse)
               for block in fresh.blocks
               for inverse in block.inverses.values())
    for (name, mine), (_, theirs) in zip(sorted(resumed.namedparams()),
                                         sorted(model.namedparams())):
        numpy.testing.assert_array_equal(mine.array, theirs.array,
                                         err_msg=name)


def test_a_refill_keeps_the_arrays():
    """As a formed inverse and a Woodbury one: a refreshed Cholesky factor
    goes into its predecessor's array where it can."""
    first = linalg.damped_inverses([spd(6, seed=1)], [1e-2],
                                   method='cholesky_solve')[0].inverse
    array = first.upper
    second = linalg.damped_inverses([spd(6, seed=2)], [1e-2],
                                    method='cholesky_solve')[0].inverse
    kept = low_rank.refilled(first, second)
    assert kept is first and kept.upper is array
    numpy.testing.assert_array_equal(array, second.upper)
    assert low_rank.inverse_arrays(kept) == [array]
    other = linalg.damped_inverses([spd(7, seed=2)], [1e-2],
                                   method='cholesky_solve')[0].inverse
    assert low_rank.refilled(first, other) is other
