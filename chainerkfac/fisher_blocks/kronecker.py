"""Kronecker-factored blocks: ``F ≈ G ⊗ A`` for Linear and Convolution2D.

With the weight matrix ``W`` of shape (d_out, d_in) (a convolution's kernel
flattened to (d_out, C·kh·kw)) and the bias appended as the last column,

* ``A = E[a aᵀ]`` from the layer input ``a`` (augmented with a 1 when the
  layer has a bias); for a convolution ``a`` runs over the im2col patches and
  ``A`` is summed over spatial locations and averaged over the batch (KFC,
  Grosse & Martens 2016);
* ``G = E[g gᵀ]`` from the per-sample gradient ``g`` of the loss w.r.t. the
  layer output. The loss is a mean over the batch, so the backward pass
  delivers ``g / N``; the per-sample gradient is ``N`` times that. For a
  convolution ``G`` is averaged over the batch and the locations.

The damped inverse ``(G ⊗ A + γI)⁻¹`` is approximated by
``(G + γ_G I)⁻¹ ⊗ (A + γ_A I)⁻¹`` with the trace-norm split
``γ_A = π√γ``, ``γ_G = √γ/π``, ``π² = (tr A / dim A) / (tr G / dim G)``.
"""
import math

import numpy

import chainer.functions.connection.convolution_2d as conv2d_module
import chainer.functions.connection.linear as linear_module
from chainer.backend import get_array_module
from chainer.utils import conv

from chainerkfac import linalg
from chainerkfac.fisher_blocks.base import (FactorKind, FisherBlock,
                                            Unsupported)
from chainerkfac.fused import regularized_grad


class KroneckerBlock(FisherBlock):
    """Shared maths of the Linear and Convolution2D blocks."""

    factor_kinds = {'A': FactorKind.INPUTS, 'G': FactorKind.OUTPUT_GRADS}

    @property
    def params(self):
        params = [self.link.W]
        if self.has_bias:
            params.append(self.link.b)
        return params

    @property
    def has_bias(self) -> bool:
        return getattr(self.link, 'b', None) is not None

    @property
    def out_size(self) -> int:
        """d_out: output units (Linear) or channels (Convolution2D)."""
        out = getattr(self.link, 'out_size', None)
        return int(out if out is not None else self.link.out_channels)

    @property
    def in_size(self) -> int:
        """Columns of the weight matrix, bias column included."""
        return int(numpy.prod(self.link.W.shape[1:])) + int(self.has_bias)

    def factor_shapes(self):
        return {'A': (self.in_size, self.in_size),
                'G': (self.out_size, self.out_size)}

    @staticmethod
    def trace_split(a, g, damping: float):
        """Return (γ_A, γ_G): ``damping`` split by the trace norm π of the
        factors ``a`` and ``g``."""
        xp = get_array_module(a)
        trace_a = float(xp.trace(a)) / a.shape[0]
        trace_g = float(xp.trace(g)) / g.shape[0]
        root = math.sqrt(damping)
        if trace_a > 0 and trace_g > 0 and math.isfinite(trace_a * trace_g):
            pi = math.sqrt(trace_a / trace_g)
        else:
            pi = 1.0
        return pi * root, root / pi

    def inverse_requests(self, candidates, damping):
        # π needs both factors: the refreshed one and, if only one is
        # refreshed this step, the other as stored.
        a = candidates.get('A', self.factors.get('A'))
        g = candidates.get('G', self.factors.get('G'))
        if a is None or g is None:
            return {}
        damping_a, damping_g = self.trace_split(a, g, damping)
        split = {'A': (a, damping_a), 'G': (g, damping_g)}
        return {name: split[name] for name in candidates}

    def precondition(self, grads, damping):
        weight = self.link.W.array
        grad_w = regularized_grad(grads[0], weight, damping)
        matrix = grad_w.reshape(self.out_size, -1)
        if self.has_bias:
            grad_b = regularized_grad(grads[1], self.link.b.array, damping)
            xp = get_array_module(matrix)
            matrix = xp.concatenate([matrix, grad_b[:, None]], axis=1)
        if self.has_inverses():
            a_inv = self.inverses['A'].astype(matrix.dtype, copy=False)
            g_inv = self.inverses['G'].astype(matrix.dtype, copy=False)
            matrix = g_inv.dot(matrix).dot(a_inv)
        if self.has_bias:
            return [matrix[:, :-1].reshape(weight.shape), matrix[:, -1]]
        return [matrix.reshape(weight.shape)]


class LinearBlock(KroneckerBlock):
    """K-FAC block of :class:`chainer.links.Linear`."""

    kind = 'Linear (K-FAC)'
    function_types = (linear_module.LinearFunction,)

    def capture_forward(self, function, in_data):
        x = in_data[0]
        self._accumulate('A', linalg.gram(
            x.reshape(x.shape[0], -1), 1.0 / x.shape[0], self.factor_dtype,
            append_ones=self.has_bias))

    def capture_backward(self, function, in_data, out_grad):
        gy = out_grad[0]
        # Per-sample gradient N·gy; G = (1/N) Σ (N gy)(N gy)ᵀ = N Σ gy gyᵀ.
        self._accumulate('G', linalg.gram(gy, float(gy.shape[0]),
                                          self.factor_dtype))


class Convolution2DBlock(KroneckerBlock):
    """K-FAC block of :class:`chainer.links.Convolution2D` (KFC).

    Stride, padding (symmetric or not), dilation and ``cover_all`` are read
    from the function call. A grouped convolution is not one Kronecker
    product (it is one per group): it gets the plain gradient.
    """

    kind = 'Conv2D (K-FAC)'
    function_types = (conv2d_module.Convolution2DFunction,)

    def __init__(self, name, link, options=None):
        groups = getattr(link, 'groups', 1)
        if groups != 1:
            raise Unsupported(
                'grouped convolution (groups={}): one Kronecker product per '
                'group, not modelled'.format(groups))
        super().__init__(name, link, options)

    def capture_forward(self, function, in_data):
        x = in_data[0]
        kh, kw = self.link.W.shape[2:]
        im2col = (conv.im2col_cpu if isinstance(x, numpy.ndarray)
                  else conv.im2col_gpu)
        col = im2col(x, kh, kw, function.sy, function.sx, function.ph,
                     function.pw, cover_all=function.cover_all,
                     dy=function.dy, dx=function.dx)
        # (N, C, kh, kw, oh, ow) -> columns (C·kh·kw, N·oh·ow), moving
        # whole contiguous runs of oh·ow; the patch order matches
        # W.reshape(d_out, C·kh·kw). Its transpose (a view) are the rows.
        n = x.shape[0]
        patch = col.shape[1] * col.shape[2] * col.shape[3]
        columns = col.reshape(n, patch, -1).transpose(1, 0, 2).reshape(
            patch, -1)
        # Summed over locations, averaged over the batch.
        self._accumulate('A', linalg.gram(columns.T, 1.0 / n,
                                          self.factor_dtype,
                                          append_ones=self.has_bias))

    def capture_backward(self, function, in_data, out_grad):
        gy = out_grad[0]
        n, c = gy.shape[:2]
        locations = gy.shape[2] * gy.shape[3]
        rows = gy.transpose(0, 2, 3, 1).reshape(-1, c)
        # Per-sample gradients N·gy, averaged over batch and locations:
        # (1/(N·T)) Σ (N gy)(N gy)ᵀ = (N/T) Σ gy gyᵀ.
        self._accumulate('G', linalg.gram(rows, float(n) / locations,
                                          self.factor_dtype))
