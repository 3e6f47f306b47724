"""Trainer extensions recording what a run needs for the figures.

:class:`FisherDiffLog` writes Diff(t) of eq. (21) for every refreshed factor
of every layer (Figure 5) as JSON lines, one per K-FAC step::

    {"iteration": 12, "step": 12, "epoch": 0,
     "A": {"/conv1": 0.031, ...}, "G": {...}, "F": {"/bn1": ...}}

In a multi-process run each block's Diff is known only to its owner; the
values are gathered to rank 0, which writes the file.
"""
import json
import logging
import numbers
import os

from chainer.training import extension

from chainerkfac import _logging

logger = logging.getLogger(__name__)


class FisherDiffLog(extension.Extension):
    """Append the last step's Fisher Diff values to ``out/filename``.

    Parameters
    ----------
    optimizer : chainerkfac.optimizers.KFAC
        Must be created with ``fisher_diff=True``.
    filename : str
        File in the trainer's output directory (JSON lines).
    comm : ChainerMN communicator, optional
        Gathers the owners' values to rank 0.
    """

    trigger = 1, 'iteration'
    priority = extension.PRIORITY_WRITER

    def __init__(self, optimizer, filename='fisher_diff.jsonl', comm=None):
        if not getattr(optimizer, 'fisher_diff', False):
            raise ValueError('FisherDiffLog needs KFAC(..., fisher_diff=True)')
        self._optimizer = optimizer
        self._filename = filename
        self._comm = comm
        self._last_step = optimizer.t

    def __call__(self, trainer):
        optimizer = self._optimizer
        if optimizer.t == self._last_step:   # mid-accumulation
            return
        self._last_step = optimizer.t
        values = {}
        for (layer, factor), diff in optimizer.fisher_diffs.items():
            values.setdefault(factor, {})[layer] = diff
        if self._comm is not None and self._comm.size > 1:
            parts = self._comm.mpi_comm.gather(values, root=0)
            if self._comm.rank != 0:
                return
            values = {}
            for part in parts:
                for factor, layers in part.items():
                    values.setdefault(factor, {}).update(layers)
        if not values:
            return
        record = {'iteration': trainer.updater.iteration,
                  'step': optimizer.t - 1, 'epoch': trainer.updater.epoch}
        record.update(values)
        path = os.path.join(trainer.out, self._filename)
        with open(path, 'a') as f:
            f.write(json.dumps(record) + '\n')


class TimeToAccuracy(extension.Extension):
    """Record when a validation top-1 first reaches ``target`` (MLPerf-style
    time to accuracy) and write it to ``out/<filename>``.

    Runs after the evaluator (priority below the evaluator's), at the
    evaluator's trigger. The record holds the epoch, iteration and elapsed
    training time (seconds, validation included) at that evaluation.

    Parameters
    ----------
    target : float
        The accuracy to reach, in (0, 1] (MLPerf-0.6 ResNet-50: 0.749).
    key : str, default 'validation/main/accuracy'
        The observation compared with ``target``.
    filename : str, default 'time_to_accuracy.json'
        Written in the trainer's ``out`` when the target is reached.
    trigger : tuple, default (1, 'epoch')
        The evaluator's trigger (when the observation is there).
    write : bool, default True
        This process writes the file and reports the time (rank 0 of a
        multi-process run); the others only keep the record, for their
        snapshots.
    """

    priority = extension.PRIORITY_WRITER - 1

    def __init__(self, target, key='validation/main/accuracy',
                 filename='time_to_accuracy.json', trigger=(1, 'epoch'),
                 write=True):
        if not isinstance(target, numbers.Real) or \
                isinstance(target, bool) or not 0 < target <= 1:
            raise ValueError('TimeToAccuracy: target={!r} must be an '
                             'accuracy in (0, 1]'.format(target))
        if not isinstance(key, str) or not isinstance(filename, str):
            raise TypeError('TimeToAccuracy: key and filename are strings, '
                            'got {!r} and {!r}'.format(key, filename))
        self.target = target
        self.key = key
        self.filename = filename
        self.trigger = trigger
        self.write = write
        self.reached = None

    def __call__(self, trainer):
        if self.reached is not None:
            return
        value = trainer.observation.get(self.key)
        if value is None:
            return
        value = float(value)
        if value >= self.target:
            self.reached = {
                'target': self.target, 'accuracy': value,
                'epoch': trainer.updater.epoch_detail,
                'iteration': trainer.updater.iteration,
                'elapsed_time': trainer.elapsed_time}
            if self.write:
                path = os.path.join(trainer.out, self.filename)
                tmp = path + '.tmp'
                with open(tmp, 'w') as f:
                    json.dump(self.reached, f, indent=1)
                os.replace(tmp, path)
                _logging.ensure_visible()
                logger.info('target top-1 %.3f reached at epoch %.2f '
                            '(iteration %d, %.1f s)', self.target,
                            self.reached['epoch'], self.reached['iteration'],
                            self.reached['elapsed_time'])

    def serialize(self, serializer):
        reached = serializer('reached', json.dumps(self.reached))
        self.reached = json.loads(str(reached))
