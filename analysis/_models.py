"""The networks of :mod:`models` by the names ``train_imagenet.py --arch``
uses, and their K-FAC blocks as the optimizer registers them.
"""
from typing import Dict, List

import chainerkfac  # NOQA  (before chainer: NumPy-2 compatibility shims)
import chainer
import numpy

import models
from chainerkfac.fisher_blocks import BlockOptions, build_blocks

from analysis._io import AnalysisError

#: Names accepted by :func:`build_model` (``train_imagenet.py --arch``).
ARCHS = ('resnet50', 'resnet50d', 'small')
#: Default classes: ImageNet for the ResNet-50s, 10 for the small ResNet.
DEFAULT_N_CLASS = {'resnet50': 1000, 'resnet50d': 1000, 'small': 10}
#: Input size of a dummy forward pass, should a model initialise lazily.
INPUT_SIZE = {'resnet50': 224, 'resnet50d': 224, 'small': 32}


def build_model(arch: str, n_class: int = None, depth: int = 8,
                width: int = 16) -> chainer.Chain:
    """A freshly initialised network, every parameter allocated.

    Parameters
    ----------
    arch : str
        One of :data:`ARCHS`.
    n_class : int, optional
        Output classes (default :data:`DEFAULT_N_CLASS`).
    depth, width : int
        Of the ``'small'`` ResNet only.

    Raises
    ------
    AnalysisError
        for an unknown ``arch`` or impossible sizes.
    """
    if arch not in ARCHS:
        raise AnalysisError('unknown model {!r}; choose from {}'.format(
            arch, ', '.join(ARCHS)))
    n_class = DEFAULT_N_CLASS[arch] if n_class is None else int(n_class)
    try:
        if arch == 'resnet50':
            model = models.ResNet50(n_class)
        elif arch == 'resnet50d':
            model = models.ResNet50D(n_class)
        else:
            model = models.SmallResNet(depth=depth, width=width,
                                       n_class=n_class)
    except ValueError as e:
        raise AnalysisError('model {!r}: {}'.format(arch, e)) from None
    if any(p.array is None for p in model.params()):
        # Lazily initialised parameters get their shapes from one forward.
        size = INPUT_SIZE[arch]
        x = numpy.zeros((1, 3, size, size), dtype=numpy.float32)
        with chainer.using_config('train', False), \
                chainer.no_backprop_mode():
            model(x)
    return model


def model_kwargs(facts: Dict) -> Dict:
    """``n_class``, ``depth``, ``width`` recorded in a run's ``"run"`` facts
    (those present), for :func:`build_model`."""
    return {key: int(facts[key]) for key in ('n_class', 'depth', 'width')
            if isinstance(facts.get(key), (int, float))}


def kfac_blocks(model, bn_fisher: str = 'full') -> List:
    """The Fisher blocks KFAC registers for ``model`` (fp32 factors)."""
    return build_blocks(model, BlockOptions('float32', bn_fisher))
