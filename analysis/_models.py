"""The networks of :mod:`models` by the names ``train_imagenet.py --arch``
uses (through :func:`models.build_model`, the one factory), and their K-FAC
blocks as the optimizer registers them.
"""
from typing import Dict, List

import chainerkfac  # NOQA  (before chainer: NumPy-2 compatibility shims)
import chainer

import models
from chainerkfac.fisher_blocks import BlockOptions, build_blocks

from analysis._io import AnalysisError

ARCHS = models.ARCHS
DEFAULT_N_CLASS = models.DEFAULT_N_CLASS


def build_model(arch: str, n_class: int = None, depth: int = 8,
                width: int = 16) -> chainer.Chain:
    """:func:`models.build_model`, its errors as :class:`AnalysisError`
    (a one-line message and exit status 2 from the scripts)."""
    try:
        return models.build_model(arch, n_class, depth, width)
    except ValueError as e:
        raise AnalysisError('model {!r}: {}'.format(arch, e)) from None


def model_kwargs(facts: Dict) -> Dict:
    """``n_class``, ``depth``, ``width`` recorded in a run's ``"run"`` facts
    (those present), for :func:`build_model`."""
    return {key: int(facts[key]) for key in ('n_class', 'depth', 'width')
            if isinstance(facts.get(key), (int, float))}


def kfac_blocks(model, bn_fisher: str = 'full') -> List:
    """The Fisher blocks KFAC registers for ``model`` (fp32 factors)."""
    return build_blocks(model, BlockOptions('float32', bn_fisher))
