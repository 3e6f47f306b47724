"""Fisher blocks, one class per modelled link type, and their registry.

Adding a layer type is one block class and one :func:`register_block`
call; the built-in types below are registered the same way.
"""
import chainer.links as L
from chainer.functions.activation import log_softmax as log_softmax_module
from chainer.functions.activation import softmax as softmax_module
from chainer.functions.loss import softmax_cross_entropy as sce_module

from chainerkfac.fisher_blocks.base import BlockOptions  # NOQA
from chainerkfac.fisher_blocks.base import FactorKind  # NOQA
from chainerkfac.fisher_blocks.base import FisherBlock  # NOQA
from chainerkfac.fisher_blocks.base import PlainBlock  # NOQA
from chainerkfac.fisher_blocks.base import Unsupported  # NOQA
from chainerkfac.fused import regularized_grad  # NOQA
from chainerkfac.fisher_blocks.batch_norm import BatchNormalizationBlock  # NOQA
from chainerkfac.fisher_blocks.batch_norm import BN_FISHER_MODES  # NOQA
from chainerkfac.fisher_blocks.kronecker import Convolution2DBlock  # NOQA
from chainerkfac.fisher_blocks.kronecker import KroneckerBlock  # NOQA
from chainerkfac.fisher_blocks.kronecker import LinearBlock  # NOQA
from chainerkfac.fisher_blocks.registry import block_for  # NOQA
from chainerkfac.fisher_blocks.registry import build_blocks  # NOQA
from chainerkfac.fisher_blocks.registry import plain_gradient  # NOQA
from chainerkfac.fisher_blocks.registry import logits_functions  # NOQA
from chainerkfac.fisher_blocks.registry import register_block  # NOQA
from chainerkfac.fisher_blocks.registry import register_logits_function  # NOQA

register_block(L.Linear, LinearBlock)
register_block(L.Convolution2D, Convolution2DBlock)
register_block(L.BatchNormalization, BatchNormalizationBlock)
# A subclass of BatchNormalization whose function corrects x̂ with running
# statistics (r, d): the BN block's capture would not see its calls.
register_block(L.BatchRenormalization, plain_gradient(
    'batch renormalization: x-hat corrected by r, d from running '
    'statistics, not modelled by the BN block'))

for _logits in (sce_module.SoftmaxCrossEntropy, log_softmax_module.LogSoftmax,
                softmax_module.Softmax):
    register_logits_function(_logits)
