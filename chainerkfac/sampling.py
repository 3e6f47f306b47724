"""Labels drawn from a categorical distribution by its inverse CDF.

The one place where uniform draws become labels: the optimizer's
Monte-Carlo Fisher (:class:`chainerkfac.estimator.LabelSampler`) and the
curvature package's sampled loss-Hessian roots
(:mod:`chainerkfac.curvature.loss_hessian`) both call
:func:`inverse_cdf`, so a label drawn from the same uniform is the same
label in both.
"""
import numpy


def inverse_cdf(probs, uniforms):
    """Labels with ``P(label = c) = probs[n, c]``, one per uniform draw.

    Parameters
    ----------
    probs : numpy.ndarray of shape (N, C)
        Row ``n`` is a categorical distribution (non-negative; it need not
        sum to one exactly: it is normalised by its own total, so that
        rounding in the softmax never leaves a draw above the last bin).
    uniforms : numpy.ndarray of shape (..., N)
        Draws from U[0, 1); entry ``[..., n]`` draws a label from row ``n``.

    Returns
    -------
    numpy.ndarray of shape (..., N), int64
        The smallest ``c`` whose cumulative probability exceeds
        ``uniform · total``, clipped to ``C - 1``.
    """
    cumulative = probs.cumsum(axis=1)
    labels = (cumulative < uniforms[..., None] * cumulative[:, -1:]).sum(
        axis=-1)
    return numpy.minimum(labels, probs.shape[1] - 1)
