"""Max and average pooling, as CuPy 13's ``cupyx.cudnn`` and with its
signatures (Chainer 7.8.1's ``F.max_pooling_2d`` / ``_nd`` and
``F.average_pooling_2d`` / ``_nd``; Chainer picks the mode, e.g.
``CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING`` for its 2-D average).

NaN is not propagated through max pooling (``CUDNN_NOT_PROPAGATE_NAN``, as
CuPy 13). Arrays are described N-d with C strides.
"""
from chainerkfac.cudnn import runtime


def pooling_forward(x, y, ksize, stride, pad, mode):
    """Pool ``x`` into the preallocated C-contiguous ``y``; returns ``y``."""
    if not y.flags.c_contiguous:
        raise ValueError('pooling_forward supports c-contiguous y only')
    with runtime.call(x.dtype) as c:
        x = c.arrays.contiguous(x)
        x_desc = c.d.tensor(x.shape, x.dtype)
        y_desc = c.d.tensor(y.shape, y.dtype)
        c.lib.call('cudnnPoolingForward', c.handle,
                   c.d.pooling(ksize, stride, pad, mode), c.one, x_desc,
                   c.arrays.pointer(x), c.zero, y_desc, c.arrays.pointer(y))
    return y


def pooling_backward(x, y, gy, ksize, stride, pad, mode):
    """The gradient of ``x`` from the forward's ``x``, ``y`` and ``gy``."""
    with runtime.call(x.dtype) as c:
        x, y, gy = (c.arrays.contiguous(a) for a in (x, y, gy))
        gx = c.arrays.empty(x.shape, x.dtype)
        x_desc = c.d.tensor(x.shape, x.dtype)
        y_desc = c.d.tensor(y.shape, y.dtype)
        c.lib.call('cudnnPoolingBackward', c.handle,
                   c.d.pooling(ksize, stride, pad, mode), c.one, y_desc,
                   c.arrays.pointer(y), y_desc, c.arrays.pointer(gy), x_desc,
                   c.arrays.pointer(x), c.zero, x_desc, c.arrays.pointer(gx))
    return gx
