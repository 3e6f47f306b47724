"""Fisher block of :class:`chainer.links.BatchNormalization`.

BN is not Kronecker-factored (section 5.4): the Fisher of ``(γ, β)`` is the
full ``2C × 2C`` matrix ``F = E[f fᵀ]`` of the per-sample gradients
``f_n = N·[Σ_hw gy_n x̂_n, Σ_hw gy_n]`` ("no approx"), or its diagonal
(``bn_fisher='diag'``). Its damping is ``ρ_BN · γ`` (section 4.3) and the
regularisation pulls γ towards μ = 1 (eq. 13).
"""
import numpy

import chainer.functions.normalization.batch_normalization as bn_module
from chainer.backend import get_array_module

from chainerkfac import linalg
from chainerkfac.fisher_blocks.base import FisherBlock, regularized_grad

BN_FISHER_MODES = ('full', 'diag')


class BatchNormalizationBlock(FisherBlock):
    """Full or diagonal Fisher of a BatchNormalization link's (γ, β)."""

    factor_names = ('F',)
    function_types = (bn_module.BatchNormalization,)

    def __init__(self, name, link, factor_dtype=numpy.float32,
                 mode: str = 'full'):
        if mode not in BN_FISHER_MODES:
            raise ValueError('bn_fisher must be one of {}, got {!r}'
                             .format(BN_FISHER_MODES, mode))
        if getattr(link, 'gamma', None) is None or \
                getattr(link, 'beta', None) is None:
            raise ValueError(
                'K-FAC: BatchNormalization layer {} has no gamma or beta '
                '(use_gamma/use_beta=False); it is not supported.'
                .format(name))
        if getattr(link, 'axis', None) is not None:
            raise ValueError(
                'K-FAC: BatchNormalization layer {} normalises over a custom '
                'axis {}; only the default (channel axis 1) is supported.'
                .format(name, link.axis))
        super().__init__(name, link, factor_dtype)
        self.mode = mode
        self.kind = 'BN ({})'.format('full Fisher' if mode == 'full'
                                     else 'diagonal Fisher')

    @property
    def params(self):
        return [self.link.gamma, self.link.beta]

    @property
    def channels(self) -> int:
        return int(self.link.gamma.shape[0])

    def factor_shapes(self):
        n = 2 * self.channels
        return {'F': (n, n) if self.mode == 'full' else (n,)}

    def inverse_cost(self):
        n = 2 * self.channels
        return float(n) ** 3 if self.mode == 'full' else float(n)

    def damping_scale(self, rho_bn):
        return rho_bn

    def capture_backward(self, function, in_data, out_grad):
        x, gy = in_data[0], out_grad[0]
        # The batch statistics of the forward pass (every BN implementation
        # of Chainer keeps them for its backward).
        mean, inv_std = function.mean, function.inv_std
        n, c = x.shape[:2]
        # Per-sample gradients of (γ, β) from x̂ = (x − μ)·σ⁻¹ without
        # forming x̂: Σ gy x̂ = σ⁻¹ (Σ gy x − μ Σ gy), sums over locations.
        # (The difference loses ~|μ|/σ of relative precision: negligible
        # for batch-normalised features, where |μ|/σ is of order 1.)
        x3 = x.reshape(n, c, -1)
        gy3 = gy.reshape(n, c, -1)
        dtype = linalg.factor_dtype_for(x.dtype)
        g_beta = gy3.sum(axis=2, dtype=dtype)
        g_gamma = (_sum_of_products(gy3, x3, dtype) -
                   mean.astype(dtype, copy=False) * g_beta) * \
            inv_std.astype(dtype, copy=False)
        rows = get_array_module(x).concatenate([g_gamma, g_beta], axis=1)
        # Per-sample gradients N·f: F = (1/N) Σ (N f)(N f)ᵀ = N Σ f fᵀ.
        if self.mode == 'full':
            value = linalg.gram(rows, float(n), self.factor_dtype)
        else:
            value = (rows ** 2).sum(axis=0) * dtype.type(n)
        self._accumulate('F', value)

    def update_inverses(self, names, damping):
        if 'F' not in names:
            return {}
        if self.mode == 'full':
            result = linalg.damped_inverse(self.factors['F'], damping)
        else:
            result = self._diag_inverse(self.factors['F'], damping)
        return {'F': self._store_inverse('F', result)}

    @staticmethod
    def _diag_inverse(diag, damping):
        xp = get_array_module(diag)
        if not bool(xp.isfinite(diag).all()):
            return linalg.InverseResult(None, damping,
                                        linalg.MAX_INVERSE_TRIES)
        # diag ≥ 0 by construction; damping > 0 keeps it invertible.
        return linalg.InverseResult(1.0 / (diag + damping), damping, 0)

    def precondition(self, grads, damping):
        xp = get_array_module(grads[0])
        g_gamma = regularized_grad(grads[0], self.link.gamma.array, damping,
                                   mean=1.0)
        g_beta = regularized_grad(grads[1], self.link.beta.array, damping)
        vector = xp.concatenate([g_gamma, g_beta])
        if self.has_inverses():
            inverse = self.inverses['F'].astype(vector.dtype, copy=False)
            vector = (inverse.dot(vector) if self.mode == 'full'
                      else inverse * vector)
        c = self.channels
        return [vector[:c], vector[c:]]


def _sum_of_products(a, b, dtype):
    """``Σ_l a[n, c, l] · b[n, c, l]`` (N, C) in ``dtype``, in one pass
    without a temporary on NumPy (``einsum``)."""
    xp = get_array_module(a)
    if xp is numpy:
        return numpy.einsum('ncl,ncl->nc', a, b, dtype=dtype)
    return (a.astype(dtype, copy=False) * b).sum(axis=2)
