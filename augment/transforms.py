"""Crop, flip, mean subtraction and scaling (paper section 4.1).

What the paper means, made precise
----------------------------------
"We resize all images to 256 × 256 ignoring the aspect ratio and compute the
mean value (224 × 224) of the upper left of the resized images. When reading
an image, we randomly crop a 224 × 224 image from it, randomly flip it
horizontally, subtract the mean value, and scale every pixel to [0, 1]."

* The *mean value* is a mean **image**: the per-pixel, per-channel average
  over the training set of the upper-left ``crop x crop`` window of the
  resized images, shape ``(3, crop, crop)`` (:func:`augment.compute_mean`).
  The same mean image is subtracted from every crop, whatever its offset, and
  after the flip (the order of the sentence).
* *Scale every pixel to [0, 1]* is the factor 1/255 that maps the pixel range
  ``[0, 255]`` to ``[0, 1]`` (the wording of Chainer's ImageNet example, on
  which the authors' code is built: ``image -= mean; image *= 1 / 255``). It
  is not a per-image min-max rescaling. After the mean subtraction the
  values lie in ``[-1, 1]``, centred near 0.

So a training example is ``(flip(crop(resized)) − mean) / 255``:
:func:`crop_flip` where the image is decoded (uint8), :func:`normalize`
where it is trained on.

* The crop offset is uniform over **all** positions, ``0 ... size − crop``
  inclusive in each axis (33 values for 256 → 224; Chainer's example draws
  only ``0 ... 31``).
* Validation uses the centre crop, offset ``(size − crop) // 2``, no flip.
"""
import numpy as np
from chainer import backend

from augment.random_state import ProcessLocalRNG


def crop_flip(image, crop_size, rng=None):
    """Crop (and flip) one image, keeping its dtype: the part of section 4.1
    done where the image is decoded.

    Parameters
    ----------
    image : numpy.ndarray, ``(C, H, W)``
        ``H, W >= crop_size``; not modified.
    crop_size : int
    rng : numpy.random.Generator or None
        ``None``: centre crop, no flip (validation). Otherwise a crop offset
        uniform over all positions ``0 ... size − crop`` in each axis and a
        horizontal flip with probability 1/2, drawn from ``rng`` in this
        order: top, left, flip.

    Returns
    -------
    numpy.ndarray
        ``(C, crop_size, crop_size)``, a new array of ``image``'s dtype.
    """
    _, height, width = image.shape
    crop = crop_size
    if height < crop or width < crop:
        raise ValueError('image of size {}x{} is smaller than the crop '
                         'size {}'.format(height, width, crop))
    if rng is not None:
        top = int(rng.integers(0, height - crop + 1))
        left = int(rng.integers(0, width - crop + 1))
        flip = bool(rng.integers(0, 2))
    else:
        top = (height - crop) // 2
        left = (width - crop) // 2
        flip = False
    out = image[:, top:top + crop, left:left + crop]
    if flip:
        out = out[:, :, ::-1]
    return np.ascontiguousarray(out)


def normalize(x, mean=None):
    """``(x − mean) / 255`` in float32: the part of section 4.1 done on the
    training device when images travel as uint8.

    Parameters
    ----------
    x : numpy.ndarray or cupy.ndarray
        ``(C, H, W)`` or a batch ``(N, C, H, W)``, any dtype (uint8 from the
        loaders), values in ``[0, 255]``.
    mean : array or None
        ``(C, H, W)`` float32, on the device of ``x``; ``None`` subtracts
        nothing.

    Returns
    -------
    array
        float32 of ``x``'s shape, on ``x``'s device. Elementwise the same
        operations as :class:`ImageTransform` (cast, subtract, multiply by
        ``float32(1/255)``), so both give the same numbers.
    """
    xp = backend.get_array_module(x)
    out = x.astype(xp.float32)
    if mean is not None:
        out -= mean
    out *= xp.float32(1 / 255)
    return out


class ImageTransform:
    """Crop (+ flip) and normalise one ``(image, label)`` example.

    Parameters
    ----------
    mean : numpy.ndarray or None
        Mean image, float, shape ``(3, crop_size, crop_size)`` in ``[0, 255]``
        (see :func:`augment.compute_mean`); ``None`` subtracts nothing.
    crop_size : int
        Side of the crop (paper: 224; the demo: 16).
    train : bool
        ``True``: random crop over all offsets and random horizontal flip
        (probability 1/2). ``False``: centre crop, no flip.
    seed : int, numpy.random.SeedSequence or None
        Seed (see :class:`augment.random_state.ProcessLocalRNG`; safe in
        ``MultiprocessIterator`` workers).

    Notes
    -----
    Called with ``(image, label)``, ``image`` ``(C, H, W)`` in ``[0, 255]``
    with ``H, W >= crop_size``; returns ``(out, label)`` with
    ``out = (crop − mean) / 255`` as float32 ``(C, crop_size, crop_size)``:
    :func:`normalize` of :func:`crop_flip`.
    """

    def __init__(self, mean, crop_size, train=True, seed=None):
        if mean is not None:
            mean = np.asarray(mean, dtype=np.float32)
            if mean.shape[1:] != (crop_size, crop_size):
                raise ValueError('the mean image must have shape (C, {0}, '
                                 '{0}) for crop size {0}, got {1}'.format(
                                     crop_size, mean.shape))
        self.mean = mean
        self.crop_size = crop_size
        self.train = train
        self._rng = ProcessLocalRNG(seed)

    def __call__(self, example):
        image, label = example
        rng = self._rng() if self.train else None
        return normalize(crop_flip(image, self.crop_size, rng),
                         self.mean), label
