"""Activations of the residual layers and their slopes σ'(z).

The adjoint MGRIT applies a layer's transposed Jacobian many times at the
same forward state (on every level and iteration), so each activation comes
with its slope as a plain array function: the adjoint computes σ'(K u + b)
once per layer and reuses it. The slopes are computed exactly as Chainer's
own backward computes them, so a converged adjoint reproduces Chainer's
backprop to rounding.
"""
from typing import Callable, Dict, NamedTuple

import chainer
import chainer.functions as F
from chainer import backend
from chainer import function_node

#: Half-width η of the band around zero where the smoothed ReLU is quadratic
#: (the seed's value, eq. 5.34).
SMOOTH_RELU_ETA = 0.1


def _smooth_relu_arrays(x, eta):
    """σ(x) and σ'(x) of the smoothed ReLU as arrays of ``x``'s type."""
    xp = backend.get_array_module(x)
    band = xp.abs(x) < eta
    y = xp.where(band, x * x / (4 * eta) + x / 2 + eta / 4,
                 xp.maximum(x, 0)).astype(x.dtype, copy=False)
    slope = xp.where(band, x / (2 * eta) + 0.5,
                     (x > 0)).astype(x.dtype, copy=False)
    return y, slope


class SmoothReLU(function_node.FunctionNode):
    """σ(x) = x²/(4η) + x/2 + η/4 for |x| < η, else max(x, 0).

    Continuously differentiable (σ' runs linearly from 0 to 1 across the
    band). Differentiable once: the backward is a product with a constant
    slope array, enough for gradients, not for double backprop.
    """

    def __init__(self, eta: float = SMOOTH_RELU_ETA):
        self.eta = eta

    def forward(self, inputs):
        x, = inputs
        y, self._slope = _smooth_relu_arrays(x, self.eta)
        return y,

    def backward(self, indexes, grad_outputs):
        gy, = grad_outputs
        return gy * self._slope,


def smooth_relu(x, eta: float = SMOOTH_RELU_ETA) -> chainer.Variable:
    """The seed's smoothed ReLU (eq. 5.34), a Chainer function."""
    return SmoothReLU(eta).apply((x,))[0]


def _smooth_relu_slope(z):
    return _smooth_relu_arrays(z, SMOOTH_RELU_ETA)[1]


def _tanh_slope(z):
    # Chainer's tanh backward: gy * (1 - y * y) with y = tanh(z).
    y = backend.get_array_module(z).tanh(z)
    return 1 - y * y


def _relu_slope(z):
    # Chainer's ReLU backward multiplies by (y > 0).
    return (z > 0).astype(z.dtype)


class Activation(NamedTuple):
    """σ as a Chainer function and σ' as an array function of z."""

    function: Callable
    slope: Callable


ACTIVATIONS: Dict[str, Activation] = {
    'smooth_relu': Activation(smooth_relu, _smooth_relu_slope),
    'tanh': Activation(F.tanh, _tanh_slope),
    'relu': Activation(F.relu, _relu_slope),
}


def get(name: str) -> Activation:
    """The activation called ``name`` (one of :data:`ACTIVATIONS`)."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError('activation must be one of {}, not {!r}'.format(
            sorted(ACTIVATIONS), name)) from None
