"""What Chainer 7.8.1 imports as ``cupy.cuda.cudnn`` (CuPy 13's
``cupy_backends.cuda.libs.cudnn``): the constants, the version and the
error type. Chainer calls nothing else of it outside the RNN and spatial
transformer, which are refused (:mod:`chainerkfac.cudnn.not_served`).
"""
from chainerkfac.cudnn import not_served
from chainerkfac.cudnn import runtime
from chainerkfac.cudnn.constants import *  # NOQA
from chainerkfac.cudnn.library import CuDNNError  # NOQA


def getVersion() -> int:
    """The loaded cuDNN's version, major·10000 + minor·100 + patch (cuDNN
    9's numbering; Chainer's thresholds such as 5000 or 7000 pass)."""
    return runtime.current().lib.version()


__getattr__ = not_served.module_getattr('cupy.cuda.cudnn')
