"""Optimizers: :class:`KFAC`, a sibling of ``chainer.optimizers.MomentumSGD``;
:class:`LARS`, the MLPerf-0.6 seed's first-order large-batch baseline
(scaled or unscaled momentum); :class:`GuardedOptimizer`, any Chainer
optimizer driven like K-FAC (accumulation, skipped-step guard,
multi-process averaging, weight-update sharding); and
:class:`FusedMomentumSGD`, Chainer's MomentumSGD with its update in
multi-tensor kernels on the GPU."""
from chainerkfac.optimizers.fused_sgd import FusedMomentumSGD  # NOQA
from chainerkfac.optimizers.guarded import GuardedOptimizer  # NOQA
from chainerkfac.optimizers.kfac import KFAC  # NOQA
from chainerkfac.optimizers.lars import LARS  # NOQA
from chainerkfac.optimizers.lars import LARSRule  # NOQA
from chainerkfac.optimizers.update_rule import KFACRule  # NOQA
