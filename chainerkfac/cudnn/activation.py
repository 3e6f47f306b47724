"""Activations and softmax, as CuPy 13's ``cupyx.cudnn`` and with its
signatures (Chainer 7.8.1's ``F.relu``, ``F.sigmoid``, ``F.tanh``,
``F.clipped_relu``, ``F.softmax``, ``F.log_softmax`` and so
``F.softmax_cross_entropy``).

An activation sees its array as ``(shape[0], size / shape[0], 1, 1)``; a
softmax over ``axis`` sees ``(before, axis, after, 1)``, over the channel
(``CUDNN_SOFTMAX_MODE_CHANNEL``) unless nothing follows the axis.
"""
from chainerkfac.cudnn import constants as C
from chainerkfac.cudnn import plans
from chainerkfac.cudnn import runtime
from chainerkfac.cudnn.descriptors import scalars


def _build_activation(d, shape, dtype, mode, coef):
    plan = plans.Plan(d)
    first = shape[0] if shape else 1
    size = 1
    for extent in shape:
        size *= extent
    plan.x = d.tensor_4d(first, size // max(first, 1), 1, 1, dtype)
    plan.activation = d.activation(mode, coef)
    return plan


def _activation_plan(x, mode, coef):
    rt = runtime.current()
    key = ('activation', x.shape, x.dtype.char, mode, coef)
    return rt, rt.plans.get(key, _build_activation, x.shape, x.dtype, mode,
                            coef)


def activation_forward(x, mode, coef=0.0):
    """``y = f(x)`` for a ``CUDNN_ACTIVATION_*`` mode (``coef``: the clip
    of ``CLIPPED_RELU``)."""
    arrays = runtime.current().arrays
    x = arrays.contiguous(x)
    rt, plan = _activation_plan(x, mode, coef)
    y = arrays.empty(x.shape, x.dtype)
    one, zero = scalars(x.dtype)
    rt.lib.call('cudnnActivationForward', rt.handle(), plan.activation, one,
                plan.x, arrays.pointer(x), zero, plan.x, arrays.pointer(y))
    return y


def activation_backward(x, y, gy, mode, coef=0.0):
    """The gradient of ``x`` from the forward's ``x``, ``y`` and ``gy``."""
    arrays = runtime.current().arrays
    gx = arrays.empty(x.shape, x.dtype)
    x, y, gy = (arrays.contiguous(a) for a in (x, y, gy))
    rt, plan = _activation_plan(y, mode, coef)
    one, zero = scalars(x.dtype)
    p = arrays.pointer
    rt.lib.call('cudnnActivationBackward', rt.handle(), plan.activation, one,
                plan.x, p(y), plan.x, p(gy), plan.x, p(x), zero, plan.x,
                p(gx))
    return gx


def _build_softmax(d, shape, axis, dtype):
    """The ``(before, axis, after, 1)`` view and the softmax mode."""
    plan = plans.Plan(d)
    axis = axis % len(shape)
    before = after = 1
    for size in shape[:axis]:
        before *= size
    for size in shape[axis + 1:]:
        after *= size
    center = shape[axis]
    plan.x = d.tensor_4d(before, center, after, 1, dtype)
    plan.mode = (C.CUDNN_SOFTMAX_MODE_INSTANCE if center == 1 and after == 1
                 else C.CUDNN_SOFTMAX_MODE_CHANNEL)
    return plan


def _softmax_plan(x, axis):
    rt = runtime.current()
    key = ('softmax', x.shape, axis, x.dtype.char)
    return rt, rt.plans.get(key, _build_softmax, x.shape, axis, x.dtype)


def softmax_forward(x, axis, algorithm):
    """Softmax over ``axis``; ``CUDNN_SOFTMAX_LOG`` gives log-softmax."""
    arrays = runtime.current().arrays
    x = arrays.contiguous(x)
    rt, plan = _softmax_plan(x, axis)
    y = arrays.empty(x.shape, x.dtype)
    one, zero = scalars(x.dtype)
    rt.lib.call('cudnnSoftmaxForward', rt.handle(), algorithm, plan.mode,
                one, plan.x, arrays.pointer(x), zero, plan.x,
                arrays.pointer(y))
    return y


def softmax_backward(y, gy, axis, algorithm):
    """The gradient of the softmax's input from its output ``y`` and
    ``gy``."""
    arrays = runtime.current().arrays
    gx = arrays.empty(y.shape, y.dtype)
    y, gy = arrays.contiguous(y), arrays.contiguous(gy)
    rt, plan = _softmax_plan(y, axis)
    one, zero = scalars(y.dtype)
    p = arrays.pointer
    rt.lib.call('cudnnSoftmaxBackward', rt.handle(), algorithm, plan.mode,
                one, plan.x, p(y), plan.x, p(gy), zero, plan.x, p(gx))
    return gx
