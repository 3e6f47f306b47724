"""Numbers of the whole run, not of one process: validation over every
process's share weighted by samples, and training values of the log
averaged over processes.
"""
import re
import sys
import time

import chainer
import numpy
from chainer import function
from chainer import reporter as reporter_module
from chainer.dataset import convert
from chainer.training import extensions


class EmptyBatch(ValueError):
    """A converter dropped every example of a batch (unreadable images
    under ``--skip-bad-images``): the evaluator goes on to the next."""


class GlobalMeanEvaluator(extensions.Evaluator):
    """:class:`chainer.training.extensions.Evaluator` over the validation
    shares of all processes: every reported value is the mean over all
    validation samples (each batch weighted by its size), the same on every
    process and for any number of processes.

    ChainerMN's multi-node evaluator averages the processes' means (and
    Chainer's evaluator averages batch means), which differ from the sample
    mean when shares or last batches are smaller.

    Parameters
    ----------
    iterator, target, converter, device
        As for Chainer's evaluator (examples of the batches are counted
        after the converter, which may drop unreadable ones).
    comm : ChainerMN communicator
    """

    def __init__(self, iterator, target, comm, converter, device=None):
        super().__init__(iterator, target, converter=converter, device=device)
        self.comm = comm

    def evaluate(self):
        iterator = self.get_iterator('main')
        eval_func = self.eval_func or self.get_target('main')
        iterator.reset()
        sums, count = {}, 0
        for batch in iterator:
            if not batch:           # an empty share (more processes than
                continue            # validation images)
            observation = {}
            with reporter_module.report_scope(observation):
                try:
                    in_arrays = convert._call_converter(
                        self.converter, batch, self.device)
                except EmptyBatch:  # every image of it unreadable, dropped
                    continue
                with function.no_backprop_mode():
                    eval_func(*in_arrays)
            n = len(in_arrays[0])
            for key, value in observation.items():
                sums[key] = sums.get(key, 0.0) + _as_float(value) * n
            count += n
        keys = sorted(set().union(*self.comm.mpi_comm.allgather(
            sorted(sums))))
        vector = numpy.array([sums.get(k, 0.0) for k in keys] + [count],
                             dtype=numpy.float64)
        total = self.comm.mpi_comm.allreduce(vector)
        if total[-1] == 0:
            return {}
        return {key: total[i] / total[-1] for i, key in enumerate(keys)}


def average_over_processes(comm, prefix='main/', totals=None,
                           micro_batches=None):
    """A ``LogReport`` postprocess: the entries starting with ``prefix``
    (training loss and accuracy of each process's micro-batches) become
    their mean over processes; with the same number of iterations per
    process in an epoch, that is the mean over all micro-batches of the
    run. ``micro_batches()``: this process's micro-batches since the last
    log, where they may differ (a run's last micro-iteration, where the
    processes past its end take none): each process's mean then weighs by
    them. ``totals()`` gives counters (``{name: number}``) added as their
    sum over processes. Every process must run the ``LogReport``."""
    def postprocess(stats):
        keys = sorted(k for k in stats if k.startswith(prefix))
        counters = totals() if totals is not None else {}
        names = sorted(counters)
        weight = 1.0 if micro_batches is None else float(micro_batches())
        values = numpy.array([float(stats[k]) * weight for k in keys] +
                             [float(counters[n]) for n in names] + [weight],
                             numpy.float64)
        if comm.size > 1:
            values = comm.mpi_comm.allreduce(values)
        if values[-1] > 0:
            values[:len(keys)] /= values[-1]
        for key, value in zip(keys + names, values[:-1]):
            stats[key] = float(value)
    return postprocess


def log_report(comm, trigger=(1, 'epoch'), totals=None, micro_batches=None):
    """``LogReport`` on every process with :func:`average_over_processes`;
    rank 0 writes ``log``."""
    postprocess = average_over_processes(comm, totals=totals,
                                         micro_batches=micro_batches)
    if comm.rank == 0:
        return extensions.LogReport(trigger=trigger, postprocess=postprocess,
                                    filename='log')
    return extensions.LogReport(trigger=trigger, postprocess=postprocess,
                                log_name=None)


def print_report(entries, progress_bar):
    """Chainer's ``PrintReport`` of ``entries`` on stdout.

    Without a progress bar (``--no-progress``) its output is plain lines:
    ``PrintReport`` erases the bar's lines with a terminal escape code
    before each row, bar or not, which would land in a log file.
    """
    out = sys.stdout if progress_bar else PlainText(sys.stdout)
    return ResumedPrintReport(entries, out=out)


class ResumedPrintReport(extensions.PrintReport):
    """``PrintReport`` that keeps, in the snapshot, how many of the log's
    entries it printed: a resumed run prints the entries after those only
    (Chainer's printed the whole log again at each resume, so a requeued
    job's output grew as resumes × epochs). A snapshot without the count
    (an earlier version's) prints the whole log, as before."""

    def serialize(self, serializer):
        super().serialize(serializer)
        try:
            self._log_len = int(serializer('_log_len', self._log_len))
        except KeyError:
            pass


class PlainText:
    """A text stream that drops terminal escape codes (``\\x1b[J``, ...)
    from what is written through it to ``stream``."""

    _ESCAPE = re.compile(r'\x1b\[[0-9;]*[A-Za-z]')

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        return self.stream.write(self._ESCAPE.sub('', text))

    def flush(self):
        self.stream.flush()


def _as_float(value):
    if isinstance(value, chainer.Variable):
        value = value.array
    return float(value)


class PlainProgress(chainer.training.Extension):
    """With ``--no-progress``: a plain line on rank 0 at most every
    ``interval`` seconds (checked at each micro-batch), saying where the run
    is — epoch, optimizer step, micro-batch, images/s and the time to the
    run's end at this pace. Without it a batch job's log showed nothing
    between the log's epoch rows: at 131K on 2 processes (2,048 micro-batches
    a step) the first row came after the first step, then one an hour.

    Parameters
    ----------
    epochs : float
        The run's length.
    images_per_iteration : int
        The global stream's images per micro-iteration.
    interval : float
        Seconds between lines.
    out : file
    clock : callable
        Seconds, monotonic (tests give their own).
    """

    trigger = (1, 'iteration')
    priority = extensions.PrintReport.priority

    def __init__(self, epochs: float, images_per_iteration: int,
                 interval: float = 60.0, out=None, clock=time.monotonic):
        self.epochs = float(epochs)
        self.images_per_iteration = images_per_iteration
        self.interval = float(interval)
        self.out = out
        self.clock = clock
        self._start = None        # (time, epoch_detail, iteration)
        self._last = None

    def __call__(self, trainer):
        updater = trainer.updater
        now = self.clock()
        if self._start is None:
            self._start = (now, updater.epoch_detail, updater.iteration)
            self._last = now
            return
        if now - self._last < self.interval:
            return
        self._last = now
        started, epoch0, iteration0 = self._start
        seconds = now - started
        epoch = updater.epoch_detail
        images = (updater.iteration - iteration0) * self.images_per_iteration
        pace = (epoch - epoch0) / seconds if seconds > 0 else 0.0
        left = (self.epochs - epoch) / pace if pace > 0 else float('inf')
        out = self.out or sys.stdout
        out.write('progress: epoch {:.3f} of {:g}, step {}, micro-batch {}, '
                  '{:.1f} images/s, {} to go\n'.format(
                      epoch, self.epochs, getattr(updater, 'steps',
                                                  updater.iteration),
                      updater.iteration, images / seconds if seconds > 0
                      else 0.0, _duration(left)))
        out.flush()


def _duration(seconds: float) -> str:
    """``1:02:03`` (hours:minutes:seconds), or ``?`` where unknown."""
    if not seconds < float('inf'):
        return '?'
    seconds = int(round(seconds))
    return '{}:{:02d}:{:02d}'.format(seconds // 3600, seconds // 60 % 60,
                                     seconds % 60)
