"""Random erasing with zero value (Zhong et al. 2017; paper section 4.1)."""
import numpy as np
from chainer import backend

from augment.random_state import ProcessLocalRNG


class RandomErasing:
    """Erase one random rectangle of each sample to zero, with probability p.

    For each sample: with probability ``p`` draw an area
    ``S = S_e · H · W`` with ``S_e ~ U(area_range)`` and an aspect
    ``r_e ~ U(aspect_range)``; the rectangle is ``H_e = sqrt(S r_e)`` by
    ``W_e = sqrt(S / r_e)`` (rounded to whole pixels, at least 1), swapped to
    ``(W_e, H_e)`` with probability 1/2, and placed uniformly at random
    inside the image. With ``aspect_range ⊂ (0, 1]`` and ``S_e ≤ 0.25`` the
    rectangle always fits a square image; on very elongated images a side
    is clipped to the image.

    Parameters
    ----------
    p : float
        Probability of erasing a sample (paper: 0.5).
    area_range : (float, float)
        Range of the erased fraction of the image area (paper: 0.02, 0.25).
    aspect_range : (float, float)
        Range of ``H_e / W_e`` before the swap (paper: 0.3, 1).
    seed : int, numpy.random.SeedSequence or None
        Seed (see :class:`augment.random_state.ProcessLocalRNG`).
    """

    def __init__(self, p=0.5, area_range=(0.02, 0.25),
                 aspect_range=(0.3, 1.0), seed=None):
        if not 0 <= p <= 1:
            raise ValueError('erasing probability must be in [0, 1], got {}'
                             .format(p))
        if not 0 < area_range[0] <= area_range[1] <= 1:
            raise ValueError('area_range must satisfy 0 < low <= high <= 1, '
                             'got {}'.format(area_range))
        if not 0 < aspect_range[0] <= aspect_range[1]:
            raise ValueError('aspect_range must satisfy 0 < low <= high, got '
                             '{}'.format(aspect_range))
        self.p = p
        self.area_range = tuple(area_range)
        self.aspect_range = tuple(aspect_range)
        self._rng = ProcessLocalRNG(seed)

    def __call__(self, x, rng=None):
        """Return a copy of the batch with the rectangles set to zero.

        Parameters
        ----------
        x : numpy.ndarray or cupy.ndarray, shape ``(N, C, H, W)``
            Not modified.
        rng : numpy.random.Generator or None
            Draw the rectangles from this generator (e.g. one derived from
            the batch's position in the data stream) instead of this
            object's own.

        Returns
        -------
        array of the shape and dtype of ``x``
        """
        mask = self.sample_mask(x.shape, rng)
        xp = backend.get_array_module(x)
        mask = xp.asarray(mask)[:, None]
        return xp.where(mask, xp.zeros((), dtype=x.dtype), x)

    def sample_mask(self, shape, rng=None):
        """Draw the erased pixels of a batch.

        Parameters
        ----------
        shape : tuple
            ``(N, C, H, W)``.
        rng : numpy.random.Generator or None
            As for :meth:`__call__`.

        Returns
        -------
        numpy.ndarray of bool, shape ``(N, H, W)``
            True where a pixel (all channels) is erased.
        """
        n, _, height, width = shape
        rng = self._rng() if rng is None else rng
        erase = rng.random(n) < self.p
        area = rng.uniform(*self.area_range, size=n) * height * width
        aspect = rng.uniform(*self.aspect_range, size=n)
        size_h, size_w = np.sqrt(area * aspect), np.sqrt(area / aspect)
        swap = rng.random(n) < 0.5
        size_h, size_w = (np.where(swap, size_w, size_h),
                          np.where(swap, size_h, size_w))
        size_h = np.clip(np.rint(size_h), 1, height).astype(np.int64)
        size_w = np.clip(np.rint(size_w), 1, width).astype(np.int64)
        top = (rng.random(n) * (height - size_h + 1)).astype(np.int64)
        left = (rng.random(n) * (width - size_w + 1)).astype(np.int64)
        rows = np.arange(height)
        cols = np.arange(width)
        in_rows = (rows >= top[:, None]) & (rows < (top + size_h)[:, None])
        in_cols = (cols >= left[:, None]) & (cols < (left + size_w)[:, None])
        return (erase[:, None, None] & in_rows[:, :, None]
                & in_cols[:, None, :])
