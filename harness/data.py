"""Start-up of the data: lists, checks, mean image — in parallel over the
processes, every error raised once and before training.

* Every process reads the list files itself (no pickled broadcast) and
  checks every label against the number of classes; each checks that its
  share of the listed files exists.
* The mean image (section 4.1: the per-pixel mean of the upper-left crop
  window of the resized training images) is computed by all processes over
  their shares of the list, with their loader processes, and summed: it
  equals the serial mean bit for bit. The output path is checked first. We
  keep the paper's full mean image as the default rather than a per-channel
  ImageNet mean: it is what the paper subtracts, and the parallel pass costs
  ``N × 5 ms / (processes × loaders)`` once (the file is reused by later
  runs and by ``--mean``).
* The validation images are always decoded up front the same way (an
  unreadable one would stop the run after its first epoch of training);
  ``--check-images`` decodes every training image too (the mean pass
  already does) and reports every unreadable file of both lists at once.
  With ``--skip-bad-images`` those found are left out of the lists
  instead. Without ``--check-images``, an unreadable training image met
  in training stops the run naming it, or with ``--skip-bad-images`` is
  replaced by the next image of the epoch's order and counted in the
  log.
"""
import os
import sys
import time

import numpy

import augment
from harness.mpi import raise_together
from harness.run_dir import BAD_IMAGES_FILE, MEAN_FILE


class Data:
    """The lists and the mean image of a run.

    Attributes
    ----------
    train, val : augment.ImageList
    mean : numpy.ndarray
        float32 ``(3, crop, crop)``.
    """

    def __init__(self, train, val, mean):
        self.train = train
        self.val = val
        self.mean = mean


def _say(comm, message):
    if comm.rank == 0:
        print(message, flush=True)


def read_lists(train_path, val_path, root, n_class, comm):
    """Both lists, read by every process, labels checked; each process
    checks that its share of the files exists.

    Raises
    ------
    ValueError, FileNotFoundError
        Once (rank 0), naming the list file and line.
    """
    start = time.perf_counter()
    lists, error = [], None
    try:
        for path in (train_path, val_path):
            lists.append(augment.read_image_list(path, root,
                                                 check_files=False,
                                                 n_class=n_class))
    except (OSError, ValueError) as e:
        error = e
    if error is None:
        error = _too_short(lists, (train_path, val_path), comm.size)
    raise_together(comm, error)
    for images in lists:
        mine = images.missing_files(augment.share(len(images), comm.size,
                                                  comm.rank))
        missing = sorted(sum(comm.mpi_comm.allgather(mine), []))
        raise_together(comm, images.missing_files_error(missing)
                       if missing else None)
    _say(comm, 'read {} ({} image(s)) and {} ({} image(s)), {} classes, in '
               '{:.1f} s'.format(train_path, len(lists[0]), val_path,
                                 len(lists[1]), n_class,
                                 time.perf_counter() - start))
    return lists


def _too_short(lists, paths, n_processes):
    """The error of a list too short to run on (None if none is): an
    empty training list; a validation list with fewer images than
    processes, each of which evaluates a share of it (a process with none
    would fail at the first evaluation, after an epoch of training)."""
    (train, val), (train_path, val_path) = lists, paths
    if not len(train):
        return ValueError('the training list {} is empty'.format(
            train_path))
    if len(val) < n_processes:
        return ValueError(
            'the validation list {} has {} image{}, fewer than the {} '
            'processes: each evaluates a share of it (give it at least {})'
            .format(val_path, len(val), '' if len(val) == 1 else 's',
                    n_processes, n_processes))
    return None


def _scan(images, what, resize, crop, loaderjob, comm):
    """Every process scans its share; returns (sum, count, bad) of all."""
    indices = augment.share(len(images), comm.size, comm.rank)
    start = time.perf_counter()

    def progress(done, total, seconds):
        print('  {}: {}/{} images of rank 0\'s share, {:.0f} s'.format(
            what, done, total, seconds), flush=True)
    _say(comm, '{}: decoding {} images on {} process(es), {}'.format(
        what, len(images), comm.size, '{} loader process(es) each'.format(
            loaderjob) if loaderjob else 'in the training processes'))
    result = augment.scan_images(images, indices, resize, crop, loaderjob,
                                 progress if comm.rank == 0 else None)
    total = comm.mpi_comm.allreduce(result.total)
    count = comm.mpi_comm.allreduce(result.count)
    bad = sorted(sum(comm.mpi_comm.allgather(result.bad), []))
    _say(comm, '{}: done in {:.1f} s, {} unreadable'.format(
        what, time.perf_counter() - start, len(bad)))
    return total, count, bad


def _bad_images_error(images, bad, out, comm):
    """Write every bad file to ``out/bad_images.txt``; the error to raise."""
    path = os.path.join(out, BAD_IMAGES_FILE)
    if comm.rank == 0:
        with open(path, 'a') as f:
            f.writelines(message + '\n' for _, message in bad)
    shown = [message for _, message in bad[:10]]
    return OSError(
        '{} unreadable image(s) in {} (all listed in {}):\n  {}{}\nfix or '
        'remove them, or pass --skip-bad-images to leave them out; run again '
        'with --overwrite (this run left {} in {})'.format(
            len(bad), images.list_path, path, '\n  '.join(shown),
            '\n  ...' if len(bad) > 10 else '', BAD_IMAGES_FILE, out))


def _drop_bad(images, bad, out, comm):
    if bad:
        path = os.path.join(out, BAD_IMAGES_FILE)
        if comm.rank == 0:
            with open(path, 'a') as f:
                f.writelines(message + '\n' for _, message in bad)
        _say(comm, '--skip-bad-images: {} unreadable image(s) of {} left out '
                   '(listed in {})'.format(len(bad), images.list_path, path))
        images = images.without([i for i, _ in bad])
    return images


def mean_image(images, path, resize, crop, loaderjob, comm, skip_bad, out,
               raise_bad=True):
    """The mean image at ``path``, computed (and saved there) if missing.

    Returns
    -------
    (numpy.ndarray or None, list or None)
        The mean, and the unreadable images found by the pass (None where
        the mean was read). Without ``skip_bad`` they raise, or with
        ``raise_bad=False`` come back with no mean (none saved): the
        caller reports them with those of other lists.
    """
    if os.path.exists(path):
        error = None
        try:
            mean = augment.load_mean(path, crop)
        except (OSError, ValueError) as e:
            error, mean = e, None
        raise_together(comm, error)
        return mean, None
    error = None
    if comm.rank == 0:
        try:
            augment.check_writable(path)
        except OSError as e:
            error = e
    raise_together(comm, error)
    total, count, bad = _scan(images, 'mean image -> ' + path, resize, crop,
                              loaderjob, comm)
    if bad and not skip_bad:
        if not raise_bad:
            return None, bad
        raise_together(comm, _bad_images_error(images, bad, out, comm))
    if count == 0:
        raise_together(comm, ValueError('no readable image in {}'.format(
            images.list_path)))
    mean = (total / count).astype(numpy.float32)
    if comm.rank == 0:
        augment.save_mean(path, mean)
    comm.mpi_comm.Barrier()
    return mean, bad


def prepare(args, comm, out, n_class, loaderjob):
    """Lists, checks and mean image of a run (see the module docstring).

    Returns
    -------
    Data
    """
    train, val = read_lists(args.train, args.val, args.root, n_class, comm)
    crop, resize = args.crop_size, args.resize
    mean_path = args.mean or os.path.join(out, MEAN_FILE)
    mean, train_bad = mean_image(train, mean_path, resize, crop, loaderjob,
                                 comm, args.skip_bad_images, out,
                                 raise_bad=not args.check_images)
    if args.check_images and train_bad is None:
        train_bad = _scan(train, 'checking ' + args.train, resize, crop,
                          loaderjob, comm)[2]
    # The validation images always (a few % of the training set's): an
    # unreadable one stopped the run after its first epoch's training,
    # before that epoch's snapshot.
    val_bad = _scan(val, 'checking ' + args.val, resize, crop, loaderjob,
                    comm)[2]
    checked = ((train, train_bad),) if args.check_images else ()
    if not args.skip_bad_images:
        errors = [_bad_images_error(images, bad, out, comm)
                  for images, bad in checked + ((val, val_bad),) if bad]
        if errors:
            raise_together(comm, OSError('\n'.join(map(str, errors))))
    if args.check_images:
        # Known now: left out, rather than replaced when met in training.
        train = _drop_bad(train, train_bad, out, comm)
    val = _drop_bad(val, val_bad, out, comm)
    sys.stdout.flush()
    return Data(train, val, mean)
