"""The data path and start-up of ``train_imagenet.py``, before and after
issue 11.

    python -m benchmarks.data_path [--smoke] [--out FILE.json]
        [--images 256] [--list-lines 1281167]

On ImageNet-like JPEGs (500x375, written with Pillow, resized to 256,
cropped to 224):

* **images/s per core of the data path** in one process (one core;
  decoding and resizing dominate, alike in both):
  *before*, each image decoded to float32, cropped, flipped and normalised
  on the host and batched as float32 (``ImageTransform`` over the old
  float ``ImageListDataset``); *after*, decoded and cropped to uint8
  (:class:`augment.TrainStream`), batched as uint8 and normalised as a
  batch (on the training device in a GPU run; here the CPU). The bytes
  per image that cross from a loader process (and to the device) are
  reported as well (float32 vs uint8), and the training process's own
  work per batch of loader output.
* **the mixup label conversion** (integer labels to one-hot rows, 1000
  classes, batch 32): the old scatter with a min/max check against the
  vectorised comparison (on the CPU here; the old version's cost on a GPU
  came from its host-device synchronisations).
* **start-up**: the mean image, serially (the old rank-0 pass,
  :func:`augment.compute_mean`) and by :func:`augment.scan_images` with
  loader processes (per process of a run; processes split the list, so
  the time divides by their number too); reading an ImageNet-size list
  (``--list-lines`` entries), and the bytes rank 0 used to pickle and
  broadcast (``scatter_dataset`` of the list of tuples) against the
  compact list every process now reads itself.

Timings are medians of repeats within this run.
"""
import os
import pickle
import shutil
import sys
import tempfile
import time
from typing import Dict

import chainerkfac  # NOQA  (before chainer: NumPy-2 compatibility shims)
import chainer
import numpy

import augment
from benchmarks import _args
from benchmarks import _common

RESIZE, CROP, BATCH, N_CLASS = 256, 224, 32, 1000


def write_images(directory, n):
    from PIL import Image
    rng = numpy.random.RandomState(0)
    lines = []
    for i in range(n):
        pixels = rng.randint(0, 256, (375, 500, 3)).astype(numpy.uint8)
        # Smooth content compresses like a photo, unlike pure noise.
        pixels = (pixels // 4 + numpy.linspace(0, 190, 500)[None, :, None]
                  ).astype(numpy.uint8)
        name = '{}.JPEG'.format(i)
        Image.fromarray(pixels).save(os.path.join(directory, name),
                                     quality=90)
        lines.append('{} {}\n'.format(name, i % N_CLASS))
    path = os.path.join(directory, 'train.txt')
    with open(path, 'w') as f:
        f.writelines(lines)
    return path


def _timed(function, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return _common.median(times)


def data_path(images, mean, n, repeats) -> Dict:
    """images/s of the old float path and the new uint8 path, one core."""
    transform = augment.ImageTransform(mean, CROP, train=True, seed=0)
    stream = augment.TrainStream(images, RESIZE, CROP, 0, 1, 0, BATCH)

    def before():
        for start in range(0, n, BATCH):
            examples = []
            for i in range(start, min(start + BATCH, n)):
                image = augment.load_image(images.path(i), RESIZE).astype(
                    numpy.float32)
                examples.append(transform((image, images.labels[i])))
            chainer.dataset.concat_examples(examples)

    def after():
        for start in range(0, n, BATCH):
            batch = [stream[k] for k in range(start, min(start + BATCH, n))]
            x = numpy.stack([image for image, _, _ in batch])
            augment.normalize(x, mean)
    # Alternate the two (the machine is shared): medians of each.
    times = {'before': [], 'after': []}
    for _ in range(repeats):
        for name, function in (('before', before), ('after', after)):
            times[name].append(_timed(function, 1))
    out = {}
    for name in ('before', 'after'):
        out[name] = {'images_per_s_per_core': n / _common.median(times[name]),
                     'bytes_per_image_between_processes':
                     3 * CROP * CROP * (4 if name == 'before' else 1)}
    out['after_over_before'] = _common.median(
        [b / a for b, a in zip(times['before'], times['after'])])
    # What the training process does per batch with the loaders' examples:
    # before, batch float32 crops (then send 4 bytes per value to the
    # device); after, batch uint8 crops and normalise them (on the device
    # in a GPU run).
    floats = [(numpy.zeros((3, CROP, CROP), numpy.float32), 0)] * BATCH
    uint8s = [(numpy.zeros((3, CROP, CROP), numpy.uint8), 0)] * BATCH
    out['before']['training_process_ms_per_batch'] = 1e3 * _timed(
        lambda: chainer.dataset.concat_examples(floats), repeats * 5)
    out['after']['training_process_ms_per_batch'] = 1e3 * _timed(
        lambda: augment.normalize(chainer.dataset.concat_examples(uint8s)[0],
                                  mean), repeats * 5)
    return out


def _old_labels_as_distributions(t, n_class):
    """The conversion before issue 11 (kept here to measure it)."""
    if t.size and (int(t.min()) < 0 or int(t.max()) >= n_class):
        raise ValueError
    y = numpy.zeros((len(t), n_class), dtype=numpy.float32)
    y[numpy.arange(len(t)), t] = 1
    return y


def mixup_labels(repeats) -> Dict:
    t = numpy.random.RandomState(0).randint(0, N_CLASS, BATCH).astype(
        numpy.int32)
    mixup = augment.RunningMixup(0.4, N_CLASS)
    new = mixup._labels_as_distributions(numpy, t, BATCH)
    numpy.testing.assert_array_equal(new, _old_labels_as_distributions(
        t, N_CLASS))
    loops = 200
    return {
        'before_ms': 1e3 * _timed(lambda: [_old_labels_as_distributions(
            t, N_CLASS) for _ in range(loops)], repeats) / loops,
        'after_ms': 1e3 * _timed(lambda: [mixup._labels_as_distributions(
            numpy, t, BATCH) for _ in range(loops)], repeats) / loops,
        'device': 'cpu'}


def startup(images, n, list_lines, directory, repeats) -> Dict:
    dataset = augment.ImageListDataset(images, resize=RESIZE)
    serial_s = _timed(lambda: augment.compute_mean(dataset, CROP), 1)
    out = {'mean_serial_s_per_image': serial_s / n}
    for loaderjob in (0, 2):
        seconds = _timed(lambda: augment.scan_images(
            images, range(n), RESIZE, CROP, loaderjob), 1)
        out['mean_scan_loaderjob{}_s_per_image'.format(loaderjob)] = \
            seconds / n
    # An ImageNet-size list (the files need not exist to read it).
    path = os.path.join(directory, 'big.txt')
    with open(path, 'w') as f:
        for i in range(list_lines):
            f.write('train/n{:08d}/n{:08d}_{}.JPEG {}\n'.format(
                i % 1000, i % 1000, i, i % 1000))
    read_s = _timed(lambda: augment.read_image_list(
        path, '/data/imagenet', check_files=False, n_class=N_CLASS), repeats)
    listed = augment.read_image_list(path, '/data/imagenet',
                                     check_files=False)
    old_payload = [(listed.path(i), int(listed.labels[i]))
                   for i in range(len(listed))]
    start = time.perf_counter()
    old_bytes = len(pickle.dumps(old_payload))
    old_pickle_s = time.perf_counter() - start
    out.update({
        'list_lines': list_lines, 'list_read_s': read_s,
        'old_broadcast_pickle_bytes': old_bytes,
        'old_broadcast_pickle_s': old_pickle_s,
        'loader_list_pickle_bytes': len(pickle.dumps(listed)),
    })
    return out


def main(argv=None):
    parser = _common.argument_parser('benchmarks.data_path', __doc__)
    parser.add_argument('--smoke', action='store_true',
                        help='32 images, a 10000-line list, one repeat '
                             '(overrides --images, --list-lines and '
                             '--repeats)')
    parser.add_argument('--out', default='result/data_path.json',
                        help='JSON output (default: %(default)s)')
    parser.add_argument('--images', type=_args.positive_int, default=256,
                        help='synthetic 500x375 JPEGs to decode (default: '
                             '%(default)s)')
    parser.add_argument('--list-lines', type=_args.positive_int,
                        default=1281167,
                        help='entries of the image list whose reading is '
                             "timed (default: %(default)s, ImageNet's "
                             'training set)')
    parser.add_argument('--repeats', type=_args.positive_int, default=3,
                        help='timed passes of each measurement; the '
                             'figures are their medians (default: '
                             '%(default)s)')
    args = parser.parse_args(argv)
    _args.check_paths(parser, args)
    n = 32 if args.smoke else args.images
    lines = 10000 if args.smoke else args.list_lines
    repeats = 1 if args.smoke else args.repeats
    data = _common.header('data_path', sys.argv[1:] if argv is None
                          else argv)
    directory = tempfile.mkdtemp(prefix='data_path_bench.')
    try:
        with _common.limit_blas_threads(1):
            images = augment.read_image_list(write_images(directory, n),
                                             directory)
            mean = augment.compute_mean(
                augment.ImageListDataset(images, resize=RESIZE), CROP)
            result = {'images': n, 'resize': RESIZE, 'crop': CROP,
                      'batch': BATCH,
                      'data_path': data_path(images, mean, n, repeats),
                      'mixup_labels': mixup_labels(repeats),
                      'startup': startup(images, n, lines, directory,
                                         repeats)}
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    data['results'] = [result]
    print(_common.describe_machine(data))
    path, labels, start = (result['data_path'], result['mixup_labels'],
                           result['startup'])
    print(_common.format_table(
        ['', 'before', 'after'],
        [['data path images/s per core', path['before']
          ['images_per_s_per_core'], path['after']['images_per_s_per_core']],
         ['training process ms per batch (batching; after: + normalise)',
          path['before']['training_process_ms_per_batch'],
          path['after']['training_process_ms_per_batch']],
         ['bytes per image between processes (and to the device)',
          path['before']['bytes_per_image_between_processes'],
          path['after']['bytes_per_image_between_processes']],
         ['mixup labels ms per batch (CPU)', labels['before_ms'],
          labels['after_ms']],
         ['mean image ms per image (0 / 2 loaders)',
          1e3 * start['mean_serial_s_per_image'],
          '{:.3g} / {:.3g}'.format(
              1e3 * start['mean_scan_loaderjob0_s_per_image'],
              1e3 * start['mean_scan_loaderjob2_s_per_image'])],
         ['list of {} lines: MB pickled by rank 0 / per loader'.format(
             start['list_lines']), start['old_broadcast_pickle_bytes'] / 1e6,
          start['loader_list_pickle_bytes'] / 1e6]]))
    print('reading the list: {:.2f} s per process'.format(
        start['list_read_s']))
    _common.write_json(args.out, data)
    print('wrote', args.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())
