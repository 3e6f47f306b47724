"""The update of one parameter: eqs. (19) and (20); and of many at once."""
from typing import Optional, Sequence, Tuple

import numpy

import chainer
from chainer import optimizer

from chainerkfac import fused
from chainerkfac import multi_tensor
from chainerkfac.optimizers import hooks

#: ε of eq. (20).
RESCALE_EPS = fused.RESCALE_EPS

_default_hyperparam = optimizer.Hyperparameter()
_default_hyperparam.lr = 0.01
_default_hyperparam.momentum = 0.9


class KFACRule(optimizer.UpdateRule):
    """Update rule of one parameter: eqs. (19) and (20).

    ``w ← w − η G + m (w − w_prev)``, then, where eq. (20) applies,
    ``w ← √(2·d_out) · w / (‖w‖ + ε)``. The state ``v`` holds the last
    displacement ``w(t) − w(t−1)`` of the (rescaled) weights. The direction
    ``G`` is handed over by the optimizer for each step in
    :attr:`direction`.
    """

    def __init__(self, parent_hyperparam=None, lr=None, momentum=None):
        super().__init__(parent_hyperparam or _default_hyperparam)
        if lr is not None:
            self.hyperparam.lr = lr
        if momentum is not None:
            self.hyperparam.momentum = momentum
        #: Target norm of eq. (20), or None for no rescaling.
        self.rescale_norm: Optional[float] = None
        #: Preconditioned gradient for the coming update (consumed by it).
        self.direction = None

    def init_state(self, param):
        with chainer.using_device(param.device):
            self.state['v'] = param.device.xp.zeros_like(param.array)

    def update_core_cpu(self, param):
        direction, self.direction = self.direction, None
        if direction is None:
            return
        fused.momentum_step(param.array, self.state['v'], direction,
                            self.hyperparam.lr, self.hyperparam.momentum,
                            self.rescale_norm)

    # One fused kernel per parameter (three with eq. 20) on the GPU.
    update_core_gpu = update_core_cpu


def apply_all(pairs: Sequence[Tuple[object, object]]) -> None:
    """``param.update()`` with ``direction`` for each pair, as
    :class:`KFACRule` does it: the parameters of a plain rule (a KFACRule,
    enabled, no hooks; float32 / float64 C-contiguous device arrays) go in
    multi-tensor kernels grouped by device, dtype, η, m and whether eq.
    (20) rescales them (:func:`chainerkfac.multi_tensor.momentum_step`:
    the same expressions, the norm summed in another order); every other,
    and every parameter on the CPU, through its rule."""
    groups = {}
    for param, direction in pairs:
        rule = param.update_rule
        key = _fused_key(param, rule, direction)
        if key is None or not _fused_takes(rule, param):
            rule.direction = direction
            with hooks.rule_hooks_done(rule):
                param.update()
            continue
        groups.setdefault(key, []).append((param, direction))
    for key, members in groups.items():
        hyperparam = members[0][0].update_rule.hyperparam
        rescaled = key[-1]
        with chainer.using_device(members[0][0].device):
            multi_tensor.momentum_step(
                [p.array for p, _ in members],
                [p.update_rule.state['v'] for p, _ in members],
                [d for _, d in members], hyperparam.lr, hyperparam.momentum,
                [p.update_rule.rescale_norm for p, _ in members]
                if rescaled else None)


def _fused_takes(rule, param) -> bool:
    """Count the step and make the state of a fused parameter; False
    (nothing counted) where its velocity does not fit the kernels."""
    rule.t += 1
    rule._init_states(param)
    if _takes(rule.state['v'], param.array):
        return True
    rule.t -= 1
    return False


def _fused_key(param, rule, direction):
    if type(rule) is not KFACRule or not rule.enabled or \
            rule._use_fp32_update or param._loss_scale is not None:
        return None
    hookable = rule._hookable
    if hookable._pre_update_hooks or hookable._post_update_hooks:
        return None
    array = param.array
    if array is None or type(array) is numpy.ndarray:
        return None        # the CPU: rule by rule (fused's NumPy twin)
    if array.dtype not in multi_tensor.DTYPES or \
            not array.flags.c_contiguous or \
            getattr(direction, 'dtype', None) != array.dtype or \
            not direction.flags.c_contiguous:
        return None
    hyper = rule.hyperparam
    return (str(param.device), array.dtype.str, multi_tensor.group_key(hyper.lr),
            multi_tensor.group_key(hyper.momentum), rule.rescale_norm is not None)


def _takes(velocity, array) -> bool:
    return (type(velocity) is type(array) and velocity.dtype == array.dtype
            and velocity.flags.c_contiguous)
