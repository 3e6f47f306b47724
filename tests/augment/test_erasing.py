import numpy as np
import pytest

from augment import RandomErasing


def erased(x, out):
    return (out == 0) & (x != 0)


def test_erasing_statistics():
    rng = np.random.RandomState(0)
    x = (rng.rand(4000, 3, 64, 64) + 1).astype(np.float32)
    before = x.copy()
    out = RandomErasing(seed=0)(x)
    np.testing.assert_array_equal(x, before)  # input not mutated
    assert out is not x and out.dtype == x.dtype and out.shape == x.shape

    mask = erased(x, out)
    # All channels of a pixel are erased together, to exactly zero.
    assert np.all(mask == mask[:, :1])
    mask = mask[:, 0]
    hit = mask.any(axis=(1, 2))
    assert abs(hit.mean() - 0.5) < 0.03  # p = 0.5, 4000 draws: σ ≈ 0.008
    untouched = ~mask[:, None] & np.ones_like(x, dtype=bool)
    np.testing.assert_array_equal(out[untouched], x[untouched])

    # One rectangle per erased sample, area ratio in [0.02, 0.25] up to the
    # rounding of its sides to whole pixels.
    ratios = []
    for m in mask[hit]:
        rows, cols = np.where(m.any(axis=1))[0], np.where(m.any(axis=0))[0]
        h, w = rows[-1] - rows[0] + 1, cols[-1] - cols[0] + 1
        assert m.sum() == h * w
        slack = 0.5 * (h + w) + 0.25
        assert 0.02 * 64 * 64 - slack <= h * w <= 0.25 * 64 * 64 + slack
        # r_e ∈ [0.3, 1], again up to rounding
        assert (min(h, w) + 0.5) / (max(h, w) - 0.5) >= 0.3
        ratios.append(m.mean())
    assert min(ratios) < 0.03 and max(ratios) > 0.23
    # H/W swapped at random: both orientations occur.
    tall = sum(m.any(axis=1).sum() > m.any(axis=0).sum() for m in mask[hit])
    assert 0.3 < tall / hit.sum() < 0.7


def test_erasing_is_seeded_and_vectorised_over_any_batch():
    x = np.ones((5, 1, 8, 12), np.float32)
    a = RandomErasing(p=1.0, seed=3)(x)
    b = RandomErasing(p=1.0, seed=3)(x)
    np.testing.assert_array_equal(a, b)
    assert np.all((a == 0).any(axis=(1, 2, 3)))
    assert np.array_equal(RandomErasing(p=0.0)(x), x)


def test_bad_parameters():
    with pytest.raises(ValueError, match='probability'):
        RandomErasing(p=1.5)
    with pytest.raises(ValueError, match='area_range'):
        RandomErasing(area_range=(0.3, 0.2))
