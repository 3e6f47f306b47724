"""The Peaks level sets: labels are the formula's bins."""
import numpy
import pytest

from chainerkfac.layer_parallel import data


def _peaks_formula(x, y):
    # Written out again from MATLAB's documentation of peaks.
    return (3 * (1 - x) ** 2 * numpy.exp(-(x ** 2) - (y + 1) ** 2)
            - 10 * (x / 5 - x ** 3 - y ** 5) * numpy.exp(-x ** 2 - y ** 2)
            - 1 / 3 * numpy.exp(-(x + 1) ** 2 - y ** 2))


def test_peaks_labels_are_the_formula_bins():
    x, t = data.peaks_dataset(n_per_class=400, seed=5)
    axis = numpy.linspace(-3, 3, 256)
    gx, gy = numpy.meshgrid(axis, axis)
    z_grid = _peaks_formula(gx, gy)
    edges = numpy.linspace(z_grid.min(), z_grid.max(), 6)
    z = _peaks_formula(x[:, 0], x[:, 1])
    expected = numpy.clip(numpy.digitize(z, edges[1:-1]), 0, 4)
    numpy.testing.assert_array_equal(t, expected)
    assert numpy.array_equal(numpy.bincount(t), [400] * 5)
    # Every point is a grid point of [-3, 3]².
    index = (x + 3) / 6 * 255
    numpy.testing.assert_allclose(index, numpy.round(index), atol=1e-9)
    assert x.dtype == numpy.float64 and t.dtype == numpy.int32


def test_peaks_draws_depend_on_the_seed_only():
    a = data.peaks_dataset(50, seed=1)
    b = data.peaks_dataset(50, seed=1)
    c = data.peaks_dataset(50, seed=2)
    assert numpy.array_equal(a[0], b[0])
    assert not numpy.array_equal(a[0], c[0])


def test_digits():
    (x, t), (x_val, t_val) = data.digits_dataset(n_val=97)
    assert x.shape == (1700, 1, 8, 8) and x_val.shape == (97, 1, 8, 8)
    assert 0 <= x.min() and x.max() <= 1
    assert set(t) == set(range(10))


def test_digits_without_scikit_learn_names_the_extra(monkeypatch):
    """scikit-learn is no dependency of the library: without it the
    error names the extra to install (a stranger's 3.12 install got
    ``No module named 'sklearn'`` from inside the function)."""
    import sys
    monkeypatch.setitem(sys.modules, 'sklearn.datasets', None)
    with pytest.raises(ImportError, match=r'chainerkfac\[digits\]'):
        data.digits_dataset()
