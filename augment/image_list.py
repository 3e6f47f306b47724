"""ImageNet list-format datasets: ``relative/path.JPEG label`` per line.

:class:`ImageListDataset` is a :class:`chainer.dataset.DatasetMixin` that
returns resized images as ``(3, size, size)`` float32 arrays in ``[0, 255]``
and int32 labels; random crop, flip and normalisation are applied on top by
:class:`augment.ImageTransform` through
:class:`chainer.datasets.TransformDataset` (see :func:`imagenet_dataset`).
"""
import os

import chainer
import numpy as np
from PIL import Image

from augment.transforms import ImageTransform


def read_image_list(list_path, root='.', check_files=True):
    """Parse an image list.

    Parameters
    ----------
    list_path : str
        Text file with one ``relative/path label`` per line (the path may
        contain spaces; the label is the last field). Blank lines are skipped.
    root : str
        Directory the paths are relative to.
    check_files : bool
        Check that every listed image exists, so that a missing file stops the
        run before training starts rather than hours into it.

    Returns
    -------
    list of (str, int, int)
        ``(full path, label, line number)`` per image.

    Raises
    ------
    ValueError
        A line that does not parse, naming the list file and line number.
    FileNotFoundError
        The list file or a listed image is missing, naming the image, the
        list file and the line; the message counts all missing images.
    """
    entries = []
    with open(list_path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            fields = line.rsplit(maxsplit=1)
            try:
                if len(fields) != 2:
                    raise ValueError
                label = int(fields[1])
                if label < 0:
                    raise ValueError
            except ValueError:
                raise ValueError(
                    '{}, line {}: expected "relative/path label" with a '
                    'non-negative integer label, got {!r}'.format(
                        list_path, lineno, line.rstrip('\n'))) from None
            entries.append((os.path.join(root, fields[0].strip()), label,
                            lineno))
    if check_files:
        missing = [(path, lineno) for path, _, lineno in entries
                   if not os.path.isfile(path)]
        if missing:
            path, lineno = missing[0]
            raise FileNotFoundError(
                'image not found: {} (listed in {}, line {}); {} of {} '
                'listed images are missing'.format(
                    path, list_path, lineno, len(missing), len(entries)))
    return entries


def load_image(path, size=None):
    """Read an image as RGB, optionally resized to ``size x size``.

    The aspect ratio is ignored (paper section 4.1); resampling is bilinear.

    Parameters
    ----------
    path : str
    size : int or None
        Side of the output; ``None`` keeps the image's size.

    Returns
    -------
    numpy.ndarray
        float32, ``(3, H, W)``, values in ``[0, 255]``.

    Raises
    ------
    OSError
        The file cannot be read as an image; names the file.
    """
    try:
        with Image.open(path) as image:
            image = image.convert('RGB')
            if size is not None:
                image = image.resize((size, size), Image.BILINEAR)
            array = np.asarray(image, dtype=np.float32)
    except (OSError, ValueError) as error:
        raise OSError('cannot read image {}: {}'.format(path, error)) \
            from error
    return array.transpose(2, 0, 1)


class ImageListDataset(chainer.dataset.DatasetMixin):
    """Labelled images from a list file, resized to a square.

    Parameters
    ----------
    list_path : str
        ImageNet list format (see :func:`read_image_list`).
    root : str
        Directory the listed paths are relative to.
    resize : int or None
        Images are resized to ``resize x resize`` ignoring aspect (paper:
        256); ``None`` keeps their size (then all must have the same size to
        be batched).
    check_files : bool
        Check up front that every listed image exists.

    Notes
    -----
    ``dataset[i]`` is ``(image, label)``: float32 ``(3, resize, resize)`` in
    ``[0, 255]`` and ``numpy.int32``. An unreadable image raises
    :class:`OSError` naming the file and its line in the list.
    """

    def __init__(self, list_path, root='.', resize=256, check_files=True):
        self.list_path = list_path
        self.resize = resize
        self._entries = read_image_list(list_path, root, check_files)

    def __len__(self):
        return len(self._entries)

    @property
    def labels(self):
        """numpy.ndarray of int32: the label of every image, in list order."""
        return np.array([label for _, label, _ in self._entries],
                        dtype=np.int32)

    def get_example(self, i):
        path, label, lineno = self._entries[i]
        try:
            image = load_image(path, self.resize)
        except OSError as error:
            raise OSError('{} (listed in {}, line {})'.format(
                error, self.list_path, lineno)) from error
        return image, np.int32(label)


def imagenet_dataset(list_path, root, mean, crop_size=224, resize=256,
                     train=True, seed=None, check_files=True):
    """The training or validation dataset of section 4.1.

    Parameters
    ----------
    list_path, root, resize, check_files
        As for :class:`ImageListDataset`.
    mean, crop_size, train, seed
        As for :class:`augment.ImageTransform`.

    Returns
    -------
    chainer.datasets.TransformDataset
        Examples ``(image, label)``: float32 ``(3, crop_size, crop_size)``
        and int32.
    """
    base = ImageListDataset(list_path, root, resize, check_files)
    transform = ImageTransform(mean, crop_size, train=train, seed=seed)
    return chainer.datasets.TransformDataset(base, transform)
