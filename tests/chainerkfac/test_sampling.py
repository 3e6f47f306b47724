"""The one inverse-CDF label draw (:mod:`chainerkfac.sampling`) against
an independent oracle, and both of its users drawing through it."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import numpy

from chainerkfac import sampling
from chainerkfac.estimator import LabelSampler


def _oracle(probs, uniforms):
    """``searchsorted`` on each row's normalised CDF (right side: the first
    bin whose cumulative mass exceeds the draw)."""
    out = numpy.empty(uniforms.shape, numpy.int64)
    for index in numpy.ndindex(*uniforms.shape):
        row = probs[index[-1]]
        cdf = numpy.cumsum(row) / row.sum()
        out[index] = min(numpy.searchsorted(cdf, uniforms[index],
                                            side='right'), len(row) - 1)
    return out


def test_inverse_cdf_matches_searchsorted_for_any_leading_shape():
    rng = numpy.random.RandomState(0)
    probs = rng.rand(7, 5)
    probs[2, 1] = 0.0                      # an empty bin is never drawn
    for shape in [(7,), (3, 7)]:
        uniforms = rng.rand(*shape)
        labels = sampling.inverse_cdf(probs, uniforms)
        assert labels.shape == shape
        numpy.testing.assert_array_equal(labels, _oracle(probs, uniforms))


def test_frequencies_follow_the_probabilities():
    probs = numpy.array([[0.1, 0.6, 0.3]])
    uniforms = numpy.random.RandomState(1).rand(20000, 1)
    labels = sampling.inverse_cdf(probs, uniforms)[:, 0]
    frequencies = numpy.bincount(labels, minlength=3) / len(labels)
    # Binomial standard error at n = 20000 is at most 0.0035: 5 of them.
    numpy.testing.assert_allclose(frequencies, probs[0], atol=0.018)


def test_label_sampler_draws_through_it():
    logits = numpy.random.RandomState(2).randn(6, 4)
    sampler = LabelSampler(seed=5)
    labels = sampler.sample(logits)
    draws = numpy.random.RandomState(5).random_sample((6, 1))[:, 0]
    probs = numpy.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    assert labels.dtype == numpy.int32
    numpy.testing.assert_array_equal(labels, _oracle(probs, draws))
