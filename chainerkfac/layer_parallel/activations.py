"""Activations of the residual layers: σ as a Chainer function, and σ(z)
and σ'(z) as array functions.

MGRIT applies each layer many times on plain arrays, and its adjoint
applies a layer's transposed Jacobian many times at the same forward state,
so every activation also comes as array functions that may write in place
(no temporaries the size of the state beyond what they need) and as its
slope σ'(z), which the adjoint computes once per layer. The array
functions are the very code of the Chainer function's forward and
backward, so MGRIT reproduces Chainer's serial forward and backprop to the
last bit where it performs the same operations.
"""
from typing import Callable, Dict, NamedTuple

import chainer
import chainer.functions as F
from chainer import backend
from chainer import function_node

#: Half-width η of the band around zero where the smoothed ReLU is quadratic
#: (the seed's value, eq. 5.34).
SMOOTH_RELU_ETA = 0.1


def _smooth_relu_values(x, out=None, eta=SMOOTH_RELU_ETA):
    """σ(x) = x²/(4η) + x/2 + η/4 = (x + η)²/(4η) on |x| < η, else
    max(x, 0); computed as s²/(4η) + max(x - η, 0) with
    s = clip(x + η, 0, 2η), without branches. ``out`` may be ``x``."""
    xp = backend.get_array_module(x)
    s = x + eta
    xp.clip(s, 0, 2 * eta, out=s)
    s *= s
    s /= 4 * eta
    out = xp.subtract(x, eta, out=out)
    xp.maximum(out, 0, out=out)
    out += s
    return out


def _smooth_relu_slope(x, out=None, eta=SMOOTH_RELU_ETA):
    """σ'(x) = clip((x + η) / (2η), 0, 1). ``out`` may be ``x``."""
    xp = backend.get_array_module(x)
    out = xp.add(x, eta, out=out)
    out /= 2 * eta
    xp.clip(out, 0, 1, out=out)
    return out


class SmoothReLU(function_node.FunctionNode):
    """The seed's smoothed ReLU (eq. 5.34): σ(x) = x²/(4η) + x/2 + η/4 for
    |x| < η, else max(x, 0).

    Continuously differentiable (σ' runs linearly from 0 to 1 across the
    band). Differentiable once: the backward multiplies by a constant
    slope array, enough for gradients, not for double backprop.
    """

    def __init__(self, eta: float = SMOOTH_RELU_ETA):
        self.eta = eta

    def forward(self, inputs):
        self.retain_inputs((0,))
        x, = inputs
        return _smooth_relu_values(x, eta=self.eta),

    def backward(self, indexes, grad_outputs):
        x, = self.get_retained_inputs()
        gy, = grad_outputs
        return gy * _smooth_relu_slope(x.array, eta=self.eta),


def smooth_relu(x, eta: float = SMOOTH_RELU_ETA) -> chainer.Variable:
    """The seed's smoothed ReLU (eq. 5.34), a Chainer function."""
    return SmoothReLU(eta).apply((x,))[0]


def _tanh_values(x, out=None):
    # Chainer's tanh forward on the CPU: numpy.tanh.
    return backend.get_array_module(x).tanh(x, out=out)


def _tanh_slope(x, out=None):
    # Chainer's tanh backward: gy * (1 - y * y), y = tanh(x).
    xp = backend.get_array_module(x)
    y = xp.tanh(x, out=out)
    one = y.dtype.type(1)
    return xp.subtract(one, y * y, out=y)


def _relu_values(x, out=None):
    return backend.get_array_module(x).maximum(x, 0, out=out)


def _relu_slope(x, out=None):
    # Chainer's ReLU backward multiplies by (y > 0), y = max(x, 0).
    positive = x > 0
    if out is None:
        return positive.astype(x.dtype)
    out[...] = positive
    return out


class Activation(NamedTuple):
    """σ as a Chainer function; σ(z) and σ'(z) as array functions
    ``(z, out=None)`` whose ``out`` may be ``z`` itself."""

    function: Callable
    values: Callable
    slope: Callable


ACTIVATIONS: Dict[str, Activation] = {
    'smooth_relu': Activation(smooth_relu, _smooth_relu_values,
                              _smooth_relu_slope),
    'tanh': Activation(F.tanh, _tanh_values, _tanh_slope),
    'relu': Activation(F.relu, _relu_values, _relu_slope),
}


def get(name: str) -> Activation:
    """The activation called ``name`` (one of :data:`ACTIVATIONS`)."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError('activation must be one of {}, not {!r}'.format(
            sorted(ACTIVATIONS), name)) from None
