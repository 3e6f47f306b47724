"""One decoding pass over (a share of) an image list: the sum for the mean
image of section 4.1 and every unreadable file, in loader processes.

A distributed run gives each process a contiguous share of the list
(:func:`share`), adds the sums over processes and divides by the count:
sums of uint8 pixels in float64 are exact, so the result equals the serial
:func:`augment.compute_mean` bit for bit.
"""
import time

import numpy as np

from augment.stream import IndexedView, make_loader


def share(n, n_processes, rank):
    """``range`` of the entries of process ``rank`` in a contiguous split
    of ``n`` entries (sizes differ by at most one)."""
    return range(n * rank // n_processes, n * (rank + 1) // n_processes)


class ScanView(IndexedView):
    """``(upper-left crop window (uint8), ok, message)`` of the entries
    ``indices`` of a list; an unreadable image gives zeros, ``ok = 0`` and
    its error."""

    def get_example(self, k):
        image, message = self._decode(int(self.indices[k]))
        crop = self.crop_size
        if image is None:
            return np.zeros((3, crop, crop), np.uint8), np.int8(0), message
        if image.shape[1] < crop or image.shape[2] < crop:
            return (np.zeros((3, crop, crop), np.uint8), np.int8(0),
                    'image {} of size {}x{} is smaller than the crop size {}'
                    .format(self.images.where(int(self.indices[k])),
                            image.shape[1], image.shape[2], crop))
        return np.ascontiguousarray(image[:, :crop, :crop]), np.int8(1), ''


class ScanResult:
    """What :func:`scan_images` found.

    Attributes
    ----------
    total : numpy.ndarray
        float64 ``(3, crop, crop)``: sum of the upper-left windows of the
        readable images.
    count : int
        Readable images.
    bad : list of (int, str)
        List index and error of every unreadable image.
    """

    def __init__(self, total, count, bad):
        self.total = total
        self.count = count
        self.bad = bad


def scan_images(images, indices, resize, crop_size, loaderjob=0,
                progress=None, batch_size=64):
    """Decode the entries ``indices`` of ``images``; sum and check them.

    Parameters
    ----------
    images : augment.ImageList
    indices : sequence of int
    resize, crop_size : int
        As in training: resize ignoring aspect, then the upper-left
        ``crop x crop`` window (the mean image of section 4.1).
    loaderjob : int
        Loader processes (0: decode here).
    progress : callable or None
        Called as ``progress(done, total, seconds)`` about every 10 s.
    batch_size : int
        Images per task of the loaders.

    Returns
    -------
    ScanResult
    """
    view = ScanView(images, indices, resize, crop_size)
    total = np.zeros((3, crop_size, crop_size), np.float64)
    count, bad, done = 0, [], 0
    if len(view) == 0:
        return ScanResult(total, 0, [])
    loader = make_loader(view, batch_size, loaderjob, repeat=False)
    start = last = time.perf_counter()
    try:
        for batch in loader:
            windows = [w for w, ok, _ in batch if ok]
            if windows:
                total += np.stack(windows).sum(axis=0, dtype=np.float64)
            for k, (_, ok, message) in enumerate(batch, done):
                if not ok:
                    bad.append((int(view.indices[k]), message))
            count += len(windows)
            done += len(batch)
            now = time.perf_counter()
            if progress is not None and now - last >= 10:
                progress(done, len(view), now - start)
                last = now
    finally:
        loader.finalize()
    return ScanResult(total, count, bad)
