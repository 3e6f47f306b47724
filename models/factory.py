"""One model factory for the training script, the analysis scripts and the
benchmarks: a network of :mod:`models` by its ``--arch`` name.

>>> import models
>>> net = models.build_model('small', n_class=10, depth=8, width=16)
"""
import chainer
import numpy

from models.resnet50 import ResNet50
from models.resnet50d import ResNet50D
from models.small_resnet import SmallResNet

#: Names accepted by :func:`build_model` (``train_imagenet.py --arch``).
ARCHS = ('resnet50', 'resnet50d', 'small')
#: Default classes: ImageNet for the ResNet-50s, 10 for the small ResNet.
DEFAULT_N_CLASS = {'resnet50': 1000, 'resnet50d': 1000, 'small': 10}
#: Input side of the dummy forward pass of :func:`build_model` (the size
#: each network is meant for).
INPUT_SIZE = {'resnet50': 224, 'resnet50d': 224, 'small': 32}


def build_model(arch, n_class=None, depth=8, width=16):
    """A freshly initialised network, every parameter allocated.

    The initial values come from NumPy's global random state (seed it for
    the same weights on every process).

    Parameters
    ----------
    arch : str
        One of :data:`ARCHS`.
    n_class : int, optional
        Output classes (default :data:`DEFAULT_N_CLASS` of ``arch``).
    depth, width : int
        Of the ``'small'`` ResNet only (``depth = 6 n + 2``).

    Returns
    -------
    chainer.Chain
        Maps ``(N, 3, H, W)`` to logits ``(N, n_class)``.

    Raises
    ------
    ValueError
        An unknown ``arch`` (naming the choices) or impossible sizes.
    """
    if arch not in ARCHS:
        raise ValueError('unknown model {!r}; choose from {}'.format(
            arch, ', '.join(ARCHS)))
    n_class = DEFAULT_N_CLASS[arch] if n_class is None else int(n_class)
    if n_class < 1:
        raise ValueError('n_class must be at least 1, got {}'.format(n_class))
    if arch == 'resnet50':
        model = ResNet50(n_class)
    elif arch == 'resnet50d':
        model = ResNet50D(n_class)
    else:
        model = SmallResNet(depth=depth, width=width, n_class=n_class)
    if any(p.array is None for p in model.params()):
        # Lazily initialised parameters get their shapes from one forward.
        size = INPUT_SIZE[arch]
        x = numpy.zeros((1, 3, size, size), dtype=numpy.float32)
        with chainer.using_config('train', False), \
                chainer.no_backprop_mode():
            model(x)
    return model
