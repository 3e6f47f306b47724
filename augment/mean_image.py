"""The mean image of section 4.1: compute over a dataset, save, load.

``train_imagenet.py`` computes it in parallel (:mod:`augment.scan`); the
serial :func:`compute_mean` is the reference it equals.
"""
import os
import tempfile

import numpy as np


def compute_mean(dataset, crop_size):
    """Mean of the upper-left ``crop_size x crop_size`` window of all images.

    Parameters
    ----------
    dataset : chainer dataset
        Examples ``(image, label)`` with ``image`` float ``(C, H, W)`` in
        ``[0, 255]`` already resized, e.g. :class:`augment.ImageListDataset`.
    crop_size : int

    Returns
    -------
    numpy.ndarray
        float32, ``(C, crop_size, crop_size)``; accumulated in float64.
    """
    if len(dataset) == 0:
        raise ValueError('cannot compute the mean image of an empty dataset')
    total = None
    for i in range(len(dataset)):
        window = np.asarray(dataset[i][0][:, :crop_size, :crop_size],
                            dtype=np.float64)
        if window.shape[1:] != (crop_size, crop_size):
            raise ValueError('image {} of shape {} is smaller than the crop '
                             'size {}'.format(i, dataset[i][0].shape,
                                              crop_size))
        total = window.copy() if total is None else total + window
    return (total / len(dataset)).astype(np.float32)


def save_mean(path, mean):
    """Write the mean image as ``.npy`` (whole or not at all: a temporary
    file in the same directory, renamed when complete).

    The file gets the mode of any new file (``0666`` less the umask), like
    the run's other outputs: ``tempfile.mkstemp`` would leave it ``0600``.
    """
    directory = os.path.dirname(os.path.abspath(path))
    # One writer per process: a name of an earlier process with this pid is
    # a leftover of a killed run.
    tmp = os.path.join(directory, '.mean.{}.tmp'.format(os.getpid()))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
    try:
        with os.fdopen(fd, 'wb') as f:
            np.save(f, np.asarray(mean, dtype=np.float32))
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def check_writable(path):
    """Raise before any work if the mean image cannot be written to
    ``path`` (missing directory, no permission), naming the path.

    Raises
    ------
    OSError
    """
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix='.mean.', suffix='.tmp',
                                   dir=directory)
    except OSError as error:
        raise OSError('cannot write the mean image to {}: {}'.format(
            path, error)) from None
    os.close(fd)
    os.unlink(tmp)


def load_mean(path, crop_size=None):
    """Read a mean image written by :func:`save_mean`.

    Parameters
    ----------
    path : str
    crop_size : int or None
        If given, the mean must have shape ``(C, crop_size, crop_size)``.

    Returns
    -------
    numpy.ndarray
        float32, ``(C, H, W)``.

    Raises
    ------
    ValueError
        The file is not a NumPy array file (``save_mean``'s ``.npy``: an
        ``.npz``, a truncated, empty or pickled file), or does not hold a
        finite ``(3, H, W)`` mean image of the expected size; names the
        file. (A NaN mean skipped every step of a run; a 1-channel one was
        broadcast over RGB, a 4-channel one failed at the first step.)
    """
    try:
        mean = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:
        raise ValueError('mean image {} cannot be read as a .npy array '
                         "file ({}: {}); it is written by the run's first "
                         'pass (--mean names where)'.format(
                             path, type(error).__name__, error)) from None
    if not isinstance(mean, np.ndarray):       # an .npz archive
        mean.close()
        raise ValueError('mean image {} is an .npz archive, not the .npy '
                         'array file of one mean image'.format(path))
    channels = ('3', 'H', 'W') if crop_size is None else \
        ('3', str(crop_size), str(crop_size))
    if mean.ndim != 3 or mean.shape[0] != 3 or (
            crop_size is not None
            and mean.shape[1:] != (crop_size, crop_size)):
        raise ValueError('mean image {} has shape {}, expected ({})'.format(
            path, mean.shape, ', '.join(channels)))
    if mean.dtype.kind not in 'fiu' or not np.isfinite(mean).all():
        raise ValueError('mean image {} holds {}: a mean image is finite '
                         'numbers'.format(
                             path, 'non-finite values' if mean.dtype.kind
                             in 'fiu' else 'dtype ' + str(mean.dtype)))
    return mean.astype(np.float32, copy=False)
