"""The choices and checks of :class:`~chainerkfac.optimizers.KFAC`'s
arguments, in one place.

The optimizer checks its arguments here, and so does anything that builds
one from another source (``config/loader.py`` from a JSON file): one list of
allowed values, one wording of what is wrong.
"""
import math
from typing import Any

import numpy

from chainerkfac import dtypes
from chainerkfac import equations
from chainerkfac.fisher_blocks.batch_norm import BN_FISHER_MODES  # NOQA
from chainerkfac.linalg import INVERSE_METHODS  # NOQA

#: ``fisher``: the empirical Fisher (true labels, the paper), labels drawn
#: from the model's softmax (Monte-Carlo), or the loss Hessian's exact
#: root (KFLR's output factor).
FISHER_TYPES = ('emp', 'mc', 'exact')
#: ``factor_dtype``: precision of the factors' products.
FACTOR_DTYPES = ('float32', 'float16', 'tf32')

PRECONDITION_DTYPES = ('float32', 'tf32')
#: ``loss_reduction``: how the loss reduces over the mini-batch.
LOSS_REDUCTIONS = ('mean', 'sum')
#: ``conv_a_strategy``: how a convolution forms A (None: the library's
#: choice, by cost on the CPU, by timing on the GPU under autotune).
CONV_A_STRATEGIES = ('unfolded', 'shifted')
#: ``weight_rescale``: the string value (besides True / False).
WEIGHT_RESCALE_CHOICES = ('auto',)


class OptionError(ValueError):
    """An invalid argument of :class:`~chainerkfac.optimizers.KFAC`.

    Attributes
    ----------
    name : str
        The argument (``'damping'``).
    value : object
        What was given.
    why : str
        What is wrong, e.g. ``'must be positive'``.
    """

    def __init__(self, name: str, value: Any, why: str,
                 owner: str = 'KFAC'):
        self.name = name
        self.value = value
        self.why = why
        super().__init__('{}: {}={!r} {}'.format(owner, name, value, why))


def _positive(value) -> bool:
    return _is_number(value) and value > 0 and math.isfinite(value)


def _is_number(value) -> bool:
    return isinstance(value, (int, float, numpy.number)) and \
        not isinstance(value, bool)


def _positive_int(value) -> bool:
    return isinstance(value, (int, numpy.integer)) and \
        not isinstance(value, bool) and value >= 1


def _refresh_interval(value) -> bool:
    try:
        equations.resolve_interval(value)
    except ValueError:
        return False
    return True


def _is_bool(value) -> bool:
    return isinstance(value, (bool, numpy.bool_))


def _dtype_name(value) -> str:
    try:
        return str(numpy.dtype(value))
    except TypeError:
        return repr(value)


_RULES = {
    'lr': (lambda v: _is_number(v) and v >= 0 and math.isfinite(v),
           'must be a finite number >= 0'),
    'momentum': (lambda v: _is_number(v) and 0 <= v < 1,
                 'must lie in [0, 1)'),
    'damping': (_positive, 'must be a finite positive number'),
    'damping_target': (lambda v: v is None or _positive(v),
                       'must be a finite positive number (or None)'),
    'damping_warmup_steps': (lambda v: v is None or _positive_int(v),
                             'must be an int >= 1 (or None)'),
    'rho_bn': (_positive, 'must be a finite positive number'),
    'bn_fisher': (lambda v: v in BN_FISHER_MODES,
                  'must be one of {}'.format(BN_FISHER_MODES)),
    'fisher': (lambda v: v in FISHER_TYPES,
               'must be one of {}'.format(FISHER_TYPES)),
    'mc_samples': (_positive_int, 'must be an int >= 1'),
    'acc_iters': (_positive_int, 'must be an int >= 1'),
    'refresh_interval_a': (_refresh_interval,
                           'must be a refresh interval: a positive int, a '
                           'preset name {} or a callable'.format(sorted(
                               equations.REFRESH_PRESETS))),
    'factor_dtype': (lambda v: dtypes.is_tf32(v) or
                     _dtype_name(v) in FACTOR_DTYPES,
                     'must be one of {}'.format(FACTOR_DTYPES)),
    'precondition_dtype': (lambda v: dtypes.is_tf32(v) or
                           _dtype_name(v) in PRECONDITION_DTYPES,
                           'must be one of {}'.format(PRECONDITION_DTYPES)),
    'factor_decay': (lambda v: _is_number(v) and 0 <= v < 1,
                     'must lie in [0, 1)'),
    'weight_rescale': (lambda v: _is_bool(v) or
                       v in WEIGHT_RESCALE_CHOICES,
                       "must be 'auto', True or False"),
    'loss_reduction': (lambda v: v in LOSS_REDUCTIONS,
                       'must be one of {}'.format(LOSS_REDUCTIONS)),
    'max_factor_dim': (lambda v: v is None or _positive_int(v),
                       'must be an int >= 1 (or None: no limit)'),
    'inverse_method': (lambda v: v in INVERSE_METHODS,
                       'must be one of {}'.format(INVERSE_METHODS)),
    'low_rank': (_is_bool, 'must be True or False'),
    'kl_clip': (lambda v: v is None or _positive(v),
                'must be a finite positive number (or None: no bound)'),
    'shard_update': (_is_bool, 'must be True or False'),
    'process_local': (_is_bool,
                      'must be True or False'),
    'verbose': (_is_bool, 'must be True or False'),
    'fisher_diff': (_is_bool, 'must be True or False'),
    'seed': (lambda v: v is None or (
        isinstance(v, (int, numpy.integer)) and not isinstance(v, bool) and
        0 <= v < 2 ** 32), 'must be an int in [0, 2**32) (or None)'),
    'conv_a_strategy': (lambda v: v is None or v in CONV_A_STRATEGIES,
                        'must be one of {} (or None: the cheaper)'.format(
                            CONV_A_STRATEGIES)),
}
_RULES['refresh_interval_g'] = _RULES['refresh_interval_a']
_RULES['refresh_interval_f'] = _RULES['refresh_interval_a']

#: The arguments :func:`check_option` knows.
CHECKED_OPTIONS = tuple(_RULES)


def integral(value):
    """``value`` as an ``int`` where it is a float of an integer value
    (Chainer's shift extensions set NumPy floats: ``StepShift('acc_iters',
    2, 4, init=1)`` sets 1.0), else unchanged (for the check to refuse
    2.5)."""
    if isinstance(value, (float, numpy.floating)) and \
            numpy.isfinite(value) and float(value).is_integer():
        return int(value)
    return value


def check_option(name: str, value, owner: str = 'KFAC') -> None:
    """Raise :class:`OptionError` if ``value`` is not allowed for the
    argument ``name`` of :class:`~chainerkfac.optimizers.KFAC`.

    Parameters
    ----------
    name : str
        One of :data:`CHECKED_OPTIONS`.
    value : object
    owner : str
        The class the message names (another optimizer that takes the
        same argument).

    Raises
    ------
    OptionError
        naming the argument, the value and what is wrong.
    KeyError
        if ``name`` is not an argument this module checks.
    """
    ok, why = _RULES[name]
    if name.startswith('refresh_interval_') and callable(value):
        try:
            equations.resolve_interval(value, name)
        except ValueError as e:
            raise OptionError(name, value, 'is not a schedule: {}'.format(e),
                              owner) from None
    if not ok(value):
        raise OptionError(name, value, why, owner)


def check_options(**options) -> None:
    """:func:`check_option` for each keyword, then the rules that tie
    several arguments together (the damping warm-up's pair, and its
    direction)."""
    for name, value in options.items():
        check_option(name, value)
    if 'damping_target' in options or 'damping_warmup_steps' in options:
        target = options.get('damping_target')
        steps = options.get('damping_warmup_steps')
        if (target is None) != (steps is None):
            raise OptionError(
                'damping_target' if target is None else
                'damping_warmup_steps', target if target is None else steps,
                'goes with the other of damping_target / '
                'damping_warmup_steps (eqs. 15-16): give both or neither')
        damping = options.get('damping')
        if target is not None and damping is not None and target > damping:
            # α of eq. (15) is then negative and eq. (16) runs away from
            # the target: γ crosses 0 within the warm-up
            raise OptionError(
                'damping_target', target,
                'is larger than damping={!r}: the warm-up of eqs. (15-16) '
                'only lowers γ from γ(0) = damping to the target (with '
                'γ_target > γ(0), α of eq. 15 is negative and γ runs away, '
                'below 0; the paper\'s "γtarget > γ(0)" is a typo for its '
                '"start with a large damping and gradually decrease it")'
                .format(damping))
