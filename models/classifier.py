"""A classifier that accepts integer labels or soft labels (running mixup).

The loss reported and the loss optimised are the same number: the mean over
the batch of ``−Σ_k t_k log softmax(y)_k``.
"""
import chainer
import chainer.functions as F
import chainer.links as L


def soft_label_cross_entropy(y, t):
    """Cross-entropy with integer or soft labels, averaged over the batch.

    Parameters
    ----------
    y : chainer.Variable or array, shape ``(N, K)``
        Logits.
    t : array, shape ``(N,)`` int or ``(N, K)`` float
        Integer class labels, or per-sample label distributions (rows sum to
        one, e.g. from :class:`augment.RunningMixup`).

    Returns
    -------
    chainer.Variable
        Scalar ``mean_n −Σ_k t[n, k] log softmax(y[n])_k``. With integer labels
        this is exactly :func:`chainer.functions.softmax_cross_entropy`.
    """
    t = chainer.as_array(t)
    if t.ndim == 1:
        return F.softmax_cross_entropy(y, t)
    if t.shape != y.shape:
        raise ValueError('soft labels must have the logits\' shape {}, got {}'
                         .format(y.shape, t.shape))
    log_p = F.log_softmax(y)
    return -F.sum(t.astype(log_p.dtype, copy=False) * log_p) / y.shape[0]


def soft_label_accuracy(y, t):
    """Top-1 accuracy against integer labels or the argmax of soft labels.

    Parameters
    ----------
    y : chainer.Variable or array, shape ``(N, K)``
    t : array, shape ``(N,)`` int or ``(N, K)`` float
    """
    t = chainer.as_array(t)
    if t.ndim == 2:
        t = t.argmax(axis=1).astype('i')
    return F.accuracy(y, t)


class SoftLabelClassifier(L.Classifier):
    """:class:`chainer.links.Classifier` with soft-label loss and accuracy.

    ``model(x, t)`` returns the loss and reports ``'loss'`` and
    ``'accuracy'`` through :mod:`chainer.reporter`, exactly like
    ``chainer.links.Classifier``; ``t`` may be integer labels ``(N,)`` or
    soft labels ``(N, n_class)``.

    Parameters
    ----------
    predictor : chainer.Link
        A model returning logits, e.g. :class:`models.ResNet50`.
    """

    def __init__(self, predictor):
        super().__init__(predictor, lossfun=soft_label_cross_entropy,
                         accfun=soft_label_accuracy)
