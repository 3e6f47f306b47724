"""The Newton–Schulz inverse stage, against fp64 Cholesky (the oracle)."""
import math

import numpy
import pytest

from chainerkfac import linalg
from chainerkfac import newton_schulz
from chainerkfac.optimizers import options

from tests.chainerkfac import helpers


def gram_factor(n, samples, seed, spread=2.0):
    """A K-FAC-like factor: the Gram matrix of ``samples`` rows whose
    columns' scales span ``10^±spread`` (rank-deficient when samples < n),
    with its damping; κ = u / d reaches 1e5-1e6."""
    rng = numpy.random.RandomState(seed)
    scales = 10.0 ** rng.uniform(-spread, spread, size=n)
    rows = rng.randn(samples, n) * scales
    factor = rows.T.dot(rows) / samples
    damping = 1e-2 * numpy.sqrt(numpy.trace(factor) / n)
    return factor, damping


def factors(dtype):
    """Twelve factors of six sizes, half of them rank-deficient."""
    out = []
    for k, n in enumerate((3, 16, 40, 64, 100, 129)):
        for samples in (n // 2 + 1, 3 * n):
            factor, damping = gram_factor(n, samples, seed=10 * k + samples)
            out.append((factor.astype(dtype), damping))
    return out


def relative(a, b):
    return numpy.linalg.norm(a - b) / numpy.linalg.norm(b)


def oracle(matrix, damping):
    return linalg.damped_inverse(matrix.astype(numpy.float64),
                                 damping).inverse


def test_steps_follow_the_bound():
    """k steps bring e^(2^(k−1)) below ε (the last step is the check) and
    one fewer would not: e = (u − d) / (u + d)."""
    for upper, damping in [(2.0, 1.0), (10.0, 1e-2), (3e3, 1e-3),
                           (1e4, 1e-3)]:
        for dtype in (numpy.float32, numpy.float64):
            steps = newton_schulz.steps_needed(upper, damping, dtype)
            e = (upper - damping) / (upper + damping)
            eps = numpy.finfo(dtype).eps
            assert e ** (2 ** (steps - 1)) <= eps
            assert steps == 1 or e ** (2 ** (steps - 2)) > eps
    assert newton_schulz.steps_needed(1.0, 1.0, numpy.float32) == 1
    assert newton_schulz.steps_needed(math.inf, 1.0, numpy.float32) is None
    assert newton_schulz.steps_needed(1.0, 0.0, numpy.float32) is None
    # κ = 1e16: more than MAX_STEPS.
    assert newton_schulz.steps_needed(1e14, 1e-2, numpy.float64) is None


@pytest.mark.parametrize('dtype', [numpy.float64, numpy.float32])
def test_matches_cholesky_on_ill_conditioned_factors(dtype):
    pairs = factors(dtype)
    matrices, dampings = zip(*pairs)
    ns = linalg.damped_inverses(matrices, dampings, method='newton_schulz')
    cholesky = linalg.damped_inverses(matrices, dampings)
    for (matrix, damping), got, chol in zip(pairs, ns, cholesky):
        exact = oracle(matrix, damping)
        assert got.retries == 0 and got.damping == damping
        assert got.inverse.dtype == dtype
        numpy.testing.assert_array_equal(got.inverse, got.inverse.T)
        error = relative(got.inverse, exact)
        if dtype == numpy.float64:
            assert error < 1e-9
        else:
            # As close to the truth as fp32 Cholesky is (within 2x).
            assert error < max(2 * relative(chol.inverse, exact), 1e-5)


@pytest.mark.parametrize('dtype', [numpy.float64, numpy.float32])
def test_the_iteration_itself_settles_these_factors(dtype):
    """No fallback: every factor above is accepted by the iteration."""
    pairs = factors(dtype)
    calls = []

    def fallback(matrices, dampings, check_input):
        calls.append(len(matrices))
        return [(True, None)] * len(matrices)

    outcomes = newton_schulz.attempt([m for m, _ in pairs],
                                     [d for _, d in pairs], True, fallback)
    assert calls == []
    assert all(finite and inverse is not None
               for finite, inverse in outcomes)


def test_real_factors_of_a_model():
    """The factors of a conv + BN + FC model after two K-FAC steps, in
    fp32, against fp64 Cholesky."""
    model = helpers.ConvNet(in_ch=3, out_ch=8, bn=True, size=8)
    optimizer = helpers.kfac(max_factor_dim=None, low_rank=False)
    optimizer.setup(model)
    x, t = helpers.data(n=16, shape=(3, 8, 8))
    for _ in range(2):
        optimizer.update(helpers.loss_of(model), x, t)
    requests = []
    for block in optimizer.blocks:
        damping = optimizer.damping * block.damping_scale(optimizer.rho_bn)
        requests += [(m.astype(numpy.float32), d) for m, d in
                     block.inverse_requests(block.factors, damping).values()]
    assert {m.shape[0] for m, _ in requests} >= {28, 16, 129, 4}
    results = linalg.damped_inverses([m for m, _ in requests],
                                     [d for _, d in requests],
                                     method='newton_schulz')
    for (matrix, damping), result in zip(requests, results):
        assert relative(result.inverse, oracle(matrix, damping)) < 1e-5


def test_an_unsettled_factor_goes_to_cholesky():
    """A factor whose smallest eigenvalue lies below the damping's bound
    (M indefinite: λ_min(M) = −0.99 d) converges too slowly for the step
    count: the last correction is large, and Cholesky decides for it, so
    its result is Cholesky's, bit for bit. (Alone in its group: a group
    runs the most steps any member needs, which would settle it.)"""
    n, damping = 20, 1e-2
    rng = numpy.random.RandomState(3)
    basis, _ = numpy.linalg.qr(rng.randn(n, n))
    eigenvalues = numpy.concatenate([[-0.99 * damping],
                                     numpy.linspace(0.5, 5.0, n - 1)])
    matrix = (basis * eigenvalues).dot(basis.T)
    matrix = (matrix + matrix.T) / 2
    good, good_damping = gram_factor(n + 1, 3 * n, seed=1)
    ns = linalg.damped_inverses([matrix, good], [damping, good_damping],
                                method='newton_schulz')
    cholesky = linalg.damped_inverses([matrix, good],
                                      [damping, good_damping])
    numpy.testing.assert_array_equal(ns[0].inverse, cholesky[0].inverse)
    assert not numpy.array_equal(ns[1].inverse, cholesky[1].inverse)
    assert relative(ns[1].inverse, cholesky[1].inverse) < 1e-9


def test_not_positive_definite_raises_the_damping_as_cholesky_does():
    matrix = -numpy.eye(4) * 3.0
    result = linalg.damped_inverse(matrix, 1e-2)
    ns = linalg.damped_inverses([matrix], [1e-2],
                                method='newton_schulz')[0]
    assert (ns.retries, ns.damping) == (result.retries, result.damping)
    numpy.testing.assert_allclose(ns.inverse, numpy.eye(4) / 7.0)


def test_non_finite_input_is_reported_not_inverted():
    matrix, damping = gram_factor(5, 10, seed=2)
    matrix[1, 2] = numpy.nan
    result = linalg.damped_inverses([matrix], [damping],
                                    method='newton_schulz')[0]
    assert result.inverse is None
    assert result.retries == linalg.MAX_INVERSE_TRIES
    assert result.damping == damping


def test_problem_factors_as_cholesky_handles_them():
    """−I, an indefinite diagonal, NaN, Inf, BN diagonals, fp32 and fp64
    mixed: the same retries, dampings and inverses as by Cholesky."""
    from tests.chainerkfac.test_linalg import _problem_factors
    pairs = _problem_factors()
    matrices, dampings = [m for m, _ in pairs], [d for _, d in pairs]
    ns = linalg.damped_inverses(matrices, dampings, method='newton_schulz')
    cholesky = linalg.damped_inverses(matrices, dampings)
    for got, expected in zip(ns, cholesky):
        assert (got.retries, got.damping) == (expected.retries,
                                              expected.damping)
        if expected.inverse is None:
            assert got.inverse is None
            continue
        tol = 1e-10 if expected.inverse.dtype == numpy.float64 else 1e-5
        numpy.testing.assert_allclose(
            got.inverse, expected.inverse, rtol=tol,
            atol=tol * abs(expected.inverse).max())


def test_groups_keep_the_order_and_leave_the_rest_to_cholesky():
    """Sizes, dtypes and diagonals mixed in one call: the factors up to
    ``max_dim`` are stacked by (size, inverse dtype); diagonals and larger
    factors go to the fallback; every result lands at its own index."""
    entries = [
        gram_factor(5, 12, seed=0),
        (numpy.abs(numpy.random.RandomState(1).randn(6)) + 0.1, 0.5),
        (gram_factor(7, 20, seed=2)[0].astype(numpy.float32), 0.3),
        gram_factor(5, 4, seed=3),
        (gram_factor(5, 9, seed=4)[0].astype(numpy.float16), 0.2),
        gram_factor(9, 30, seed=5),
    ]
    matrices = [m for m, _ in entries]
    dampings = [d for _, d in entries]
    sent = []

    def fallback(subset, subset_dampings, check_input):
        sent.extend(id(m) for m in subset)
        return [(True, 'cholesky')] * len(subset)

    outcomes = newton_schulz.attempt(matrices, dampings, True, fallback,
                                     max_dim=7)
    # The diagonal and the 9×9 factor (above max_dim) only.
    assert sent == [id(matrices[1]), id(matrices[5])]
    for k in (0, 2, 3, 4):
        finite, inverse = outcomes[k]
        assert finite
        expected = oracle(matrices[k], dampings[k])
        tolerance = 1e-9 if matrices[k].dtype == numpy.float64 else 1e-4
        assert relative(inverse, expected) < tolerance
        assert inverse.dtype == linalg.inverse_dtype(matrices[k].dtype)
    assert outcomes[1] == (True, 'cholesky')
    assert outcomes[5] == (True, 'cholesky')


def test_unknown_method_is_refused():
    with pytest.raises(ValueError, match='method must be one of'):
        linalg.damped_inverses([numpy.eye(2)], [1.0], method='lu')
    with pytest.raises(options.OptionError, match='inverse_method'):
        helpers.kfac(inverse_method='lu')


def test_kfac_steps_equal_either_way():
    """Three float64 K-FAC steps of a conv + BN model give the same weights
    with every inverse method."""
    x, t = helpers.data(n=8)
    weights = []
    for method in linalg.INVERSE_METHODS:
        model = helpers.ConvNet(bn=True)
        for k, (_, param) in enumerate(sorted(model.namedparams())):
            param.array[...] = numpy.random.RandomState(k).randn(
                *param.shape) * 0.3
        optimizer = helpers.kfac(inverse_method=method, lr=0.1)
        optimizer.setup(model)
        for _ in range(3):
            optimizer.update(helpers.loss_of(model), x, t)
        weights.append({n: p.array.copy() for n, p in model.namedparams()})
    for other in weights[1:]:
        for name in weights[0]:
            numpy.testing.assert_allclose(other[name], weights[0][name],
                                          rtol=1e-9, atol=1e-12)
