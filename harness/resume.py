"""Starting from a snapshot: find it, check that it can be loaded, load it.

Finding
-------
A snapshot is one file per process of the run that wrote it, named by
the optimizer steps taken (:data:`harness.snapshots.SNAPSHOT_PREFIX`),
at an epoch's end or inside an epoch alike; :func:`snapshot_files` finds
them all from the prefix ``<out>/snapshot_step_<S>`` (any prefix: a
snapshot of an earlier version, ``snapshot_epoch_<E>``, is resumed by
naming it).

Checking
--------
Before anything is loaded or written, every file of the snapshot is read
whole (:func:`harness.snapshot_integrity.verify_file`: zip directory,
CRC-32 of every member, array sizes). ``--resume latest``
(:func:`latest_snapshot`) takes the newest snapshot whose files are all
there and all whole, and says which newer ones it skipped and why; an
explicitly named snapshot that is damaged is refused, naming the file and
the cause. In a run of several processes each process reads its share of
the files (:func:`find`). Then the files' keys and shapes are compared
with the run's model and optimizer (:func:`check_fit`,
:mod:`harness.snapshot_fit`).

Loading
-------
:func:`restore` loads process ``r``'s file into its trainer (for another
number of processes, file ``r mod P_old``), then, if the number of processes
changed, the optimizer state and the running mixup streams of every other
file: K-FAC's factors are per owner of a block, and ``load_npz(...,
strict=False)`` merges them (keys absent from a file leave the optimizer's
values alone); the optimizer re-assigns blocks to the new processes. The
data stream's position is global (:class:`augment.GlobalBatchIterator`), so
the run continues at the same sample with ``acc_iters`` re-derived for the
new number of processes.
"""
import datetime
import os
import re
import sys
import uuid

from chainerkfac import serializers
from chainerkfac.serializers import PickledArrayError
from chainerkfac.training import TimeToAccuracy
from harness import run_dir, snapshot_fit
from harness.mpi import raise_together
from harness.snapshot_integrity import (DAMAGE, DamagedSnapshotError,
                                        verify_file, verify_files)
from harness.snapshots import N_PROCESSES_KEY, SNAPSHOT_PREFIX, SNAPSHOT_RE

#: The fact of a snapshot saying its run sharded the update (written by
#: :mod:`harness.run` through the snapshot writer's facts).
SHARD_UPDATE_KEY = 'run/shard_update'
#: The id of the run a snapshot file belongs to (a resume continues it),
#: and the rank that wrote the file (since 2026-11-27, fifth session).
RUN_ID_KEY = 'run/id'
RANK_KEY = 'run/rank'
_RANK_OF_NAME = re.compile(r'\.rank(\d+)$')


def _read_n_processes(path):
    try:
        with serializers.open_npz(path) as data:
            return int(data[N_PROCESSES_KEY])
    except KeyError:
        raise ValueError('{} holds no {!r}: not a snapshot of this version of '
                         'train_imagenet.py'.format(path, N_PROCESSES_KEY)) \
            from None
    except PickledArrayError:
        raise
    except DAMAGE as error:
        raise DamagedSnapshotError(path, str(error)) from error


def snapshot_files(prefix):
    """The files of one snapshot, by rank of the run that wrote it.

    Parameters
    ----------
    prefix : str
        ``<out>/snapshot_step_<S>`` (files ``<prefix>.rank<r>``).

    Returns
    -------
    list of str

    Raises
    ------
    FileNotFoundError
        No file, or some of the writing run's processes' files missing
        (named).
    DamagedSnapshotError
        The lowest rank's file, which says how many processes wrote the
        snapshot, cannot be read.
    ValueError
        That file is not a snapshot of this harness.
    PickledArrayError
        That file holds an object array.
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


def candidates(out):
    """The snapshots in ``out``, newest first: ``[(prefix, files or the
    error of :func:`snapshot_files`)]``."""
    if not os.path.isdir(out):
        return []
    steps = set()
    for name in os.listdir(out):
        match = SNAPSHOT_RE.fullmatch(name)
        if match:
            steps.add(int(match.group(1)))
    out_list = []
    for step in sorted(steps, reverse=True):
        prefix = os.path.join(out, SNAPSHOT_PREFIX.format(step=step))
        try:
            out_list.append((prefix, snapshot_files(prefix)))
        except (OSError, ValueError) as error:
            out_list.append((prefix, error))
    return out_list


def warn(message):
    """Print a warning of the run (stderr, flushed)."""
    print('warning: ' + message, file=sys.stderr, flush=True)


def latest_snapshot(out, verify=verify_files, say=warn, found=None):
    """The newest snapshot in ``out`` whose files are all there and whole.

    Parameters
    ----------
    out : str
    verify : callable
        ``verify(files)`` → the :class:`DamagedSnapshotError` of the damaged
        ones and the :class:`PickledArrayError` of those with an object
        array (default: :func:`verify_files`, every file here).
    say : callable or None
        Told about every newer snapshot skipped, naming its damaged or
        missing files.
    found : list or None
        :func:`candidates` of ``out`` if already listed.

    Returns
    -------
    (str, list of str) or None
        Its prefix and files.

    Raises
    ------
    PickledArrayError
        A newer snapshot's file holds an object array: not damage, a file
        made to run code; refused rather than skipped.
    """
    for prefix, files in (candidates(out) if found is None else found):
        problems = [files] if isinstance(files, Exception) else verify(files)
        for problem in problems:
            if isinstance(problem, PickledArrayError):
                raise problem
        if not problems:
            return prefix, files
        if say is not None:
            say('--resume latest: skipping {}: {}'.format(
                os.path.basename(prefix), '; '.join(map(str, problems))))
    return None


def snapshot_directory(resume, out):
    """The directory of the snapshot ``--resume`` names: ``out`` for
    ``latest``, else the prefix's or file's directory (where the run that
    wrote it keeps its ``config.json``)."""
    if resume == 'latest':
        return out
    return os.path.dirname(os.path.abspath(resume))


def find(comm, resume, out):
    """The files of the snapshot ``--resume`` names (``'latest'``: the
    newest whole one in ``out``), checked by all processes together.

    Rank 0 lists the directory; every process verifies its share of each
    candidate's files; rank 0 warns about skipped snapshots. Raises (once,
    on rank 0) if there is none, or if the named one is incomplete or
    damaged, naming the files and the causes.

    Returns
    -------
    (str, list of str)
        The prefix and the files.
    """
    def verify(files):
        mine = verify_files(files[comm.rank::comm.size])
        every = comm.mpi_comm.allgather(mine)
        return sorted((e for share in every for e in share),
                      key=lambda e: files.index(e.path))

    listed = None
    if comm.rank == 0:
        if resume == 'latest':
            listed = candidates(out)
        else:
            try:
                listed = [(resume, snapshot_files(resume))]
            except (OSError, ValueError) as error:
                listed = [(resume, error)]
    listed = comm.mpi_comm.bcast(listed, root=0)
    if resume == 'latest':
        chosen, error = None, None
        try:
            chosen = latest_snapshot(out, verify, warn if comm.rank == 0
                                     else None, listed)
        except PickledArrayError as e:
            error = e
        if chosen is None and error is None:
            error = FileNotFoundError(
                '--resume latest: no complete, undamaged snapshot in {}'
                .format(out))
        raise_together(comm, error)
        return chosen
    [(prefix, files)] = listed
    error = files if isinstance(files, Exception) else None
    if error is None:
        damaged = verify(files)
        pickled = [e for e in damaged if isinstance(e, PickledArrayError)]
        if pickled:
            error = pickled[0]
        elif damaged:
            error = OSError('--resume {}: {}; resume from an earlier snapshot '
                            '(--resume latest takes the newest whole one)'
                            .format(prefix, '; '.join(map(str, damaged))))
    raise_together(comm, error)
    return prefix, files


def check_fit(comm, files, model, optimizer, optimizer_name,
              lars_momentum=None):
    """Refuse (once, on rank 0) a snapshot that does not fit the run's
    model or optimizer (:func:`harness.snapshot_fit.check`); each process
    reads the headers of its share of the files.

    Parameters
    ----------
    comm : ChainerMN communicator
    files : list of str
    model, optimizer
        The run's, freshly built and set up.
    optimizer_name : str
    lars_momentum : str, optional
    """
    error = None
    try:
        for path in files[comm.rank::comm.size]:
            snapshot_fit.check(path, model, optimizer, optimizer_name,
                               lars_momentum)
    except (OSError, ValueError) as e:
        error = e
    raise_together(comm, error)


def init_weights(comm, source, network):
    """Load the weights of ``source`` into ``network`` on every process
    (``--init-weights-from``: a new optimizer from a run's weights).

    Parameters
    ----------
    comm : ChainerMN communicator
    source : str
        A snapshot prefix (its rank 0 file is read), one file of a snapshot
        or a ``model_final.npz``.
    network : chainer.Link
        The bare network.

    Returns
    -------
    str
        The file read.
    """
    path, error = None, None
    if comm.rank == 0:
        try:
            path = source if os.path.isfile(source) else \
                snapshot_files(source)[0]
            verify_file(path)
        except (OSError, ValueError) as e:
            error = e
    raise_together(comm, error)
    path = comm.mpi_comm.bcast(path, root=0)
    try:
        snapshot_fit.load_weights(path, network)
    except (OSError, ValueError) as e:
        error = e
    raise_together(comm, error)
    return path


def restore(trainer, files, rank, n_processes, optimizer=None, mixup=None,
            sharded=False):
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
        changed (K-FAC: factors are saved by their owners), or when the
        snapshot or this run shards the update (velocities are saved by
        their owners, who may be others now).
    mixup : object with ``serialize`` or None
        The updater's mixup streams, merged when the number of processes
        changed.
    sharded : bool
        Whether this run shards the update (``--shard-update``).

    Returns
    -------
    str
        The file loaded whole.
    """
    own = files[rank % len(files)]
    # Lenient: with the lean K-FAC state a file lacks the blocks its process
    # did not own; that the snapshot fits the model was checked before.
    # Pickle off (chainerkfac.serializers): an object array is refused.
    _load(own, trainer)
    elastic = len(files) != n_processes
    merge_state = optimizer is not None and (
        elastic or sharded or written_sharded(own))
    for path in files:
        if path == own:
            continue
        if merge_state:
            _load(path, optimizer, 'updater/optimizer:main/')
        if elastic and mixup is not None:
            _load(path, mixup, 'updater/mixup/')
    return own


def _load(path, target, prefix=''):
    """``load_npz(path, target, path=prefix, strict=False)``; a file whose
    arrays do not fit what they are loaded into (a key missing where the
    state needs it, another run's file) is a ``ValueError`` naming it (one
    factor key removed raised ``AttributeError: 'NoneType' object has no
    attribute 'ndim'`` from inside K-FAC)."""
    try:
        serializers.load_npz(path, target, path=prefix, strict=False)
    except (AttributeError, TypeError, IndexError) as error:
        raise ValueError('snapshot file {} does not fit this run\'s model '
                         'and optimizer: {}: {}'.format(
                             path, type(error).__name__, error)) from error


def written_sharded(path):
    """Whether the run that wrote the snapshot file ``path`` sharded the
    update (its ``run/shard_update`` fact; absent: no)."""
    with serializers.open_npz(path) as data:
        return SHARD_UPDATE_KEY in data.files and \
            bool(data[SHARD_UPDATE_KEY])


def starting_point(comm, out, model, optimizer, optimizer_name, resume=None,
                   init_weights_from=None, lars_momentum=None):
    """Where a run starts, settled before anything in ``out`` is written.

    ``--resume``: the snapshot's files, found (:func:`find`), read whole
    and checked against the run's model and optimizer (:func:`check_fit`).
    ``--init-weights-from``: the weights, loaded into ``model.predictor``
    (:func:`init_weights`).

    Parameters
    ----------
    comm : ChainerMN communicator
    out : str
    model, optimizer
        The run's, freshly built and set up.
    optimizer_name : str
    resume, init_weights_from : str or None
        The options.
    lars_momentum : str, optional
        The run's LARS momentum form (``--optimizer lars``).

    Returns
    -------
    (str, list of str) or None
        The snapshot's prefix and files, if resuming.
    """
    if init_weights_from:
        path = init_weights(comm, init_weights_from, model.predictor)
        if comm.rank == 0:
            print('initial weights from {}; the {} optimizer starts afresh'
                  .format(path, optimizer_name), flush=True)
        return None
    if not resume:
        return None
    prefix, files = find(comm, resume, out)
    check_one_run(comm, prefix, files)
    check_fit(comm, files, model, optimizer, optimizer_name, lars_momentum)
    return prefix, files


def run_id(comm, resumed=None):
    """The run's id, the same on every process: the resumed snapshot's
    (its files carry it) or, for a new run or a snapshot of an earlier
    version, a new one."""
    ident = None
    if comm.rank == 0:
        if resumed:
            ident, = _read_facts(resumed[1][0], RUN_ID_KEY)
        if ident is None:
            ident = uuid.uuid4().hex
    return comm.mpi_comm.bcast(ident, root=0)


def _read_facts(path, *keys):
    """The values of the small members ``keys`` of ``path`` (a string or
    an int each), None for one the file lacks (an earlier version's), or
    for all where it cannot be read (verified before: not expected)."""
    try:
        with serializers.open_npz(path) as archive:
            values = [archive[key] if key in archive.files else None
                      for key in keys]
    except (OSError, ValueError):
        return (None,) * len(keys)
    return tuple(None if value is None else value.item()
                 if value.dtype.kind in 'iub' else str(value)
                 for value in values)


def check_one_run(comm, prefix, files):
    """Refuse (once, on rank 0) a snapshot whose files are not one run's
    set: files of other runs (their ids differ), or a file under another
    rank's name (the rank it records differs). Copied so, they were loaded
    silently: another run's rank-1 file gave final weights 0.90 from the
    uninterrupted run's, two ranks' files swapped 0.85. A file of an
    earlier version (no id) is taken for one of the run's."""
    mine = [(files.index(path), path) + _read_facts(path, RUN_ID_KEY,
                                                     RANK_KEY)
            for path in files[comm.rank::comm.size]]
    facts = sorted(item for share in comm.mpi_comm.allgather(mine)
                   for item in share)
    problems = []
    # a file of an earlier version records none: unknown, not another run
    # (a run upgraded between its ranks' writes of one snapshot)
    ids = {ident for _, _, ident, _ in facts if ident is not None}
    if len(ids) > 1:
        problems.append('its files come from {} runs ({}): copied from '
                        'another run\'s directory?'.format(
                            len(ids), '; '.join(
                                '{} of run {}'.format(os.path.basename(p),
                                                      i or '(unrecorded)')
                                for _, p, i, _ in facts)))
    for _, path, _, rank in facts:
        named = _RANK_OF_NAME.search(path)
        if rank is not None and named and int(named.group(1)) != rank:
            problems.append('{} was written by rank {}, but its name says '
                            'rank {}'.format(os.path.basename(path), rank,
                                             named.group(1)))
    error = None
    if problems and comm.rank == 0:
        error = ValueError('--resume {}: not one run\'s snapshot: {}'.format(
            prefix, '; '.join(problems)))
    raise_together(comm, error)


def load(comm, trainer, optimizer, updater, out, prefix, files,
         sharded=False, check=None):
    """Load the snapshot into the trainer (:func:`restore`) and make the
    run directory's line-per-step files those of the snapshot's point.
    ``check(iterator)`` may refuse the snapshot's position (raising)
    before anything of the run directory is touched.

    Parameters
    ----------
    comm : ChainerMN communicator
    trainer : chainer.training.Trainer
    optimizer : chainer.Optimizer or None
        Whose state is merged from every file on another number of
        processes (K-FAC's) or with a sharded update (:func:`restore`).
    updater : harness.updater.AugmentedUpdater
    out : str
    prefix, files
        From :func:`starting_point`.
    sharded : bool
        Whether this run shards the update.
    """
    error = None
    try:
        restore(trainer, files, comm.rank, comm.size, optimizer,
                updater.mixup, sharded)
    except (OSError, ValueError, KeyError) as e:
        error = e
    raise_together(comm, error)
    iterator = updater.get_iterator('main')
    if check is not None:
        check(iterator)     # at the snapshot's position, on every process
    error = None
    if comm.rank == 0:
        reached = next((entry.extension.reached
                        for entry in trainer._extensions.values()
                        if isinstance(entry.extension, TimeToAccuracy)),
                       None)
        try:
            # (the replaced run's record is copied aside before the trim)
            moved = run_dir.set_aside_later(
                out, updater.steps,
                datetime.datetime.now().strftime('%Y%m%d-%H%M%S'))
            if moved is not None:
                print('{} held files of a run that went past the snapshot '
                      'resumed (step {}): {} moved to {}, with a copy of its '
                      'log (the run continues from step {}; --resume latest '
                      'would have returned to them)'.format(
                          out, updater.steps, ', '.join(moved[1]), moved[0],
                          updater.steps), flush=True)
            run_dir.continue_run_files(
                os.path.dirname(os.path.abspath(files[0])), out,
                getattr(updater.get_optimizer('main'), 't', 0), reached)
        except (OSError, ValueError) as e:   # a damaged fisher_diff.jsonl
            error = e
    raise_together(comm, error)
    if comm.rank == 0:
        print('resumed from {} ({} process(es)) on {} process(es) at epoch '
              '{:.4f}{}'.format(
                  prefix, len(files), comm.size, iterator.epoch_detail,
                  '; {} chunks of the flushed last step skipped'.format(
                      iterator.skipped_chunks)
                  if iterator.skipped_chunks else ''), flush=True)
