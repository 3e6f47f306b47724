"""Trainer extensions for the learning-rate and momentum schedules.

Siblings of :class:`chainer.training.extensions.PolynomialShift`: called
every iteration, they set ``optimizer.lr`` (and ``optimizer.momentum``) from
the *fractional* epoch ``trainer.updater.epoch_detail``. The values are pure
functions of that epoch (the equations live in :mod:`chainerkfac.equations`),
so a run resumed from a snapshot continues with exactly the values of an
uninterrupted one.

The value set after iteration ``t`` is the one the update of iteration
``t + 1`` uses: the learning rate of a step is that of the epoch at which the
step starts.

With gradient accumulation the updater must count epochs in samples of the
global mini-batch, so that ``epoch_detail`` advances by
``global_batch_size / len(dataset)`` per optimizer step.
"""
import bisect
import math
import numbers

from chainer.training import extension

from chainerkfac import equations


def _number(owner: str, name: str, value, ok=None, why: str = '') -> float:
    """``value`` as a float if it is a finite real number (not a bool)
    for which ``ok`` holds, else a ``ValueError`` naming ``owner``'s
    argument ``name`` (a string, None or NaN went through as values, or
    failed in a comparison that named nothing)."""
    try:
        finite = isinstance(value, numbers.Real) and \
            not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:          # an int past float's range
        finite = False
    if not finite or (ok is not None and not ok(value)):
        raise ValueError('{}: {}={!r} must be a finite number{}'.format(
            owner, name, value, why))
    return float(value)


class _EpochSchedule(extension.Extension):
    """Set optimizer attributes from ``updater.epoch_detail`` each iteration.

    Subclasses implement :meth:`values`.
    """

    trigger = 1, 'iteration'
    #: Below Chainer's snapshot extension (-100), whose ``initialize``
    #: loads a snapshot with ``autoload=True``: the values are then taken
    #: from the restored epoch (at the default priority, 100, they were
    #: taken from epoch 0 before the load, and the first resumed step used
    #: them).
    priority = -150

    def __init__(self, optimizer=None):
        self._optimizer = optimizer
        self.last_values = {}

    def values(self, epoch):
        """``{attribute name: value}`` at the fractional ``epoch``."""
        raise NotImplementedError

    def initialize(self, trainer):
        # Before the first update, and again after ``load_npz`` on resume:
        # the epoch of the restored updater gives the values.
        self._apply(trainer)

    def __call__(self, trainer):
        self._apply(trainer)

    def serialize(self, serializer):
        # The schedule is stateless; the last values are kept so that a
        # restored extension reports what the snapshot's optimizer used.
        for name in sorted(self.values(0.0)):
            value = serializer(name, self.last_values.get(name, 0.0))
            self.last_values[name] = float(value)

    def _apply(self, trainer):
        optimizer = self._optimizer or trainer.updater.get_optimizer('main')
        for name, value in self.values(trainer.updater.epoch_detail).items():
            setattr(optimizer, name, value)
            self.last_values[name] = value


class PolynomialLRDecay(_EpochSchedule):
    """Polynomial learning-rate decay, eq. (17), with optional momentum of
    eq. (18).

    ``η(e) = η(0) (1 − (e − e_start) / (e_end − e_start))^p_decay`` between
    ``e_start`` and ``e_end``, ``η(0)`` before, 0 after; with
    ``momentum_init`` given, ``m(e) = m(0) / η(0) · η(e)``.

    Parameters
    ----------
    lr_init : float
        η(0) > 0.
    p_decay : float
        Exponent of the decay, > 0.
    e_start, e_end : float
        Epochs where the decay starts and ends, ``0 <= e_start < e_end``.
    momentum_init : float or None, default None
        m(0), in [0, 1). If given, ``optimizer.momentum`` is coupled to the learning
        rate by eq. (18); if ``None``, the momentum is left alone.
    optimizer : chainer.Optimizer or None
        Optimizer to adjust; the updater's ``'main'`` optimizer by default.

    Attributes
    ----------
    last_values : dict
        ``{'lr': η, 'momentum': m}`` as last set.
    """

    def __init__(self, lr_init, p_decay, e_start, e_end, momentum_init=None,
                 optimizer=None):
        super().__init__(optimizer)
        owner = 'PolynomialLRDecay'
        lr_init = _number(owner, 'lr_init', lr_init, lambda v: v > 0, ' > 0')
        p_decay = _number(owner, 'p_decay', p_decay, lambda v: v > 0,
                          ' > 0')
        e_start = _number(owner, 'e_start', e_start, lambda v: v >= 0,
                          ' >= 0')
        e_end = _number(owner, 'e_end', e_end)
        if not e_end > e_start:
            raise ValueError('e_end ({}) must be larger than e_start ({})'
                             .format(e_end, e_start))
        if momentum_init is not None:
            momentum_init = _number(owner, 'momentum_init', momentum_init,
                                    lambda v: 0 <= v < 1, ' in [0, 1)')
        self.lr_init = lr_init
        self.p_decay = p_decay
        self.e_start = e_start
        self.e_end = e_end
        self.momentum_init = momentum_init

    def values(self, epoch):
        lr = equations.polynomial_lr(epoch, self.lr_init, self.p_decay,
                                     self.e_start, self.e_end)
        if self.momentum_init is None:
            return {'lr': lr}
        return {'lr': lr, 'momentum': equations.coupled_momentum(
            lr, self.lr_init, self.momentum_init)}


class LinearWarmupLR(_EpochSchedule):
    """Linear learning-rate warm-up, then a decay schedule (Goyal et al.).

    For the momentum-SGD baseline: over the first ``warmup_epochs`` the
    learning rate rises linearly (per iteration, by fractional epoch) from
    ``warmup_start_lr`` (Goyal et al.: ``lr / k`` for a ``k`` times larger
    batch) to ``lr``; afterwards it is ``decay(epoch)``, e.g.
    :func:`step_decay` (÷10 at epochs 30, 60, 80) or
    :func:`polynomial_decay`.

    Parameters
    ----------
    lr : float
        Learning rate reached at the end of the warm-up.
    warmup_start_lr : float
        Learning rate at epoch 0.
    warmup_epochs : float, default 5.0
        Length of the warm-up in epochs (Goyal et al.: 5); 0 disables it.
    decay : callable or None, default None
        ``epoch -> learning rate`` after the warm-up; ``None`` keeps ``lr``.
    optimizer : chainer.Optimizer or None
        Optimizer to adjust; the updater's ``'main'`` optimizer by default.
    """

    def __init__(self, lr, warmup_start_lr, warmup_epochs=5.0, decay=None,
                 optimizer=None):
        super().__init__(optimizer)
        owner = 'LinearWarmupLR'
        lr = _number(owner, 'lr', lr, lambda v: v >= 0, ' >= 0')
        warmup_start_lr = _number(owner, 'warmup_start_lr', warmup_start_lr,
                                  lambda v: v >= 0, ' >= 0')
        warmup_epochs = _number(owner, 'warmup_epochs', warmup_epochs,
                                lambda v: v >= 0, ' >= 0')
        if decay is not None and not callable(decay):
            raise TypeError('LinearWarmupLR: decay={!r} must be a callable '
                            'epoch -> learning rate, or None'.format(decay))
        self.lr = lr
        self.warmup_start_lr = warmup_start_lr
        self.warmup_epochs = warmup_epochs
        self.decay = decay

    def values(self, epoch):
        if epoch < self.warmup_epochs:
            progress = epoch / self.warmup_epochs
            lr = self.warmup_start_lr + (self.lr - self.warmup_start_lr) \
                * progress
        elif self.decay is None:
            lr = self.lr
        else:
            lr = self.decay(epoch)
        return {'lr': lr}


def step_decay(lr, milestones=(30, 60, 80), factor=0.1):
    """``epoch -> lr · factor^(number of milestones <= epoch)``.

    Parameters
    ----------
    lr : float
        Learning rate before the first milestone.
    milestones : sequence of float, default (30, 60, 80)
        Epochs at which the rate is multiplied by ``factor`` (Goyal et al.:
        30, 60, 80).
    factor : float, default 0.1

    Returns
    -------
    callable
        ``epoch -> learning rate``, for :class:`LinearWarmupLR`'s ``decay``.
    """
    lr = _number('step_decay', 'lr', lr, lambda v: v >= 0, ' >= 0')
    factor = _number('step_decay', 'factor', factor, lambda v: v >= 0,
                     ' >= 0')
    try:
        milestones = sorted(_number('step_decay', 'milestones', m)
                            for m in milestones)
    except TypeError:
        raise TypeError('step_decay: milestones={!r} must be a sequence of '
                        'epochs'.format(milestones)) from None

    def schedule(epoch):
        return lr * factor ** bisect.bisect_right(milestones, epoch)
    return schedule


def polynomial_decay(lr, p_decay, e_start, e_end):
    """``epoch -> η(epoch)`` of eq. (17), for :class:`LinearWarmupLR`.

    Parameters
    ----------
    lr : float
        η(0), the rate until ``e_start``.
    p_decay : float
        The exponent (the baselines use 2: MLPerf's polynomial decay).
    e_start, e_end : float
        Where the decay starts and where it reaches 0 (``e_end > e_start``).

    Returns
    -------
    callable
        ``epoch -> learning rate``.
    """
    owner = 'polynomial_decay'
    lr = _number(owner, 'lr', lr, lambda v: v >= 0, ' >= 0')
    p_decay = _number(owner, 'p_decay', p_decay, lambda v: v > 0, ' > 0')
    e_start = _number(owner, 'e_start', e_start, lambda v: v >= 0, ' >= 0')
    e_end = _number(owner, 'e_end', e_end)
    if not e_end > e_start:
        raise ValueError('polynomial_decay: e_end ({}) must be larger than '
                         'e_start ({})'.format(e_end, e_start))

    def schedule(epoch):
        return equations.polynomial_lr(epoch, lr, p_decay, e_start, e_end)
    return schedule
