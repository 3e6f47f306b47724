"""Triggers tied to optimizer steps rather than iterations.

An iteration is one micro-batch per process; an optimizer step takes
``acc_iters`` of them (:class:`harness.updater.AugmentedUpdater` keeps step
boundaries at iterations ``k · acc_iters``). These triggers are functions
of the updater's state (or save what they need), so they behave the same
after a resume on another number of processes, where the iteration count
is rescaled.
"""


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
    """Fire after every optimizer step (and only then): e.g. the learning
    rate schedule, so that a step's rate is the one of the epoch at which
    the step starts, whatever the number of processes."""

    def __call__(self, trainer):
        return trainer.updater.at_step_boundary


def every_iteration(trainer):
    """Fire at every iteration (stateless, unlike ``(1, 'iteration')``)."""
    return True


class EpochAtStepBoundary:
    """Trigger every ``period`` epochs, postponed to the end of the optimizer
    step in progress, so that snapshots never split an accumulation; it also
    fires at the end of the run (after the updater has completed the last,
    possibly partial, step), whatever the period."""

    def __init__(self, period):
        self.period = period
        self.epochs_seen = 0
        self.pending = False

    def __call__(self, trainer):
        updater = trainer.updater
        if updater.is_new_epoch:
            self.epochs_seen += 1
            if self.epochs_seen % self.period == 0:
                self.pending = True
        if updater.finished or (self.pending and updater.at_step_boundary):
            self.pending = False
            return True
        return False

    def serialize(self, serializer):
        self.epochs_seen = int(serializer('epochs_seen', self.epochs_seen))
        self.pending = bool(serializer('pending', self.pending))
