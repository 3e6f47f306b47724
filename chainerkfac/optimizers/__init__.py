"""Optimizers: :class:`KFAC`, a sibling of ``chainer.optimizers.MomentumSGD``,
and :class:`GuardedOptimizer`, any Chainer optimizer driven the same way
(accumulation, skipped-step guard, multi-process averaging)."""
from chainerkfac.optimizers.guarded import GuardedOptimizer  # NOQA
from chainerkfac.optimizers.kfac import KFAC  # NOQA
from chainerkfac.optimizers.update_rule import KFACRule  # NOQA
