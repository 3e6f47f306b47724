"""Max and average pooling, as CuPy 13's ``cupyx.cudnn`` and with its
signatures (Chainer 7.8.1's ``F.max_pooling_2d`` / ``_nd`` and
``F.average_pooling_2d`` / ``_nd``; Chainer picks the mode, e.g.
``CUDNN_POOLING_AVERAGE_COUNT_INCLUDE_PADDING`` for its 2-D average).

NaN is not propagated through max pooling (``CUDNN_NOT_PROPAGATE_NAN``, as
CuPy 13). Arrays are described N-d with C strides.
"""
from chainerkfac.cudnn import plans
from chainerkfac.cudnn import runtime
from chainerkfac.cudnn.descriptors import scalars


def _build(d, x_shape, y_shape, dtype, ksize, stride, pad, mode):
    plan = plans.Plan(d)
    plan.x, plan.y = d.tensor(x_shape, dtype), d.tensor(y_shape, dtype)
    plan.pooling = d.pooling(ksize, stride, pad, mode)
    return plan


def _plan(x, y, ksize, stride, pad, mode):
    rt = runtime.current()
    key = ('pooling', x.shape, y.shape, x.dtype.char, tuple(ksize),
           tuple(stride), tuple(pad), mode)
    return rt, rt.plans.get(key, _build, x.shape, y.shape, x.dtype, ksize,
                            stride, pad, mode)


def pooling_forward(x, y, ksize, stride, pad, mode):
    """Pool ``x`` into the preallocated C-contiguous ``y``; returns ``y``."""
    if not y.flags.c_contiguous:
        raise ValueError('pooling_forward supports c-contiguous y only')
    arrays = runtime.current().arrays
    x = arrays.contiguous(x)
    rt, plan = _plan(x, y, ksize, stride, pad, mode)
    one, zero = scalars(x.dtype)
    rt.lib.call('cudnnPoolingForward', rt.handle(), plan.pooling, one,
                plan.x, arrays.pointer(x), zero, plan.y, arrays.pointer(y))
    return y


def pooling_backward(x, y, gy, ksize, stride, pad, mode):
    """The gradient of ``x`` from the forward's ``x``, ``y`` and ``gy``."""
    arrays = runtime.current().arrays
    x, y, gy = (arrays.contiguous(a) for a in (x, y, gy))
    rt, plan = _plan(x, y, ksize, stride, pad, mode)
    gx = arrays.empty(x.shape, x.dtype)
    one, zero = scalars(x.dtype)
    p = arrays.pointer
    rt.lib.call('cudnnPoolingBackward', rt.handle(), plan.pooling, one,
                plan.y, p(y), plan.y, p(gy), plan.x, p(x), zero, plan.x,
                p(gx))
    return gx
