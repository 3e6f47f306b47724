"""The paper's schedules as plain functions of the step or epoch.

Each function is one equation of Osawa et al. (CVPR 2019), written so that a
test can evaluate it at listed points. The optimizer (damping, refresh
intervals) and the training extensions (learning rate, momentum) call these;
nothing else re-implements them.
"""
import inspect
import math
from typing import Callable, Union

import numpy

#: A refresh interval: a constant number of K-FAC steps, or a callable of
#: ``(iteration, epoch)`` returning one.
RefreshInterval = Union[int, Callable[[int, int], int]]


def damping_warmup_rate(damping_init: float, damping_target: float,
                        warmup_steps: int) -> float:
    """Rate α of eq. (15): ``2 log10(γ(0) / γ_target) / t_warmup``.

    Clipped to 1, where eq. (16) reaches the target in one step.
    """
    if warmup_steps <= 0:
        raise ValueError('damping warm-up steps must be positive, got {}'
                         .format(warmup_steps))
    if damping_init <= 0 or damping_target <= 0:
        raise ValueError('damping values must be positive, got γ(0)={} '
                         'γ_target={}'.format(damping_init, damping_target))
    rate = 2.0 * math.log10(damping_init / damping_target) / warmup_steps
    return min(rate, 1.0)


def damping_step(damping: float, damping_target: float, rate: float
                 ) -> float:
    """Eq. (16): the next damping, ``(1 − α) γ(t) + α γ_target``."""
    return (1 - rate) * damping + rate * damping_target


def polynomial_lr(epoch: float, lr_init: float, p_decay: float,
                  e_start: float, e_end: float) -> float:
    """Learning rate η(e) of eq. (17) at a (fractional) epoch.

    Constant ``η(0)`` before ``e_start``, zero from ``e_end`` on.
    """
    if e_end <= e_start:
        raise ValueError('e_end ({}) must be larger than e_start ({})'
                         .format(e_end, e_start))
    if epoch <= e_start:
        return lr_init
    if epoch >= e_end:
        return 0.0
    return lr_init * (1.0 - (epoch - e_start) / (e_end - e_start)) ** p_decay


def coupled_momentum(lr: float, lr_init: float, momentum_init: float) -> float:
    """Momentum m(e) of eq. (18): ``m(0) / η(0) · η(e)``."""
    return momentum_init / lr_init * lr


def stale_interval_eq22(iteration: int, epoch: int) -> int:
    """Refresh interval of eq. (22): 1 before epoch 5, then
    ``min(20, 5 ⌊e / 5⌋ + 1)``."""
    if epoch < 5:
        return 1
    return min(20, 5 * (epoch // 5) + 1)


def stale_interval_eq23(iteration: int, epoch: int) -> int:
    """Refresh interval of eq. (23): 1 before epoch 13, then 20."""
    return 1 if epoch < 13 else 20


#: The published refresh schedules, by name.
REFRESH_PRESETS = {
    'eq22': stale_interval_eq22,
    'eq23': stale_interval_eq23,
}


def resolve_interval(interval: Union[RefreshInterval, str],
                     name: str = 'refresh interval'
                     ) -> Callable[[int, int], int]:
    """Turn an int, a preset name or a callable into a callable of
    ``(iteration, epoch)``.

    A callable must take ``(iteration, epoch)``; each value it returns is
    checked when used (:class:`CheckedInterval`), so that one returning
    ``'x'``, NaN, 0 or 2.5 fails naming ``name``, not in a comparison deep
    in the step (NaN silently meant "never refresh again").
    """
    if isinstance(interval, str):
        try:
            return REFRESH_PRESETS[interval]
        except KeyError:
            raise ValueError('unknown refresh schedule {!r}; presets are {}'
                             .format(interval, sorted(REFRESH_PRESETS)))
    if callable(interval):
        try:
            inspect.signature(interval).bind(0, 0)
        except TypeError as e:
            raise ValueError('{}: a callable must take (iteration, epoch): '
                             '{}'.format(name, e)) from None
        except ValueError:      # no signature to inspect (a builtin)
            pass
        return CheckedInterval(interval, name)
    if not _is_int(interval) or interval < 1:
        raise ValueError('a refresh interval must be a positive int, a '
                         'preset name or a callable, got {!r}'
                         .format(interval))
    return FixedInterval(int(interval))


def _is_int(value) -> bool:
    return isinstance(value, (int, numpy.integer)) and \
        not isinstance(value, (bool, numpy.bool_))


def _interval_value(value):
    """``value`` as an int >= 1, or None: ints and integral floats (a
    schedule written with float epochs, ``5 * (e // 5) + 1``)."""
    if _is_int(value):
        return int(value) if value >= 1 else None
    if isinstance(value, (float, numpy.floating)) and math.isfinite(value) \
            and value >= 1 and float(value).is_integer():
        return int(value)
    return None


class CheckedInterval:
    """A user's refresh schedule, each value it returns checked.

    Parameters
    ----------
    schedule : callable of (iteration, epoch)
    name : str
        The option it was given as, for the error.
    """

    def __init__(self, schedule: Callable, name: str):
        self.schedule = schedule
        self.name = name

    def __call__(self, iteration: int, epoch: int) -> int:
        value = self.schedule(iteration, epoch)
        checked = _interval_value(value)
        if checked is None:
            raise ValueError(
                '{}: the schedule returned {!r} at iteration {}, epoch {}; '
                'a refresh interval is an int >= 1'.format(
                    self.name, value, iteration, epoch))
        return checked

    def __repr__(self) -> str:
        return 'CheckedInterval({!r})'.format(self.schedule)


class FixedInterval:
    """A refresh interval that does not change: a callable of
    ``(iteration, epoch)``, picklable (the optimizer with it)."""

    def __init__(self, value: int):
        self.value = value

    def __call__(self, iteration: int, epoch: int) -> int:
        return self.value

    def __repr__(self) -> str:
        return 'FixedInterval({})'.format(self.value)
