"""ImageNet list-format datasets: ``relative/path.JPEG label`` per line.

:func:`read_image_list` parses a list into an :class:`ImageList` (paths,
labels and line numbers in compact arrays, cheap to pickle to loader
processes), checking every label against the number of classes and, if
asked, that the files exist. :class:`ImageListDataset` is a
:class:`chainer.dataset.DatasetMixin` over such a list that returns resized
images as ``(3, size, size)`` **uint8** arrays and int32 labels; crop, flip
and normalisation come on top (:class:`augment.ImageTransform`, or on the
training device in ``train_imagenet.py``).
"""
import hashlib
import os

import chainer
import numpy as np
from PIL import Image

from augment.transforms import ImageTransform


class ImageList:
    """The entries of one list file.

    Parameters
    ----------
    list_path : str
        The list file (named in error messages).
    root : str
        Directory the paths are relative to.
    paths : sequence of str
        Path of every image relative to ``root``.
    labels, lines : sequence of int
        Label and line number (1-based) of every image.

    Notes
    -----
    Relative paths are kept as one UTF-8 byte array: the list pickles to a
    loader process as a few arrays, quickly.
    """

    def __init__(self, list_path, root, paths, labels, lines):
        self.list_path = list_path
        self.root = root
        self._paths = np.array([p.encode('utf-8') for p in paths],
                               dtype=np.bytes_) if len(paths) else \
            np.zeros(0, dtype='S1')
        self.labels = np.asarray(labels, dtype=np.int32)
        self.lines = np.asarray(lines, dtype=np.int64)

    def __len__(self):
        return len(self.labels)

    def path(self, i):
        """Full path of image ``i``."""
        return os.path.join(self.root, self._paths[i].decode('utf-8'))

    def where(self, i):
        """``'<path> (listed in <list>, line <n>)'`` for messages."""
        return '{} (listed in {}, line {})'.format(
            self.path(i), self.list_path, int(self.lines[i]))

    def without(self, indices):
        """A copy without the entries ``indices`` (e.g. unreadable images).
        """
        keep = np.ones(len(self), dtype=bool)
        keep[np.asarray(list(indices), dtype=np.int64)] = False
        out = ImageList.__new__(ImageList)
        out.list_path = self.list_path
        out.root = self.root
        out._paths = self._paths[keep]
        out.labels = self.labels[keep]
        out.lines = self.lines[keep]
        return out

    def digests(self):
        """SHA-256 of the paths (in list order) and of the labels: the
        contents a training stream's position refers to (a resume compares
        them with the snapshot's).

        Returns
        -------
        (str, str)
            Hex digests of the paths and of the labels.
        """
        paths = hashlib.sha256(b'\n'.join(self._paths.tolist()))
        labels = hashlib.sha256(self.labels.astype('<i4').tobytes())
        return paths.hexdigest(), labels.hexdigest()

    def missing_files(self, indices=None):
        """Indices (among ``indices``, default all) whose file is missing."""
        indices = range(len(self)) if indices is None else indices
        return [i for i in indices if not os.path.isfile(self.path(i))]

    def missing_files_error(self, missing):
        """The :class:`FileNotFoundError` for the missing ``missing``."""
        first = min(missing)
        return FileNotFoundError(
            'image not found: {}; {} of {} listed images are missing'.format(
                self.where(first), len(missing), len(self)))


def read_image_list(list_path, root='.', check_files=True, n_class=None):
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
        run before training starts rather than hours into it. (A distributed
        run checks a share of the files on each process instead, with
        :meth:`ImageList.missing_files`.)
    n_class : int or None
        Number of classes: every label must lie in ``[0, n_class)``.

    Returns
    -------
    ImageList

    Raises
    ------
    ValueError
        A line that does not parse, or a label outside ``[0, n_class)``,
        naming the list file and the line.
    FileNotFoundError
        The list file or a listed image is missing, naming the image, the
        list file and the line; the message counts all missing images.
    """
    paths, labels, lines = [], [], []
    with open(list_path, 'rb') as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode('utf-8')
            except UnicodeDecodeError as error:
                raise ValueError(
                    '{}, line {}: not UTF-8 ({}); save the list as UTF-8'
                    .format(list_path, lineno, error)) from None
            if lineno == 1:
                line = line.lstrip('\ufeff')    # a byte-order mark
            if not line.strip():
                continue
            fields = line.rsplit(maxsplit=1)
            try:
                # ASCII digits only: int() also takes '+3', '0_1' (as 1)
                # and other scripts' digits
                if len(fields) != 2 or not (fields[1].isascii() and
                                            fields[1].isdigit()):
                    raise ValueError
                label = int(fields[1])
            except ValueError:
                raise ValueError(
                    '{}, line {}: expected "relative/path label" with a '
                    'non-negative integer label, got {!r}'.format(
                        list_path, lineno, line.rstrip('\n'))) from None
            if n_class is not None and label >= n_class:
                raise ValueError(
                    '{}, line {}: label {} is out of range for {} classes '
                    '(labels must lie in [0, {}); set the class count with '
                    'n_class in the config or --n-class)'.format(
                        list_path, lineno, label, n_class, n_class))
            paths.append(fields[0].strip())
            labels.append(label)
            lines.append(lineno)
    images = ImageList(list_path, root, paths, labels, lines)
    if check_files:
        missing = images.missing_files()
        if missing:
            raise images.missing_files_error(missing)
    return images


#: Unsigned 16-bit grey, as PIL opens 16-bit PNG, TIFF and PGM files.
GREY16_MODES = ('I;16', 'I;16L', 'I;16B', 'I;16N')
#: Modes with an alpha band (besides a ``transparency`` entry of the info).
ALPHA_MODES = ('LA', 'La', 'PA', 'RGBA', 'RGBa')


def to_rgb(image):
    """The RGB image a PIL image shows, whatever its mode.

    * 16-bit grey (:data:`GREY16_MODES`, and ``'I'`` from a PGM, which PIL
      scales to 0..65535 from any maxval) is scaled to 8 bits, ``v · 255 /
      65535`` rounded: PIL's ``convert('RGB')`` clips it at 255, so a 16-bit
      scan would train as a white image.
    * Transparency (an alpha band, or a transparent palette index / colour)
      is composited over black: the colour under a transparent pixel is
      arbitrary (often the palette's first entry).
    * ``'1'``, ``'L'``, ``'P'``, ``'CMYK'``, ``'YCbCr'``, ``'LAB'``, ``'HSV'``:
      PIL's conversion.

    Raises
    ------
    ValueError
        Samples with no defined white level (32-bit integers, floats,
        signed 16-bit): a guessed scale would silently change the image.
    """
    mode = image.mode
    if mode in GREY16_MODES or (mode == 'I' and image.format == 'PPM'):
        grey = np.asarray(image).astype(np.uint32)
        grey = ((grey * 255 + 32767) // 65535).astype(np.uint8)
        return Image.fromarray(grey, 'L').convert('RGB')
    if mode.startswith(('I', 'F')):
        raise ValueError(
            "mode '{}' ({} samples) has no defined white level; convert the "
            'file to 8 or 16 bits per sample'.format(
                mode, 'floating-point' if mode.startswith('F') else
                'signed or 32-bit integer'))
    if mode in ALPHA_MODES or 'transparency' in image.info:
        rgba = np.asarray(image.convert('RGBA'), np.float32)
        shown = np.round(rgba[..., :3] * rgba[..., 3:] / 255.0)
        return Image.fromarray(shown.astype(np.uint8), 'RGB')
    return image.convert('RGB')


#: The EXIF tag of the orientation in which a camera stored the pixels.
EXIF_ORIENTATION = 0x0112
#: Orientation -> the transpose that shows the image upright (as viewers
#: and ``PIL.ImageOps.exif_transpose`` do); 1 (upright) and none: nothing.
EXIF_TRANSPOSE = {2: Image.Transpose.FLIP_LEFT_RIGHT,
                  3: Image.Transpose.ROTATE_180,
                  4: Image.Transpose.FLIP_TOP_BOTTOM,
                  5: Image.Transpose.TRANSPOSE,
                  6: Image.Transpose.ROTATE_270,
                  7: Image.Transpose.TRANSVERSE,
                  8: Image.Transpose.ROTATE_90}


def load_image(path, size=None):
    """Read an image as RGB (:func:`to_rgb`), upright as its EXIF
    orientation says (a phone's photo stored on its side), optionally
    resized to ``size x size``.

    The aspect ratio is ignored (paper section 4.1); resampling is bilinear.

    Parameters
    ----------
    path : str
    size : int or None
        Side of the output; ``None`` keeps the image's size.

    Returns
    -------
    numpy.ndarray
        uint8, ``(3, H, W)``.

    Raises
    ------
    OSError
        The file cannot be read as an image (missing, truncated, not an
        image, a mode :func:`to_rgb` refuses); names the file.
    """
    try:
        with Image.open(path) as image:
            turn = EXIF_TRANSPOSE.get(image.getexif().get(EXIF_ORIENTATION))
            image = to_rgb(image)
            if turn is not None:
                image = image.transpose(turn)
            if size is not None:
                image = image.resize((size, size), Image.BILINEAR)
            array = np.asarray(image, dtype=np.uint8)
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise OSError('cannot read image {}: {}'.format(path, error)) \
            from error
    return array.transpose(2, 0, 1)


class ImageListDataset(chainer.dataset.DatasetMixin):
    """Labelled images from a list file, resized to a square.

    Parameters
    ----------
    list_path : str or ImageList
        ImageNet list format (see :func:`read_image_list`), or a list
        already read.
    root : str
        Directory the listed paths are relative to.
    resize : int or None
        Images are resized to ``resize x resize`` ignoring aspect (paper:
        256); ``None`` keeps their size (then all must have the same size to
        be batched).
    check_files : bool
        Check up front that every listed image exists.
    n_class : int or None
        Check every label against the number of classes.

    Notes
    -----
    ``dataset[i]`` is ``(image, label)``: uint8 ``(3, resize, resize)`` and
    ``numpy.int32``. An unreadable image raises :class:`OSError` naming the
    file and its line in the list.
    """

    def __init__(self, list_path, root='.', resize=256, check_files=True,
                 n_class=None):
        if isinstance(list_path, ImageList):
            self.images = list_path
        else:
            self.images = read_image_list(list_path, root, check_files,
                                          n_class)
        self.list_path = self.images.list_path
        self.resize = resize

    def __len__(self):
        return len(self.images)

    @property
    def labels(self):
        """numpy.ndarray of int32: the label of every image, in list order."""
        return self.images.labels

    def get_example(self, i):
        try:
            image = load_image(self.images.path(i), self.resize)
        except OSError as error:
            raise OSError('{} (listed in {}, line {})'.format(
                error, self.list_path, int(self.images.lines[i]))) from error
        return image, self.images.labels[i]


def imagenet_dataset(list_path, root, mean, crop_size=224, resize=256,
                     train=True, seed=None, check_files=True):
    """The training or validation dataset of section 4.1, normalised on the
    host (float32 examples; ``train_imagenet.py`` moves uint8 crops and
    normalises on the device instead).

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
