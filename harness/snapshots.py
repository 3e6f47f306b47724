"""Snapshots written in the background, never half-written, a few kept.

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
* re-raises a failed background write in the training loop;
* keeps the newest ``keep`` snapshots that every process has written
  whole (:func:`agree` counts each process's finished writes), and any
  newer one still being confirmed: removed as each process's own write
  ended (Chainer's ``n_retains``), a slow or failed write on one process
  with a fast one elsewhere left no snapshot whole on every process (with
  the default of 2 kept, rank 0 held steps 3 and 4, rank 1 steps 1 and 2).

Resuming from the files is :mod:`harness.resume`.
"""
import functools
import os
import re
import shutil
import sys
import time

import numpy
from chainer.serializers import npz
from chainer.training import extensions
from chainer.training.extensions import _snapshot, snapshot_writers

from chainerkfac import serializers
from harness.mpi import raise_together

#: Prefix of ``train_imagenet.py``'s snapshot after optimizer step ``step``
#: (files ``<prefix>.rank<r>``): steps are global mini-batches, the same on
#: any number of processes, so names sort in the order of the run,
#: mid-epoch or not, and never collide.
SNAPSHOT_PREFIX = 'snapshot_step_{step}'
SNAPSHOT_RE = re.compile(r'snapshot_step_(\d+)\.rank(\d+)')
#: :func:`snapshot_extension`'s name of the snapshot of
#: :class:`harness.updater.AugmentedUpdater` (its ``steps``), and of
#: another trainer's (after its ``epoch``).
STEP_NAME = SNAPSHOT_PREFIX.format(step='{.updater.steps}')
EPOCH_NAME = 'snapshot_epoch_{.updater.epoch}'
#: Key of the number of processes that wrote a snapshot.
N_PROCESSES_KEY = 'updater/n_processes'


class SnapshotWriteError(OSError):
    """A snapshot that could not be written; the message names the file,
    the bytes it needed and the cause."""


def npz_bytes(target):
    """Bytes of the uncompressed ``.npz`` of ``target`` (``{key: array}``):
    each array's data and ``.npy`` header, and the zip's two entries per
    member (local header and central directory, with Zip64 extras)."""
    total = 22                          # end of central directory record
    for key, value in target.items():
        array = numpy.asarray(value)
        # A pickled None (what Chainer saves for an absent value) or an
        # array's bytes, after a 128-byte .npy header.
        data = 160 if array.dtype.hasobject else array.nbytes
        name = len(key.encode('utf-8')) + len('.npy')
        total += 128 + data + 2 * name + 100
    return total


def _free_bytes(directory):
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return None


def _size(n):
    return '{:,} bytes ({:.1f} MB)'.format(n, n / 1e6)


class AtomicThreadWriter(snapshot_writers.ThreadWriter):
    """Chainer's ``ThreadWriter``, writing a consistent copy atomically and
    keeping a failure for the training loop to stop on.

    Parameters
    ----------
    compression : bool
        zlib-compress the npz (Chainer's default; slow for little gain).
    savefun : callable or None
        ``savefun(file, dict_of_arrays)`` writing to an open binary file
        (default: ``chainer.serializers.save_npz``).
    facts : dict or None
        ``{name: str or number}`` saved in every snapshot under ``run/``
        (what wrote it: the ``--optimizer``).

    Attributes
    ----------
    last_blocked_seconds : float
        Time the last call kept the training loop (waiting for the
        previous write, copying the arrays).
    failure : SnapshotWriteError or None
        The last write's failure, until taken (:meth:`take_failure`).
    unconfirmed : bool
        A write was started and its end not yet seen by :func:`agree`.
    """

    def __init__(self, compression=False, savefun=None, facts=None):
        super().__init__(savefun=savefun or functools.partial(
            npz.save_npz, compression=compression))
        self.compression = compression
        self.facts = {'run/' + name: numpy.asarray(value)
                      for name, value in (facts or {}).items()}
        self.last_blocked_seconds = 0.0
        self.failure = None
        self.unconfirmed = False
        self._needed = 0
        #: The files this writer wrote whole, in order (the writer thread
        #: appends); the snapshots kept (:meth:`retain`) and those every
        #: process has written (:meth:`remove_stale`).
        self.written = []
        self._keep = 0
        self._pattern = None
        self._outdir = None
        self._confirmed = 0

    def retain(self, pattern: str, keep: int) -> None:
        """Keep the newest ``keep`` snapshots (0: all) whose names match
        ``pattern`` (a name format, matched by its text before the first
        ``{`` and after the last ``}``, as Chainer's ``n_retains``)."""
        self._pattern, self._keep = pattern, int(keep)

    def __call__(self, filename, outdir, target):
        start = time.perf_counter()
        self._outdir = outdir
        self.join()                 # never two writes at once
        if self.failure is not None:
            # Nothing stopped the loop on it (a trainer without
            # :class:`WriteCheck`): stop it now.
            raise self.take_failure()
        # A consistent copy, taken now: the arrays are references to the
        # live parameters and optimizer state (DictionarySerializer copies
        # only device arrays, to the host). Values that were None are left
        # out rather than pickled: snapshots load with pickle off.
        target = {key: numpy.array(value, copy=True)
                  if isinstance(value, numpy.ndarray) else value
                  for key, value in serializers.without_none(target).items()}
        target.update(self.facts)
        self._needed = npz_bytes(target)
        self.unconfirmed = True
        free = _free_bytes(outdir)
        # Compressed, the size is known only once written.
        if not self.compression and free is not None and \
                self._needed > free:
            self.failure = SnapshotWriteError(
                'not enough space for snapshot {}: it needs {}, {} are free '
                'on {} (older snapshots are removed only after a new one is '
                'whole)'.format(os.path.join(outdir, filename),
                                _size(self._needed), '{:,} bytes'.format(free),
                                os.path.abspath(outdir)))
        else:
            super().__call__(filename, outdir, target)
        self.last_blocked_seconds = time.perf_counter() - start

    def join(self):
        """Wait for the write in progress, if any."""
        if self._started:
            self._worker.join()
            self._started = False

    @property
    def busy(self):
        """Whether a write is in progress."""
        return self._started and self._worker.is_alive()

    def take_failure(self):
        """The failure not yet reported (and forget it), or ``None``."""
        failure, self.failure = self.failure, None
        return failure

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
            # the older snapshots go once every process's write is whole
            # (:meth:`remove_stale`, from :func:`agree`)
            self.written.append(filename)
        except BaseException as error:
            if os.path.exists(tmp):
                os.unlink(tmp)
            free = _free_bytes(outdir)
            failure = SnapshotWriteError(
                'writing snapshot {} failed: {} (it needed {}{})'.format(
                    path, error, _size(self._needed), '' if free is None
                    else '; {:,} bytes are free on {}'.format(
                        free, os.path.abspath(outdir))))
            failure.__cause__ = error
            self.failure = failure

    def finalize(self):
        """Wait for the last write; its failure is left to :func:`finish`
        (all processes agree on it there)."""
        self.join()

    def remove_stale(self, confirmed: int) -> None:
        """Remove the snapshots past the newest ``keep`` of those every
        process has written (this writer's first ``confirmed`` files, and
        any older ones in the directory: a resumed run's), never one still
        being confirmed. A file that cannot be removed (a directory of the
        name) is said, not taken for a failed write."""
        if not self._keep or self._outdir is None or \
                confirmed <= self._confirmed:
            return
        self._confirmed = confirmed
        pending = set(self.written[confirmed:])
        try:
            # Chainer's own match of n_retains: by the name format's text
            # around its fields, oldest first by mtime
            dated = [(t, n) for t, n in _snapshot._find_snapshot_files(
                self._pattern, self._outdir) if n not in pending]
        except OSError as error:
            dated = []
            _say_not_removed(error)
        for _, name in dated[:max(len(dated) - self._keep, 0)]:
            try:
                os.remove(os.path.join(self._outdir, name))
            except OSError as error:
                _say_not_removed(error)


class WriteCheck:
    """A trainer extension (every iteration, after the snapshot): stop the
    run on every process as soon as any process's snapshot write failed,
    rather than at the next snapshot. Only while a write is unconfirmed
    does it communicate (one small ``allgather`` per iteration).

    Parameters
    ----------
    writer : AtomicThreadWriter
    comm : ChainerMN communicator
    """

    #: After Chainer's snapshot extension (-100) in the same iteration.
    priority = -200

    def __init__(self, writer, comm):
        self.writer = writer
        self.comm = comm

    def __call__(self, trainer):
        if self.writer.unconfirmed:
            agree(self.comm, self.writer)


def agree(comm, writer):
    """Raise :class:`SnapshotWriteError` on every process if any process's
    write failed (once, on rank 0, see :func:`harness.mpi.raise_together`);
    once every process's write has ended well, the writer is confirmed."""
    busy = writer.busy      # before the failure: a write ended is final
    states = comm.mpi_comm.allgather((busy, writer.failure is not None,
                                      len(writer.written)))
    if any(failed for _, failed, _ in states):
        writer.unconfirmed = False
        raise_together(comm, writer.take_failure())
    # every process's first n writes are whole: older snapshots may go
    writer.remove_stale(min(written for _, _, written in states))
    if not any(b for b, _, _ in states):
        writer.unconfirmed = False


def finish(comm, writer):
    """The end of a run: wait for the last write, then :func:`agree`."""
    writer.join()
    agree(comm, writer)


def _say_not_removed(error):
    print('warning: an older snapshot could not be removed: {}'.format(
        error), file=sys.stderr, flush=True)


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


def snapshot_extension(rank, keep, writer, name=EPOCH_NAME):
    """Chainer's snapshot extension of process ``rank``'s trainer.

    Parameters
    ----------
    rank : int
    keep : int
        Snapshots kept per process (older ones are removed after each
        write); 0 keeps all.
    writer : AtomicThreadWriter
    name : str
        The file name before ``.rank<rank>``, a format of the trainer
        (:data:`STEP_NAME`, :data:`EPOCH_NAME`).
    """
    filename = name + '.rank{}'.format(rank)
    # the writer keeps them (not Chainer's n_retains: it removed as each
    # process's own write ended)
    writer.retain(filename, keep if keep > 0 else 0)
    return extensions.snapshot(filename=filename, writer=writer)


def extend_trainer(trainer, comm, writer, rank, keep, trigger,
                   name=EPOCH_NAME):
    """Add this process's snapshots to its trainer: the
    :func:`snapshot_extension` at ``trigger``, and :class:`WriteCheck`.
    (At the end of the run, call :func:`finish`.)

    Parameters
    ----------
    trainer : chainer.training.Trainer
    comm : ChainerMN communicator
    writer : AtomicThreadWriter
    rank, keep, name
        As for :func:`snapshot_extension`.
    trigger
        When to snapshot.
    """
    trainer.extend(snapshot_extension(rank, keep, writer, name),
                   trigger=trigger)
    # A stateless trigger: nothing of the check is saved in snapshots.
    trainer.extend(WriteCheck(writer, comm), name='snapshot_write_check',
                   trigger=lambda trainer: True)


def remove_unfinished(out, rank):
    """Remove this process's temporary snapshot files left by a killed
    run (a snapshot being written when the process died)."""
    pattern = re.compile(r'\.snapshot_step_\d+\.rank{}\.tmp'.format(rank))
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
