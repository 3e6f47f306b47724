"""The files of a run directory besides the snapshots, written here only.

``config.json`` (the resolved config plus the run's facts under ``"run"``),
``log`` (Chainer's ``LogReport``), ``fisher_diff.jsonl``
(:class:`chainerkfac.training.FisherDiffLog`), ``time_to_accuracy.json``
(:class:`chainerkfac.training.TimeToAccuracy`), ``model_final.npz``. The
analysis scripts read them (:mod:`analysis`); their test fixtures write them
through these functions.
"""
import json
import os

import config as config_module

CONFIG_FILE = 'config.json'
LOG_FILE = 'log'
FISHER_DIFF_FILE = 'fisher_diff.jsonl'
TIME_TO_ACCURACY_FILE = 'time_to_accuracy.json'
MODEL_FINAL_FILE = 'model_final.npz'


def _write_atomic(path, text):
    tmp = path + '.tmp'
    with open(tmp, 'w') as f:
        f.write(text)
    os.replace(tmp, path)


def run_facts(optimizer, n_processes, acc_iters, batch_per_process, arch,
              depth, width, n_train, n_val, n_class, label):
    """The ``"run"`` entry of ``config.json`` (what the analysis reads)."""
    return {'optimizer': optimizer, 'n_processes': n_processes,
            'acc_iters': acc_iters, 'batch_per_process': batch_per_process,
            'arch': arch, 'depth': depth, 'width': width, 'n_train': n_train,
            'n_val': n_val, 'n_class': n_class, 'label': label}


def label_of(optimizer_name, cfg):
    """Default name of a run in the figures, e.g. ``'K-FAC bs32768 stale'``.
    """
    label = '{} bs{}'.format(optimizer_name.upper() if optimizer_name !=
                             'kfac' else 'K-FAC', cfg.global_batch_size)
    if optimizer_name == 'kfac':
        if cfg.bn_fisher == 'diag':
            label += ' diag'
        if any(v != 1 for v in (cfg.refresh_interval_a,
                                cfg.refresh_interval_g,
                                cfg.refresh_interval_f)):
            label += ' stale'
    return label


def write_run_config(cfg, out, facts):
    """``out/config.json``: the config as :func:`config.to_dict` gives it,
    plus ``"run": facts`` (see :func:`run_facts`)."""
    data = config_module.to_dict(cfg)
    data['run'] = facts
    _write_atomic(os.path.join(out, CONFIG_FILE),
                  json.dumps(data, indent=1, sort_keys=True))


def load_log(out):
    """The entries of ``out/log`` ([] if there is none yet)."""
    path = os.path.join(out, LOG_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)


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
            lines = [line for line in f if line.strip()
                     and json.loads(line)['step'] < step]
    target = os.path.join(out, FISHER_DIFF_FILE)
    if lines or os.path.exists(target):
        _write_atomic(target, ''.join(lines))
    path = os.path.join(out, TIME_TO_ACCURACY_FILE)
    if reached is None and os.path.exists(path):
        os.remove(path)
