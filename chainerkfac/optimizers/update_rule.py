"""The update of one parameter: eqs. (19) and (20)."""
from typing import Optional

import chainer
from chainer import optimizer

from chainerkfac import fused

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
