"""Max and average pooling, as CuPy 13's ``cupyx.cudnn`` and with its
signatures (Chainer 7.8.1's ``F.max_pooling_2d`` / ``_nd`` and
``F.average_pooling_2d`` / ``_nd``; Chainer picks the mode, e.g.
``CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING`` for its 2-D average).

NaN is not propagated through max pooling (``CUDNN_NOT_PROPAGATE_NAN``, as
CuPy 13). Arrays are described N-d with C strides.
"""
from chainerkfac.cudnn import runtime
from chainerkfac.cudnn.descriptors import Descriptors, scalars


def pooling_forward(x, y, ksize, stride, pad, mode):
    """Pool ``x`` into the preallocated C-contiguous ``y``; returns ``y``."""
    rt = runtime.current()
    lib, arrays = rt.lib, rt.arrays
    x = arrays.contiguous(x)
    if not y.flags.c_contiguous:
        raise ValueError('pooling_forward supports c-contiguous y only')
    one, zero = scalars(x.dtype)
    handle = rt.handle()
    with Descriptors(lib) as d:
        x_desc, y_desc = d.tensor(x.shape, x.dtype), d.tensor(y.shape, y.dtype)
        pool_desc = d.pooling(ksize, stride, pad, mode)
        lib.call('cudnnPoolingForward', handle, pool_desc, one, x_desc,
                 arrays.pointer(x), zero, y_desc, arrays.pointer(y))
    return y


def pooling_backward(x, y, gy, ksize, stride, pad, mode):
    """The gradient of ``x`` from the forward's ``x``, ``y`` and ``gy``."""
    rt = runtime.current()
    lib, arrays = rt.lib, rt.arrays
    x, y, gy = (arrays.contiguous(a) for a in (x, y, gy))
    gx = arrays.empty(x.shape, x.dtype)
    one, zero = scalars(x.dtype)
    handle = rt.handle()
    with Descriptors(lib) as d:
        x_desc, y_desc = d.tensor(x.shape, x.dtype), d.tensor(y.shape, y.dtype)
        pool_desc = d.pooling(ksize, stride, pad, mode)
        lib.call('cudnnPoolingBackward', handle, pool_desc, one, y_desc,
                 arrays.pointer(y), y_desc, arrays.pointer(gy), x_desc,
                 arrays.pointer(x), zero, x_desc, arrays.pointer(gx))
    return gx
