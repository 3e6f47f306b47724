"""Snapshots written in the background, never half-written, a few kept; and
resuming from them on the same or another number of processes.

Writing
-------
:func:`snapshot_extension` is Chainer's own ``extensions.snapshot`` (its
``n_retains`` removes older snapshots) with :class:`AtomicThreadWriter`, a
``ThreadWriter`` that

* copies the serialized arrays before returning to the training loop —
  parameters, momentum and factors are updated in place, and a background
  thread must not write arrays the next steps are changing;
* waits for the previous write first, so two writes never overlap;
* writes uncompressed (zlib cost 38 CPU-seconds per GB for a 16 % saving)
  to a hidden temporary file, fsyncs it and renames it into place, so a
  snapshot file is either complete or absent;
* re-raises a failed background write in the training loop.

Resuming
--------
:func:`snapshot_files` finds the files of one snapshot (one per process of
the run that wrote it). :func:`restore` loads process ``r``'s file into
its trainer (for another number of processes, file ``r mod P_old``), then,
if the number of processes changed, the optimizer state and the running
mixup streams of every other file: K-FAC's factors are per owner of a
block, and ``load_npz(..., strict=False)`` merges them (keys absent from a
file leave the optimizer's values alone); the optimizer re-assigns blocks
to the new processes. The data stream's position is global
(:class:`augment.GlobalBatchIterator`), so the run continues at the same
sample with ``acc_iters`` re-derived for the new number of processes.
"""
import functools
import os
import re
import time

import numpy
from chainer.serializers import npz
from chainer.training import extensions
from chainer.training.extensions import snapshot_writers

#: File name of process ``rank``'s snapshot after epoch ``epoch``.
SNAPSHOT_NAME = 'snapshot_epoch_{epoch}.rank{rank}'
_SNAPSHOT_RE = re.compile(r'snapshot_epoch_(\d+)\.rank(\d+)')
#: Key of the number of processes that wrote a snapshot.
N_PROCESSES_KEY = 'updater/n_processes'


class AtomicThreadWriter(snapshot_writers.ThreadWriter):
    """Chainer's ``ThreadWriter``, writing a consistent copy atomically.

    Parameters
    ----------
    compression : bool
        zlib-compress the npz (Chainer's default; slow for little gain).
    savefun : callable or None
        ``savefun(file, dict_of_arrays)`` writing to an open binary file
        (default: ``chainer.serializers.save_npz``).

    Attributes
    ----------
    last_blocked_seconds : float
        Time the last call kept the training loop (waiting for the
        previous write, copying the arrays).
    """

    def __init__(self, compression=False, savefun=None):
        super().__init__(savefun=savefun or functools.partial(
            npz.save_npz, compression=compression))
        self.last_blocked_seconds = 0.0
        self._error = None

    def __call__(self, filename, outdir, target):
        start = time.perf_counter()
        self._wait()
        # A consistent copy, taken now: the arrays are references to the
        # live parameters and optimizer state (DictionarySerializer copies
        # only device arrays, to the host).
        target = {key: numpy.array(value, copy=True)
                  if isinstance(value, numpy.ndarray) else value
                  for key, value in target.items()}
        super().__call__(filename, outdir, target)
        self.last_blocked_seconds = time.perf_counter() - start

    def _wait(self):
        if self._started:
            self._worker.join()
            self._started = False
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError('writing a snapshot failed: {}'.format(
                error)) from error

    def save(self, filename, outdir, target, savefun, **kwds):
        """Runs in the writer thread: temporary file, fsync, rename."""
        path = os.path.join(outdir, filename)
        tmp = os.path.join(outdir, '.{}.tmp'.format(filename))
        try:
            with open(tmp, 'wb') as f:
                savefun(f, target)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_directory(outdir)
            self._post_save()
        except BaseException as error:
            self._error = error
            if os.path.exists(tmp):
                os.unlink(tmp)

    def finalize(self):
        super().finalize()
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError('writing a snapshot failed: {}'.format(
                error)) from error


def _fsync_directory(directory):
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def snapshot_extension(rank, keep, compression=False):
    """Chainer's snapshot extension of this process's trainer.

    Parameters
    ----------
    rank : int
    keep : int
        Snapshots kept per process (older ones are removed after each
        write); 0 keeps all.
    compression : bool
    """
    filename = SNAPSHOT_NAME.format(epoch='{.updater.epoch}', rank=rank)
    return extensions.snapshot(
        filename=filename, writer=AtomicThreadWriter(compression),
        n_retains=keep if keep > 0 else -1)


def remove_unfinished(out, rank):
    """Remove this process's temporary snapshot files left by a killed
    run (a snapshot being written when the process died)."""
    pattern = re.compile(r'\.snapshot_epoch_\d+\.rank{}\.tmp'.format(rank))
    if os.path.isdir(out):
        for name in os.listdir(out):
            if pattern.fullmatch(name):
                os.remove(os.path.join(out, name))


def save_npz_atomic(path, obj, compression=False):
    """``chainer.serializers.save_npz`` to a temporary file renamed into
    place when complete (e.g. ``model_final.npz``)."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, '.{}.tmp'.format(os.path.basename(path)))
    try:
        with open(tmp, 'wb') as f:
            npz.save_npz(f, obj, compression=compression)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# -- resuming --------------------------------------------------------------------------
def _read_n_processes(path):
    try:
        with numpy.load(path) as data:
            return int(data[N_PROCESSES_KEY])
    except KeyError:
        raise ValueError('{} holds no {!r}: not a snapshot of this version of '
                         'train_imagenet.py'.format(path, N_PROCESSES_KEY)) \
            from None


def snapshot_files(prefix):
    """The files of one snapshot, by rank of the run that wrote it.

    Parameters
    ----------
    prefix : str
        ``<out>/snapshot_epoch_<E>`` (files ``<prefix>.rank<r>``).

    Returns
    -------
    list of str

    Raises
    ------
    FileNotFoundError
        No file, or some of the writing run's processes' files missing
        (named).
    """
    directory, base = os.path.split(os.path.abspath(prefix))
    pattern = re.compile(re.escape(base) + r'\.rank(\d+)')
    found = {}
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            match = pattern.fullmatch(name)
            if match:
                found[int(match.group(1))] = os.path.join(directory, name)
    if not found:
        raise FileNotFoundError('no snapshot {}.rank0 (nor any .rankR)'.format(
            prefix))
    n = _read_n_processes(found[min(found)])
    missing = [r for r in range(n) if r not in found]
    if missing:
        raise FileNotFoundError(
            'snapshot {} was written by {} processes but the files of rank(s) '
            '{} are missing'.format(prefix, n,
                                    ', '.join(map(str, missing))))
    return [found[r] for r in range(n)]


def latest_snapshot(out):
    """Prefix of the newest complete snapshot in ``out``, or ``None``."""
    if not os.path.isdir(out):
        return None
    epochs = set()
    for name in os.listdir(out):
        match = _SNAPSHOT_RE.fullmatch(name)
        if match:
            epochs.add(int(match.group(1)))
    for epoch in sorted(epochs, reverse=True):
        prefix = os.path.join(out, 'snapshot_epoch_{}'.format(epoch))
        try:
            snapshot_files(prefix)
        except (FileNotFoundError, ValueError):
            continue
        return prefix
    return None


def check_model_keys(path, model, key='updater/model:main'):
    """Raise :class:`ValueError` naming the parameters of ``model`` absent
    from the snapshot ``path`` (another model, or not a trainer snapshot):
    the rest of the snapshot is loaded leniently."""
    with numpy.load(path) as data:
        keys = set(data.files)
    missing = [name for name, _ in model.namedparams()
               if key + name not in keys]
    if missing:
        raise ValueError('snapshot {} lacks {} of the model\'s {} parameters '
                         '({}{}): a snapshot of another model?'.format(
                             path, len(missing),
                             len(list(model.namedparams())),
                             ', '.join(missing[:3]),
                             ', ...' if len(missing) > 3 else ''))


def restore(trainer, files, rank, n_processes, optimizer=None, mixup=None):
    """Load a snapshot into this process's trainer.

    Parameters
    ----------
    trainer : chainer.training.Trainer
    files : list of str
        From :func:`snapshot_files`.
    rank, n_processes : int
        Of this run.
    optimizer : chainer.Optimizer or None
        Whose state is merged from every file when the number of processes
        changed (K-FAC: factors are saved by their owners).
    mixup : object with ``serialize`` or None
        The updater's mixup streams, likewise merged.

    Returns
    -------
    str
        The file loaded whole.
    """
    own = files[rank % len(files)]
    check_model_keys(own, trainer.updater.get_optimizer('main').target)
    # Lenient: with the lean K-FAC state a file lacks the blocks its process
    # did not own; the model's keys were checked above.
    npz.load_npz(own, trainer, strict=False)
    if len(files) != n_processes:
        for path in files:
            if path == own:
                continue
            if optimizer is not None:
                npz.load_npz(path, optimizer, path='updater/optimizer:main/',
                             strict=False)
            if mixup is not None:
                npz.load_npz(path, mixup, path='updater/mixup/', strict=False)
    return own
