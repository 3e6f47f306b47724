"""The files of a run directory besides the snapshots, written here only;
and which files of a directory an earlier run left.

``config.json`` (the resolved config plus the run's facts under ``"run"``),
``log`` (Chainer's ``LogReport``), ``fisher_diff.jsonl``
(:class:`chainerkfac.training.FisherDiffLog`), ``time_to_accuracy.json``
(:class:`chainerkfac.training.TimeToAccuracy`), ``model_final.npz``. The
analysis scripts read them (:mod:`analysis`); their test fixtures write them
through these functions. A run also leaves ``mean.npy`` (unless ``--mean``
names another file), ``bad_images.txt`` (:mod:`harness.data`) and its
snapshots (:mod:`harness.snapshots`): :func:`earlier_run_files` finds them
all, so that a fresh run never mixes its files with an earlier run's.
"""
import json
import os
import re
import logging
import shutil
import zipfile

import config as config_module
from harness.mpi import raise_together
from harness.run_lock import RunLock
from harness.snapshots import SNAPSHOT_RE, remove_unfinished

logger = logging.getLogger(__name__)

CONFIG_FILE = 'config.json'
LOG_FILE = 'log'
FISHER_DIFF_FILE = 'fisher_diff.jsonl'
TIME_TO_ACCURACY_FILE = 'time_to_accuracy.json'
MODEL_FINAL_FILE = 'model_final.npz'
#: The mean image computed by a run, when ``--mean`` is not given.
MEAN_FILE = 'mean.npy'
#: Every unreadable image a run found.
BAD_IMAGES_FILE = 'bad_images.txt'
#: The files of a run besides the snapshots and the mean image.
RUN_FILES = (CONFIG_FILE, LOG_FILE, FISHER_DIFF_FILE, TIME_TO_ACCURACY_FILE,
             MODEL_FINAL_FILE, BAD_IMAGES_FILE)
#: Temporary files of the run's writers (left if a run was killed while
#: writing).
_TEMPORARY = re.compile(
    r'\.(snapshot_step_\d+\.rank\d+|model_final\.npz|mean\.\d+)\.tmp|'
    r'(config\.json|fisher_diff\.jsonl|time_to_accuracy\.json)\.tmp')


def _write_atomic(path, text):
    tmp = path + '.tmp'
    with open(tmp, 'w') as f:
        f.write(text)
    os.replace(tmp, path)


def run_facts(optimizer, n_processes, acc_iters, batch_per_process, arch,
              depth, width, n_train, n_val, n_class, label, stream=None):
    """The ``"run"`` entry of ``config.json`` (what the analysis reads,
    and what a resume compares: :func:`config_changes`). ``stream``: what
    shapes the data stream besides the config — the seed of its draws, the
    crop and resize sides, whether it is augmented (a resume with another
    ``--seed`` continued silently on another permutation and other draws)."""
    facts = {'optimizer': optimizer, 'n_processes': n_processes,
             'acc_iters': acc_iters, 'batch_per_process': batch_per_process,
             'arch': arch, 'depth': depth, 'width': width,
             'n_train': n_train, 'n_val': n_val, 'n_class': n_class,
             'label': label}
    if stream is not None:
        facts['stream'] = dict(stream)
    return facts


def label_of(optimizer_name, cfg):
    """Default name of a run in the figures, e.g. ``'K-FAC bs32768 stale'``
    (the variants named as the paper's Figure 6 and
    ``analysis._io.Run.variant`` name them: ``stale diag``)."""
    label = '{} bs{}'.format(optimizer_name.upper() if optimizer_name !=
                             'kfac' else 'K-FAC', cfg.global_batch_size)
    if optimizer_name == 'kfac':
        if any(v != 1 for v in (cfg.refresh_interval_a,
                                cfg.refresh_interval_g,
                                cfg.refresh_interval_f)):
            label += ' stale'
        if cfg.bn_fisher == 'diag':
            label += ' diag'
    return label


def write_run_config(cfg, out, facts):
    """``out/config.json``: the config as :func:`config.to_dict` gives it,
    plus ``"run": facts`` (see :func:`run_facts`)."""
    data = config_module.to_dict(cfg)
    data['run'] = facts
    _write_atomic(os.path.join(out, CONFIG_FILE),
                  json.dumps(data, indent=1, sort_keys=True))


def read_config(directory):
    """``directory/config.json`` (a run's record) as a dict, or None where
    it is missing or unreadable."""
    try:
        with open(os.path.join(directory, CONFIG_FILE)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def config_changes(cfg, old, facts):
    """What a resumed run changes of the run's record ``old`` (its
    ``config.json``, :func:`read_config`): a line ``'key: old → new'`` per
    value that differs (``'run.key'`` for the facts), [] where there is no
    record. A key the record lacks (written by an earlier version) is no
    change."""
    if not isinstance(old, dict):
        return []
    new = config_module.to_dict(cfg)
    new['run'] = facts

    def flat(data, prefix=''):
        out = {}
        for key, value in data.items():
            if isinstance(value, dict):
                out.update(flat(value, prefix + key + '.'))
            else:
                out[prefix + key] = value
        return out
    old, new = flat(old), flat(json.loads(json.dumps(new)))
    return ['{}: {} → {}'.format(key, json.dumps(old.get(key)),
                                 json.dumps(new.get(key)))
            for key in sorted(old) if old.get(key) != new.get(key)]


def load_log(out):
    """The entries of ``out/log`` ([] if there is none yet)."""
    path = os.path.join(out, LOG_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)


#: Where a resume moves what a run left past the snapshot it resumes
#: (``superseded_<YYYYmmdd-HHMMSS>``, ``-2``... if that is taken); only
#: names of this form are a run's (``--overwrite`` removes them).
SUPERSEDED_DIR = 'superseded_{}'
_SUPERSEDED_RE = re.compile(r'superseded_\d{8}-\d{6}(-\d+)?')
#: The record of the replaced run, copied beside its files as it was
#: before the resumed run trims it (:func:`continue_run_files`).
_RECORD = (CONFIG_FILE, LOG_FILE, FISHER_DIFF_FILE, TIME_TO_ACCURACY_FILE)


def set_aside_later(out, step, when):
    """Move what ``out`` holds past the resumed snapshot's ``step`` into
    ``out/superseded_<when>/``: snapshots of later steps, and with them the
    replaced run's ``model_final.npz`` (and a copy of its log, config and
    Diff record), left by a run that went further than the point resumed
    (a resume of an older snapshot on purpose). Left there, ``--resume
    latest`` would return to that run's newest snapshot after the next
    stop (and Chainer's snapshot retention keeps the newest files),
    discarding the continued run's steps. A resume of the newest snapshot
    (a finished run extended) moves nothing: its ``model_final.npz`` is
    of the same point, and is rewritten at the run's new end.

    Call it before :func:`continue_run_files`.

    Returns
    -------
    (str, list of str) or None
        The directory and the names moved, if any.
    """
    later = sorted(
        name for name in os.listdir(out)
        if SNAPSHOT_RE.fullmatch(name) and
        int(SNAPSHOT_RE.fullmatch(name).group(1)) > step)
    if not later:
        return None
    if os.path.exists(os.path.join(out, MODEL_FINAL_FILE)):
        later.insert(0, MODEL_FINAL_FILE)
    base = aside = os.path.join(out, SUPERSEDED_DIR.format(when))
    suffix = 1
    while os.path.exists(aside):        # two in one second
        suffix += 1
        aside = '{}-{}'.format(base, suffix)
    os.makedirs(aside)
    for name in _RECORD:
        if os.path.exists(os.path.join(out, name)):
            shutil.copy2(os.path.join(out, name), os.path.join(aside, name))
    for name in later:
        os.replace(os.path.join(out, name), os.path.join(aside, name))
    return aside, later


def continue_run_files(snapshot_dir, out, step, reached):
    """Make the line-per-step files of ``out`` those of the snapshot's point
    (a resumed run appends to them): ``fisher_diff.jsonl`` keeps the steps
    before ``step`` (from ``snapshot_dir``'s file, which may be ``out``'s
    own, holding lines the killed run wrote after the snapshot), and
    ``time_to_accuracy.json`` is removed unless the snapshot had reached
    its target (``reached``).
    """
    source = os.path.join(snapshot_dir, FISHER_DIFF_FILE)
    lines = []
    if os.path.exists(source):
        with open(source) as f:
            text = f.read().splitlines(True)
        for number, line in enumerate(text, 1):
            if not line.strip():
                continue
            try:
                record_step = json.loads(line)['step']
            except (ValueError, KeyError, TypeError):
                if number == len(text):
                    # cut off where the killed run stopped writing (after
                    # its snapshot, so not one of the lines kept)
                    logger.warning('%s:%d: an unfinished last line, '
                                   'dropped', source, number)
                    continue
                raise ValueError('{}:{}: not a fisher_diff record (the run '
                                 'cannot continue it; move the file aside '
                                 'to resume without it)'.format(
                                     source, number)) from None
            if record_step < step:
                lines.append(line if line.endswith('\n') else line + '\n')
    target = os.path.join(out, FISHER_DIFF_FILE)
    if lines or os.path.exists(target):
        _write_atomic(target, ''.join(lines))
    path = os.path.join(out, TIME_TO_ACCURACY_FILE)
    if reached is None and os.path.exists(path):
        os.remove(path)


def earlier_run_files(out, mean_is_output=True):
    """The files in ``out`` that a run of ``train_imagenet.py`` writes,
    sorted, and their temporary files.

    Parameters
    ----------
    out : str
        An existing directory.
    mean_is_output : bool
        Whether ``out/mean.npy`` is the run's own (``--mean`` not given) or
        an input named by ``--mean``.

    Returns
    -------
    (list of str, list of str)
        The names of the files, and of the temporary files.
    """
    files, temporary = [], []
    for name in sorted(os.listdir(out)):
        if name in RUN_FILES or SNAPSHOT_RE.fullmatch(name) or (
                mean_is_output and name == MEAN_FILE) or \
                _SUPERSEDED_RE.fullmatch(name):
            files.append(name)
        elif _TEMPORARY.fullmatch(name):
            temporary.append(name)
    return files, temporary


def clear(out, names):
    """Remove the files ``names`` of ``out`` (a superseded directory with
    what it holds)."""
    for name in names:
        path = os.path.join(out, name)
        try:
            if _SUPERSEDED_RE.fullmatch(name) and os.path.isdir(path):
                shutil.rmtree(path)
            else:
                os.remove(path)
        except FileNotFoundError:
            pass


def claim(comm, out, overwrite, mean_is_output, source=None,
          continues=False):
    """Make ``out`` this run's: lock it (rank 0, :mod:`harness.run_lock`)
    and, unless the run continues a snapshot of ``out`` itself, refuse the
    files of an earlier run there or, with ``overwrite``, remove them.

    Parameters
    ----------
    comm : ChainerMN communicator
    out : str
    overwrite : bool
        ``--overwrite``.
    mean_is_output : bool
        ``out/mean.npy`` is the run's own (``--mean`` not given).
    source : str or None
        The snapshot file resumed, or the ``--init-weights-from`` source.
    continues : bool
        The run resumes from ``source``.

    Returns
    -------
    RunLock or None
        The lock (rank 0), to release at the end of the run.

    Raises
    ------
    OSError
        Once, on rank 0: the directory is in use, holds an earlier run,
        or ``--overwrite`` would remove ``source``.
    """
    lock, error = None, None
    if comm.rank == 0:
        try:
            os.makedirs(out, exist_ok=True)
            lock = RunLock.acquire(out)
            _refuse_or_clear(out, overwrite, mean_is_output, source,
                             continues)
        except OSError as e:
            error = e
            if lock is not None:
                lock.release()
                lock = None
    raise_together(comm, error)
    remove_unfinished(out, comm.rank)
    return lock


def _refuse_or_clear(out, overwrite, mean_is_output, source, continues):
    def inside(path):
        return os.path.samefile(os.path.dirname(os.path.abspath(path)), out)

    if overwrite and source and inside(source):
        raise OSError('--overwrite would remove {} before it is read: '
                      'choose another --out'.format(source))
    if continues and inside(source):
        return                  # the run continues its own directory
    files, temporary = earlier_run_files(out, mean_is_output)
    if overwrite:
        if files or temporary:
            clear(out, files + temporary)
            print('--overwrite: cleared the earlier run of {} ({} files)'
                  .format(out, len(files)), flush=True)
    elif files:
        named = '{}{}'.format(', '.join(files[:6]),
                              ', ...' if len(files) > 6 else '')
        if not any(SNAPSHOT_RE.fullmatch(name) for name in files):
            # A run that failed before its first snapshot: --resume latest
            # would find nothing to continue from.
            raise OSError(
                '{} holds the files of an earlier run that left no snapshot '
                '({}), so there is nothing to continue with --resume: start '
                'it over with --overwrite (removes them first), or choose '
                'another --out'.format(out, named))
        if not _has_whole_snapshot(out):
            raise OSError(
                '{} holds the files of an earlier run ({}) whose snapshots '
                'are all incomplete (a process\'s file missing or cut '
                'short), so --resume latest would find none to continue '
                'from: start it over with --overwrite '
                '(removes them first), or choose another --out'.format(
                    out, named))
        raise OSError(
            '{} holds the files of an earlier run ({}): continue it with '
            '--resume latest, start it over with --overwrite (removes them '
            'first), or choose another --out'.format(out, named))


def _has_whole_snapshot(out):
    """Whether ``out`` holds a snapshot that ``--resume latest`` may take:
    the files of all its processes there, each with its zip directory (a
    file cut short has none). Only the directories are read, so that a
    refusal costs no time on a large run; a flipped byte inside is found
    by ``--resume latest`` itself, which then takes an older one."""
    from harness import resume          # resume imports this module
    for _, files in resume.candidates(out):
        if isinstance(files, Exception):
            continue
        try:
            for path in files:
                with zipfile.ZipFile(path):
                    pass
        except (OSError, zipfile.BadZipFile):
            continue
        return True
    return False
