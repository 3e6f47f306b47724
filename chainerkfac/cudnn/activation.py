"""Activations and softmax, as CuPy 13's ``cupyx.cudnn`` and with its
signatures (Chainer 7.8.1's ``F.relu``, ``F.sigmoid``, ``F.tanh``,
``F.clipped_relu``, ``F.softmax``, ``F.log_softmax`` and so
``F.softmax_cross_entropy``).

An activation sees its array as ``(shape[0], size / shape[0], 1, 1)``; a
softmax over ``axis`` sees ``(before, axis, after, 1)``, over the channel
(``CUDNN_SOFTMAX_MODE_CHANNEL``) unless nothing follows the axis.
"""
from chainerkfac.cudnn import constants as C
from chainerkfac.cudnn import runtime


def activation_forward(x, mode, coef=0.0):
    """``y = f(x)`` for a ``CUDNN_ACTIVATION_*`` mode (``coef``: the clip
    of ``CLIPPED_RELU``)."""
    with runtime.call(x.dtype) as c:
        x = c.arrays.contiguous(x)
        y = c.arrays.empty(x.shape, x.dtype)
        desc = c.d.as_4d(x)
        c.lib.call('cudnnActivationForward', c.handle,
                   c.d.activation(mode, coef), c.one, desc,
                   c.arrays.pointer(x), c.zero, desc, c.arrays.pointer(y))
    return y


def activation_backward(x, y, gy, mode, coef=0.0):
    """The gradient of ``x`` from the forward's ``x``, ``y`` and ``gy``."""
    with runtime.call(x.dtype) as c:
        gx = c.arrays.empty(x.shape, x.dtype)
        x, y, gy = (c.arrays.contiguous(a) for a in (x, y, gy))
        desc = c.d.as_4d(y)
        c.lib.call('cudnnActivationBackward', c.handle,
                   c.d.activation(mode, coef), c.one, desc,
                   c.arrays.pointer(y), desc, c.arrays.pointer(gy), desc,
                   c.arrays.pointer(x), c.zero, desc, c.arrays.pointer(gx))
    return gx


def _softmax_descriptor(d, array, axis):
    """The ``(before, axis, after, 1)`` view and the softmax mode."""
    axis = axis % array.ndim
    before = after = 1
    for size in array.shape[:axis]:
        before *= size
    for size in array.shape[axis + 1:]:
        after *= size
    center = array.shape[axis]
    desc = d.tensor_4d(before, center, after, 1, array.dtype)
    if center == 1 and after == 1:
        return desc, C.CUDNN_SOFTMAX_MODE_INSTANCE
    return desc, C.CUDNN_SOFTMAX_MODE_CHANNEL


def softmax_forward(x, axis, algorithm):
    """Softmax over ``axis``; ``CUDNN_SOFTMAX_LOG`` gives log-softmax."""
    with runtime.call(x.dtype) as c:
        x = c.arrays.contiguous(x)
        y = c.arrays.empty(x.shape, x.dtype)
        desc, mode = _softmax_descriptor(c.d, x, axis)
        c.lib.call('cudnnSoftmaxForward', c.handle, algorithm, mode, c.one,
                   desc, c.arrays.pointer(x), c.zero, desc,
                   c.arrays.pointer(y))
    return y


def softmax_backward(y, gy, axis, algorithm):
    """The gradient of the softmax's input from its output ``y`` and
    ``gy``."""
    with runtime.call(y.dtype) as c:
        gx = c.arrays.empty(y.shape, y.dtype)
        y, gy = c.arrays.contiguous(y), c.arrays.contiguous(gy)
        desc, mode = _softmax_descriptor(c.d, y, axis)
        c.lib.call('cudnnSoftmaxBackward', c.handle, algorithm, mode, c.one,
                   desc, c.arrays.pointer(y), desc, c.arrays.pointer(gy),
                   c.zero, desc, c.arrays.pointer(gx))
    return gx
