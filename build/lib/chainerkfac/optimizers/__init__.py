"""Optimizers: :class:`KFAC`, a sibling of ``chainer.optimizers.MomentumSGD``."""
from chainerkfac.optimizers.kfac import KFAC  # NOQA
from chainerkfac.optimizers.kfac import KFACRule  # NOQA
