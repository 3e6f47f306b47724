"""The seed's data sets that exist here: the Peaks level sets (generated)
and, standing in for MNIST (which cannot be downloaded here), the
handwritten digits that ship with scikit-learn. The seed's third case,
Indian Pines, is not shipped anywhere and is not reproduced.
"""
from typing import Tuple

import numpy

#: Grid of the Peaks data (256 × 256 points over [-3, 3]²) and its classes.
PEAKS_GRID = 256
PEAKS_CLASSES = 5


def peaks(x, y):
    """MATLAB's ``peaks``: 3(1-x)² e^{-x²-(y+1)²} - 10(x/5 - x³ - y⁵)
    e^{-x²-y²} - e^{-(x+1)²-y²} / 3."""
    return (3 * (1 - x) ** 2 * numpy.exp(-x ** 2 - (y + 1) ** 2)
            - 10 * (x / 5 - x ** 3 - y ** 5) * numpy.exp(-x ** 2 - y ** 2)
            - numpy.exp(-(x + 1) ** 2 - y ** 2) / 3)


def peaks_grid(size: int = PEAKS_GRID) -> Tuple[numpy.ndarray, numpy.ndarray]:
    """Every grid point, (size², 2), and its class, (size²,) int32: five
    equal-width bins of z between its minimum and maximum on the grid."""
    axis = numpy.linspace(-3.0, 3.0, size)
    x, y = numpy.meshgrid(axis, axis)
    z = peaks(x, y).ravel()
    span = z.max() - z.min()
    labels = numpy.floor(PEAKS_CLASSES * (z - z.min()) / span)
    labels = numpy.minimum(labels, PEAKS_CLASSES - 1).astype(numpy.int32)
    return numpy.stack([x.ravel(), y.ravel()], axis=1), labels


def peaks_dataset(n_per_class: int = 1000, seed: int = 0,
                  size: int = PEAKS_GRID, dtype=numpy.float64):
    """``n_per_class`` grid points of every class, drawn with replacement
    (the authors' set-up), shuffled.

    Returns
    -------
    x : (5 n_per_class, 2) array of ``dtype``
    t : (5 n_per_class,) int32
    """
    points, labels = peaks_grid(size)
    rng = numpy.random.RandomState(seed)
    chosen = numpy.concatenate([
        rng.choice(numpy.flatnonzero(labels == k), n_per_class, replace=True)
        for k in range(PEAKS_CLASSES)])
    rng.shuffle(chosen)
    return points[chosen].astype(dtype), labels[chosen]


def digits_dataset(n_val: int = 297, seed: int = 0, dtype=numpy.float64):
    """scikit-learn's 8 × 8 digits (1797 images, 10 classes) scaled to
    [0, 1], as (batch, 1, 8, 8), split into training and validation.

    Returns
    -------
    (x_train, t_train), (x_val, t_val)

    Raises
    ------
    ImportError
        Without scikit-learn (not a dependency of the library: the
        ``digits`` extra, or the harness's ``requirements.txt``).
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ImportError(
            'digits_dataset loads scikit-learn\'s digits: pip install '
            '"chainerkfac[digits]" (or scikit-learn)') from error
    digits = load_digits()
    x = (digits.images / 16.0).astype(dtype)[:, None]
    t = digits.target.astype(numpy.int32)
    order = numpy.random.RandomState(seed).permutation(len(x))
    val, train = order[:n_val], order[n_val:]
    return (x[train], t[train]), (x[val], t[val])
