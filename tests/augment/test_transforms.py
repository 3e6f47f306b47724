import numpy as np
import pytest

from augment import ImageTransform


def coded_image(size):
    """Pixel (r, c) holds r * size + c in every channel."""
    grid = np.arange(size * size, dtype=np.float32).reshape(size, size)
    return np.stack([grid] * 3)


def decode(out, size):
    """Offset (top, left) and flip of a crop of coded_image(size)."""
    first = int(round(out[0, 0, 0] * 255))
    last = int(round(out[0, 0, -1] * 255))
    flipped = last < first
    top, left = divmod(min(first, last), size)
    return top, left, flipped


def test_every_offset_reachable_and_flip():
    image = coded_image(36)
    transform = ImageTransform(None, crop_size=32, train=True, seed=0)
    tops, lefts, flips = set(), set(), []
    for _ in range(600):
        out, label = transform((image, np.int32(3)))
        assert out.shape == (3, 32, 32) and out.dtype == np.float32
        assert label == 3
        top, left, flipped = decode(out, 36)
        expected = image[:, top:top + 32, left:left + 32] / 255
        if flipped:
            expected = expected[:, :, ::-1]
        np.testing.assert_allclose(out, expected, rtol=1e-6)
        tops.add(top)
        lefts.add(left)
        flips.append(flipped)
    assert tops == set(range(5)) and lefts == set(range(5))
    assert 0.4 < np.mean(flips) < 0.6


def test_all_33_offsets_of_the_paper_reachable():
    image = np.zeros((3, 256, 256), np.float32)
    image[0] = np.arange(256)[:, None]  # row index
    image[1] = np.arange(256)[None, :]  # column index
    transform = ImageTransform(None, crop_size=224, seed=1)
    tops, lefts = set(), set()
    for _ in range(400):
        out, _ = transform((image, 0))
        tops.add(int(round(out[0, 0, 0] * 255)))
        lefts.add(int(round(min(out[1, 0, 0], out[1, 0, -1]) * 255)))
    assert tops == set(range(33)) and lefts == set(range(33))


def test_mean_subtraction_and_scaling():
    rng = np.random.RandomState(0)
    image = rng.uniform(0, 255, (3, 36, 36)).astype(np.float32)
    mean = rng.uniform(0, 255, (3, 32, 32)).astype(np.float32)
    before = image.copy()
    out, _ = ImageTransform(mean, crop_size=32, train=False)((image, 1))
    # Validation: centre crop (offset 2), no flip, (x − mean) / 255.
    np.testing.assert_allclose(out, (image[:, 2:34, 2:34] - mean) / 255,
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(image, before)
    assert out.min() >= -1 and out.max() <= 1
    # Without a mean, pixels scale from [0, 255] to [0, 1].
    full = np.full((3, 32, 32), 255, np.float32)
    out, _ = ImageTransform(None, 32, train=False)((full, 0))
    assert np.all(out == 1)


def test_mean_applies_unflipped_after_flip():
    image = coded_image(32)
    mean = np.random.RandomState(0).rand(3, 32, 32).astype(np.float32)
    transform = ImageTransform(mean, crop_size=32, seed=0)
    seen = set()
    for _ in range(20):
        out, _ = transform((image, 0))
        flipped = out[0, 0, 0] * 255 + mean[0, 0, 0] > 1
        crop = image[:, :, ::-1] if flipped else image
        np.testing.assert_allclose(out, (crop - mean) / 255, atol=1e-5)
        seen.add(bool(flipped))
    assert seen == {True, False}


def test_mean_shape_and_small_image_errors():
    with pytest.raises(ValueError, match='crop size 32'):
        ImageTransform(np.zeros((3, 30, 30)), crop_size=32)
    with pytest.raises(ValueError, match='smaller'):
        ImageTransform(None, 32)((np.zeros((3, 30, 40), np.float32), 0))
