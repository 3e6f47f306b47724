"""Monte-Carlo quantities against the exact ones: unbiased (a z-test over
independent draws) and converging as the sample count grows."""
import numpy
import pytest

import chainer.functions as F

from chainerkfac import curvature
from tests.chainerkfac.curvature import nets


def flat(q, name, paths):
    return numpy.concatenate([q[p][name].ravel() for p in paths])


@pytest.mark.parametrize('lossfun', ['softmax', 'squared'])
def test_sampled_quantities_are_unbiased_and_converge(lossfun):
    model, x, t = nets.build('conv_pool_linear', n=4)
    if lossfun == 'squared':
        lossfun = F.mean_squared_error
        t = numpy.random.RandomState(3).randn(len(x), nets.N_CLASS)
    else:
        lossfun = F.softmax_cross_entropy
    exact = curvature.extract(model, x, t, lossfun=lossfun,
                              quantities=('diag_ggn', 'kflr'))
    paths = sorted(exact)
    weights = [p for p in paths if p.endswith('/W')]
    reference = numpy.concatenate([flat(exact, 'diag_ggn', paths),
                                   flat(exact, 'kflr_B', weights)])

    def draw(samples, seed):
        q = curvature.extract(model, x, t, lossfun=lossfun,
                              quantities=('diag_ggn_mc', 'kfac'),
                              mc_samples=samples, seed=seed)
        return numpy.concatenate([flat(q, 'diag_ggn_mc', paths),
                                  flat(q, 'kfac_B', weights)])

    # Unbiased: 30 independent estimates of 8 samples each; every entry's
    # mean within 5 standard errors of the exact value.
    draws = numpy.array([draw(8, seed) for seed in range(30)])
    error = draws.mean(0) - reference
    standard_error = draws.std(0, ddof=1) / numpy.sqrt(len(draws))
    live = standard_error > 1e-12 * numpy.abs(reference).max()
    assert (numpy.abs(error[live]) <= 5 * standard_error[live]).all()
    assert numpy.abs(error[~live]).max(initial=0) <= \
        1e-10 * numpy.abs(reference).max()

    # Converging: the relative error with 64× more samples is about 8×
    # smaller (at least 3× here).
    def relative_error(samples):
        return numpy.linalg.norm(draw(samples, 100) - reference) / \
            numpy.linalg.norm(reference)
    few, many = relative_error(16), relative_error(1024)
    assert many < few / 3 and many < 0.1, (few, many)


def test_same_seed_same_draws_and_labels_from_the_softmax():
    model, x, t = nets.build('conv_pool_linear', n=3)
    one = curvature.extract(model, x, t, quantities=('diag_ggn_mc',),
                            seed=4)
    two = curvature.extract(model, x, t, quantities=('diag_ggn_mc',),
                            seed=4)
    for path in one:
        numpy.testing.assert_array_equal(one[path]['diag_ggn_mc'],
                                         two[path]['diag_ggn_mc'])
    # With one class overwhelmingly likely, every sampled label is that
    # class and the sampled root vanishes with the Hessian.
    model.fc.b.array[...] = [60.0, 0.0, 0.0, 0.0]
    q = curvature.extract(model, x, t, quantities=('diag_ggn_mc',),
                          mc_samples=5, seed=0)
    assert max(numpy.abs(v['diag_ggn_mc']).max() for v in q.values()) < 1e-20
