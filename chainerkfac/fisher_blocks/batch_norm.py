"""Fisher block of :class:`chainer.links.BatchNormalization`.

BN is not Kronecker-factored (section 5.4): the Fisher of ``(γ, β)`` is the
full ``2C × 2C`` matrix ``F = E[f fᵀ]`` of the per-sample gradients
``f_n = N·[Σ_hw gy_n x̂_n, Σ_hw gy_n]`` ("no approx"), or its diagonal
(``bn_fisher='diag'``; also a full Fisher larger than
``BlockOptions.max_factor_dim``, 2C > the limit). Its damping is ``ρ_BN · γ`` (section 4.3) and the
regularisation pulls γ towards μ = 1 (eq. 13).
"""
import numpy

import chainer.functions.normalization.batch_normalization as bn_module
from chainer.backend import get_array_module

from chainerkfac import linalg
from chainerkfac import low_rank
from chainerkfac import multi_tensor
from chainerkfac.fisher_blocks.base import (BlockOptions, FactorKind,
                                            FisherBlock, Unsupported)
from chainerkfac import fused

BN_FISHER_MODES = ('full', 'diag')


class BatchNormalizationBlock(FisherBlock):
    """Full or diagonal Fisher of a BatchNormalization link's (γ, β).

    A BatchNormalization without γ or β (``use_gamma=False`` /
    ``use_beta=False``) or normalising over a custom ``axis`` gets the plain
    gradient (:class:`~chainerkfac.fisher_blocks.Unsupported`).
    """

    factor_kinds = {'F': FactorKind.PARAM_GRADS}
    function_types = (bn_module.BatchNormalization,)
    # Batch statistics remove a scale of the input; the running ones of
    # test mode (FixedBatchNormalization: a frozen-BN fine-tuning) do not.
    normalizing_function_types = (bn_module.BatchNormalization,)
    test_mode_function_types = (bn_module.FixedBatchNormalization,)

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
        self._requested = mode
        self._options = options

    @property
    def mode(self) -> str:
        """``'full'`` or ``'diag'``: as asked, unless the full 2C×2C Fisher
        exceeds ``max_factor_dim`` (decided once γ exists)."""
        if self._requested == 'full' and self.link.gamma.array is not None \
                and self._options.too_large(2 * self.channels):
            self.note = 'diagonal Fisher (2C={} > max_factor_dim={})'.format(
                2 * self.channels, self._options.max_factor_dim)
            return 'diag'
        return self._requested

    @property
    def kind(self) -> str:
        return 'BN ({})'.format('full Fisher' if self.mode == 'full'
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

    def capture_gradients(self, function, in_data, out_grad):
        x, gy = in_data[0], out_grad[0]
        # The batch statistics of the forward pass (every BN implementation
        # of Chainer keeps them for its backward).
        mean, inv_std = function.mean, function.inv_std
        n, c = x.shape[:2]
        # Per-sample gradients of (γ, β) from x̂ = (x − μ)·σ⁻¹ without
        # forming x̂: Σ gy x̂ = σ⁻¹ (Σ gy x − μ Σ gy), sums over locations.
        # (The difference loses ~|μ|/σ of relative precision: negligible
        # for batch-normalised features, where |μ|/σ is of order 1.)
        dtype = linalg.factor_dtype_for(x.dtype)
        rows = fused.bn_sample_grads(x.reshape(n, c, -1),
                                     gy.reshape(n, c, -1), mean, inv_std,
                                     dtype)
        # Per-sample gradients N·f: F = (1/N) Σ (N f)(N f)ᵀ = N Σ f fᵀ.
        if self._columns_fit('F', n):
            value = low_rank.columns_of(rows.T, float(n))
        elif self.mode == 'full':
            value = linalg.gram(rows, float(n), self.factor_dtype,
                                tf32=self.factor_tf32)
        else:
            value = (rows ** 2).sum(axis=0) * dtype.type(n)
        self.accumulate('F', value)

    def inverse_requests(self, candidates, damping):
        # A 1-D factor (diagonal Fisher) is inverted elementwise.
        return {name: (low_rank.worth_keeping(value, 1), damping)
                for name, value in candidates.items()}

    def low_rank_capable(self, factor):
        # The full Fisher of N per-sample gradients has rank N at most.
        return self._options.low_rank and self.mode == 'full'

    def precondition_width(self, factor):
        return 1

    def regularization_means(self):
        # γ is pulled towards μ = 1 (eq. 13), β towards 0.
        return [1.0, 0.0]

    def precondition(self, grads, damping):
        xp = get_array_module(self.params[0].array)
        vector = xp.concatenate(self.regularized_grads(grads, damping))
        dtype = vector.dtype        # float16: preconditioned in float32
        vector = vector.astype(linalg.compute_dtype(dtype), copy=False)
        if self.has_inverses():
            vector = low_rank.left_multiply(self.inverses['F'],
                                            vector[:, None])[:, 0]
        vector = vector.astype(dtype, copy=False)
        c = self.channels
        return [vector[:c], vector[c:]]


# -- stage 5 in batches (the GPU) ---------------------------------------------
def batch_key(block):
    """Blocks with equal keys can be preconditioned as one batch
    (:func:`precondition_batch`); None for a block that cannot: not a
    BatchNormalization block, no inverse yet, or a diagonal or low-rank
    (Woodbury) one."""
    if not isinstance(block, BatchNormalizationBlock) or \
            not block.has_inverses():
        return None
    inverse = block.inverses['F']
    if isinstance(inverse, low_rank.WoodburyInverse) or \
            getattr(inverse, 'ndim', 0) != 2:
        return None
    return ('BN', block.channels, numpy.dtype(block.link.gamma.dtype),
            numpy.dtype(inverse.dtype))


def precondition_batch(blocks, grads, damping, stack):
    """:meth:`BatchNormalizationBlock.precondition` of several blocks of
    one :func:`batch_key` at once: a few batched kernels (a stacked
    matrix-vector product) instead of a few per block. ResNet-50's 53
    full BN Fishers come in 6 sizes.

    Parameters
    ----------
    blocks : list of BatchNormalizationBlock
        Equal :func:`batch_key`, not None.
    grads : list of list
        Each block's gradients of (γ, β) (none None).
    damping : float
        The blocks' γ of eq. (13) (ρ_BN times the damping).
    stack : chainerkfac.fisher_blocks.kronecker.InverseStack
        The cache of the batch's stacked inverses (names ``('F',)``).

    Returns
    -------
    list of list
        Each block's directions of (γ, β).
    """
    xp = get_array_module(grads[0][0])
    c = blocks[0].channels
    # eq. (13): γ pulled towards 1, β towards 0, as regularization_means;
    # written into the rows of one stack (not xp.stack: see multi_tensor)
    vectors = xp.empty((len(blocks), 2 * c), grads[0][0].dtype)
    multi_tensor.regularized([g[0] for g in grads],
                             [b.link.gamma.array for b in blocks], damping,
                             1.0, [vectors[i, :c] for i in range(len(blocks))])
    multi_tensor.regularized([g[1] for g in grads],
                             [b.link.beta.array for b in blocks], damping,
                             0.0, [vectors[i, c:] for i in range(len(blocks))])
    [inverses] = stack.get(blocks)
    dtype = vectors.dtype           # float16: preconditioned in float32
    vectors = vectors.astype(linalg.compute_dtype(dtype), copy=False)
    inverses = inverses.astype(vectors.dtype, copy=False)
    out = linalg.matmul(inverses, vectors[:, :, None])[:, :, 0]
    out = out.astype(dtype, copy=False)
    return [[out[i, :c], out[i, c:]] for i in range(len(blocks))]
