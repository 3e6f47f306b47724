"""Fisher blocks, one class per supported link type.

Adding a layer type is adding one class and one line in :func:`block_for`.
"""
import chainer.links as L

from chainerkfac.fisher_blocks.base import FisherBlock, PlainBlock  # NOQA
from chainerkfac.fisher_blocks.batch_norm import BatchNormalizationBlock  # NOQA
from chainerkfac.fisher_blocks.batch_norm import BN_FISHER_MODES  # NOQA
from chainerkfac.fisher_blocks.kronecker import Convolution2DBlock  # NOQA
from chainerkfac.fisher_blocks.kronecker import LinearBlock  # NOQA


def block_for(name, link, factor_dtype, bn_fisher='full'):
    """The Fisher block for ``link``, or None if K-FAC does not model it."""
    if isinstance(link, L.Linear):
        return LinearBlock(name, link, factor_dtype)
    if isinstance(link, L.Convolution2D):
        return Convolution2DBlock(name, link, factor_dtype)
    if isinstance(link, L.BatchNormalization):
        return BatchNormalizationBlock(name, link, factor_dtype, bn_fisher)
    return None


def build_blocks(target, factor_dtype, bn_fisher='full'):
    """One block per parameterised link of ``target``, in model order.

    Parameters that belong to no supported link are collected in
    :class:`PlainBlock` objects (one per link) so that every parameter is in
    exactly one block.
    """
    blocks = []
    for name, link in target.namedlinks():
        # A link's own parameters (not those of its children).
        own = [getattr(link, n) for n in sorted(link._params)]
        if not own:
            continue
        block = block_for(name, link, factor_dtype, bn_fisher)
        if block is None:
            block = PlainBlock(name, link, factor_dtype, params=own)
        blocks.append(block)
    return blocks
