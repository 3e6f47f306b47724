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
from chainerkfac.fisher_blocks.base import (BlockOptions, FactorKind,
                                            FisherBlock, Unsupported,
                                            regularized_grad)

BN_FISHER_MODES = ('full', 'diag')


class BatchNormalizationBlock(FisherBlock):
    """Full or diagonal Fisher of a BatchNormalization link's (γ, β).

    A BatchNormalization without γ or β (``use_gamma=False`` /
    ``use_beta=False``) or normalising over a custom ``axis`` gets the plain
    gradient (:class:`~chainerkfac.fisher_blocks.Unsupported`).
    """

    factor_kinds = {'F': FactorKind.PARAM_GRADS}
    function_types = (bn_module.BatchNormalization,)

    def __init__(self, name, link, options=None):
        options = options or BlockOptions()
        mode = options.bn_fisher
        if mode not in BN_FISHER_MODES:
            raise ValueError('bn_fisher must be one of {}, got {!r}'
                             .format(BN_FISHER_MODES, mode))
        missing = [p for p in ('gamma', 'beta')
                   if getattr(link, p, None) is None]
        if missing:
            raise Unsupported('BatchNormalization without {} (use_{}=False): '
                              'the (gamma, beta) Fisher needs both'.format(
                                  missing[0], missing[0]))
        if getattr(link, 'axis', None) is not None:
            raise Unsupported('BatchNormalization over a custom axis {}: only '
                              'the channel axis 1 is modelled'.format(
                                  link.axis))
        super().__init__(name, link, options)
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
        xp = get_array_module(x)
        axes = (0,) + tuple(range(2, x.ndim))
        shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
        # x̂ recomputed from the batch statistics, whatever backend ran BN.
        mean = x.mean(axis=axes)
        var = x.var(axis=axes)
        inv_std = 1.0 / xp.sqrt(var + function.eps)
        x_hat = (x - mean.reshape(shape)) * inv_std.reshape(shape)
        spatial = tuple(range(2, x.ndim))
        g_gamma = (gy * x_hat).sum(axis=spatial) if spatial else gy * x_hat
        g_beta = gy.sum(axis=spatial) if spatial else gy
        rows = xp.concatenate([g_gamma, g_beta], axis=1)
        n = x.shape[0]
        # Per-sample gradients N·f: F = (1/N) Σ (N f)(N f)ᵀ = N Σ f fᵀ.
        if self.mode == 'full':
            value = linalg.gram(rows, float(n), self.factor_dtype)
        else:
            dtype = linalg.factor_dtype_for(rows.dtype, self.factor_dtype)
            value = (rows.astype(dtype) ** 2).sum(axis=0) * dtype.type(n)
        self._accumulate('F', value)

    def inverse_requests(self, candidates, damping):
        # A 1-D factor (diagonal Fisher) is inverted elementwise.
        return {name: (value, damping) for name, value in candidates.items()}

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
