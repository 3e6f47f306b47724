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
from chainerkfac.cudnn.descriptors import Descriptors, scalars


def activation_forward(x, mode, coef=0.0):
    """``y = f(x)`` for a ``CUDNN_ACTIVATION_*`` mode (``coef``: the clip
    of ``CLIPPED_RELU``)."""
    rt = runtime.current()
    lib, arrays = rt.lib, rt.arrays
    x = arrays.contiguous(x)
    y = arrays.empty(x.shape, x.dtype)
    one, zero = scalars(x.dtype)
    handle = rt.handle()
    with Descriptors(lib) as d:
        desc = d.as_4d(x)
        act_desc = d.activation(mode, coef)
        lib.call('cudnnActivationForward', handle, act_desc, one, desc,
                 arrays.pointer(x), zero, desc, arrays.pointer(y))
    return y


def activation_backward(x, y, gy, mode, coef=0.0):
    """The gradient of ``x`` from the forward's ``x``, ``y`` and ``gy``."""
    rt = runtime.current()
    lib, arrays = rt.lib, rt.arrays
    gx = arrays.empty(x.shape, x.dtype)
    x, y, gy = (arrays.contiguous(a) for a in (x, y, gy))
    one, zero = scalars(x.dtype)
    handle = rt.handle()
    with Descriptors(lib) as d:
        desc = d.as_4d(y)
        act_desc = d.activation(mode, coef)
        lib.call('cudnnActivationBackward', handle, act_desc, one, desc,
                 arrays.pointer(y), desc, arrays.pointer(gy), desc,
                 arrays.pointer(x), zero, desc, arrays.pointer(gx))
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
    rt = runtime.current()
    lib, arrays = rt.lib, rt.arrays
    x = arrays.contiguous(x)
    y = arrays.empty(x.shape, x.dtype)
    one, zero = scalars(x.dtype)
    handle = rt.handle()
    with Descriptors(lib) as d:
        desc, mode = _softmax_descriptor(d, x, axis)
        lib.call('cudnnSoftmaxForward', handle, algorithm, mode, one, desc,
                 arrays.pointer(x), zero, desc, arrays.pointer(y))
    return y


def softmax_backward(y, gy, axis, algorithm):
    """The gradient of the softmax's input from its output ``y`` and
    ``gy``."""
    rt = runtime.current()
    lib, arrays = rt.lib, rt.arrays
    gx = arrays.empty(y.shape, y.dtype)
    y, gy = arrays.contiguous(y), arrays.contiguous(gy)
    one, zero = scalars(y.dtype)
    handle = rt.handle()
    with Descriptors(lib) as d:
        desc, mode = _softmax_descriptor(d, y, axis)
        lib.call('cudnnSoftmaxBackward', handle, algorithm, mode, one, desc,
                 arrays.pointer(y), desc, arrays.pointer(gy), zero, desc,
                 arrays.pointer(gx))
    return gx
