"""Triggers tied to optimizer steps rather than iterations.

An iteration is one micro-batch per process; an optimizer step takes
``acc_iters`` of them (:class:`harness.updater.AugmentedUpdater` keeps step
boundaries at iterations ``k · acc_iters``). These triggers are functions
of the updater's state (or save what they need), so they behave the same
after a resume on another number of processes, where the iteration count
is rescaled.
"""
import math
import re
import time

from harness import preemption


class EpochLimit:
    """Stop trigger: the run ends at the iteration that reaches ``epochs``
    (in samples of the global stream). Stateless, so a resumed run stops
    where the uninterrupted one does."""

    def __init__(self, epochs):
        self.epochs = epochs

    def __call__(self, trainer):
        return trainer.updater.epoch_detail >= self.epochs

    def get_training_length(self):
        # For ProgressBar.
        return self.epochs, 'epoch'


class StepBoundary:
    """Fire after every optimizer step (and only then), the run's final
    partial step included: e.g. the learning rate schedule, so that a
    step's rate is the one of the epoch at which the step starts, and the
    observers of the log, whatever the number of processes (on one process
    the final step of a run ending inside a step is flushed at an iteration
    that is no step boundary, on three it may end at one)."""

    def __call__(self, trainer):
        updater = trainer.updater
        return updater.at_step_boundary or updater.finished


def every_iteration(trainer):
    """Fire at every iteration (stateless, unlike ``(1, 'iteration')``)."""
    return True


class SnapshotPeriod:
    """``--snapshot-every``: every ``N`` epochs (``'1'``), ``N`` iterations
    (``'2000it'``, Chainer's iterations: micro-batches of each process, as
    in the log) or ``M`` minutes (``'30min'``), each postponed to the end
    of the optimizer step in progress.

    Parameters
    ----------
    count : int or float
        Epochs and iterations: an int >= 1; minutes: a number > 0.
    unit : {'epoch', 'iteration', 'minute'}
    """

    _SUFFIXES = {'': 'epoch', 'it': 'iteration', 'min': 'minute'}
    _FORM = re.compile(r'(\d+(?:\.\d*)?)(|it|min)')

    def __init__(self, count, unit):
        self.count = count
        self.unit = unit

    @classmethod
    def parse(cls, text):
        """From ``'1'``, ``'2000it'``, ``'30min'``.

        Raises
        ------
        ValueError
            Saying what the forms are, with ``text``.
        """
        match = cls._FORM.fullmatch(text.strip())
        unit = cls._SUFFIXES[match.group(2)] if match else None
        count = None
        if match and unit == 'minute':
            count = float(match.group(1))
            count = count if math.isfinite(count) and count > 0 else None
        elif match and match.group(1).isdigit() and int(match.group(1)) > 0:
            count = int(match.group(1))
        if count is None:
            raise ValueError(
                'must be N epochs (an integer >= 1, e.g. 1), N iterations '
                "(e.g. 2000it) or M minutes (e.g. 30min), got {!r}".format(
                    text))
        return cls(count, unit)

    def __repr__(self):
        return 'SnapshotPeriod({!r}, {!r})'.format(self.count, self.unit)

    def __eq__(self, other):
        return isinstance(other, SnapshotPeriod) and \
            (self.count, self.unit) == (other.count, other.unit)

    def counted_due(self, updater):
        """At a step boundary: whether an epoch or iteration multiple of
        the period was crossed in the step that just ended (a function of
        the updater's position: nothing to save, the same after a
        resume)."""
        now = updater.iteration
        before = max(now - updater.acc_iters, 0)
        if self.unit == 'iteration':
            return now // self.count > before // self.count
        if self.unit == 'epoch':
            epoch_at = updater.get_iterator('main').epoch_at
            return epoch_at(now) // self.count > \
                epoch_at(before) // self.count
        return False

    def clock_due(self, since):
        """Whether the period in minutes has passed since ``since``
        (``time.monotonic()``)."""
        return self.unit == 'minute' and \
            time.monotonic() - since >= self.count * 60.0


class EpochEnd:
    """Fire at the end of the optimizer step in which an epoch ended, and
    at the run's end: when the epoch's log entry is written and the model
    evaluated.

    Chainer's ``(1, 'epoch')`` fires at the micro-iteration that reaches
    the epoch's last sample, which on P processes holds P chunks: on 3
    processes it could complete the step that straddles the epoch (its
    update evaluated, its learning rate and loss logged in the epoch), on
    one process not. At step boundaries the log and the evaluation are
    those of the same weights and steps on any number of processes.
    Stateless (a function of the updater's position).
    """

    _period = SnapshotPeriod(1, 'epoch')

    def __call__(self, trainer):
        updater = trainer.updater
        if updater.finished:
            return True
        return updater.at_step_boundary and updater.iteration > 0 and \
            self._period.counted_due(updater)


class SnapshotTrigger:
    """Fire at the end of an optimizer step when a snapshot is due: by the
    period, because the processes agreed to stop
    (:func:`harness.preemption.agree`), or at the end of the run (after
    the updater completed the last, possibly partial, step).

    At every step boundary it runs the agreement — one small collective
    that every process calls at the same iterations — which carries rank
    0's wall-clock decision (``'30min'``), so all processes snapshot at the
    same step. Epoch and iteration periods are stateless; the clock starts
    with the process.

    Parameters
    ----------
    period : SnapshotPeriod
    comm : ChainerMN communicator
    stop : harness.preemption.StopRequest
    """

    def __init__(self, period, comm, stop):
        self.period = period
        self.comm = comm
        self.stop = stop
        self._since = time.monotonic()

    def __call__(self, trainer):
        updater = trainer.updater
        if not (updater.at_step_boundary or updater.finished):
            return False
        stop = clock = False
        if self.stop.signals or self.period.unit == 'minute':
            stop, clock = preemption.agree(
                self.comm, self.stop, self.period.clock_due(self._since))
        fire = stop or clock or updater.finished or \
            self.period.counted_due(updater)
        if fire:
            self._since = time.monotonic()
        return fire


class StopTrigger(EpochLimit):
    """:class:`EpochLimit`, or earlier once the processes agreed to stop
    (``stop.stopping``, set by :class:`SnapshotTrigger` at a step boundary
    after the snapshot extension ran in that iteration)."""

    def __init__(self, epochs, stop):
        super().__init__(epochs)
        self.stop = stop

    def __call__(self, trainer):
        return self.stop.stopping is not None or super().__call__(trainer)
