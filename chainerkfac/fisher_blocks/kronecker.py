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
A step that refreshes one factor only inverts that one, with π of the
factors as they are (the other as stored); the other keeps the inverse,
and the share, of its own refresh (docs/kfac.md, "Unequal intervals").

A factor larger than ``BlockOptions.max_factor_dim`` (VGG16's fc6 has
d_in = 25089: A would take 2.5 GB and an n³ inverse) is kept as its
diagonal: ``diag(A)`` or ``diag(G)``, inverted elementwise; the other factor
stays full when it fits.
"""
import math

import numpy

import chainer.functions.connection.convolution_2d as conv2d_module
import chainer.functions.connection.linear as linear_module
from chainer.backend import get_array_module

from chainerkfac import linalg
from chainerkfac import low_rank
from chainerkfac import multi_tensor
from chainerkfac.fisher_blocks import patches
from chainerkfac.fisher_blocks.base import (BlockOptions, FactorKind,
                                            FisherBlock, Unsupported)


class KroneckerBlock(FisherBlock):
    """Shared maths of the Linear and Convolution2D blocks."""

    factor_kinds = {'A': FactorKind.INPUTS, 'G': FactorKind.OUTPUT_GRADS}

    def __init__(self, name, link, options=None):
        options = options or BlockOptions()
        super().__init__(name, link, options)
        self._options = options
        self._diagonal = None

    @property
    def diagonal(self) -> frozenset:
        """The factors kept as their diagonal (larger than
        :attr:`BlockOptions.max_factor_dim`); decided once the link's
        weight exists."""
        if self._diagonal is None:
            if self.link.W.array is None:
                return frozenset()
            self._decide_diagonal()
        return self._diagonal

    def _decide_diagonal(self) -> None:
        sizes = {'A': self.in_size, 'G': self.out_size}
        self._diagonal = frozenset(
            n for n, size in sizes.items() if self._options.too_large(size))
        self.note = '; '.join(
            '{} diagonal ({} > max_factor_dim={})'.format(
                n, sizes[n], self._options.max_factor_dim)
            for n in sorted(self._diagonal))

    @property
    def params(self):
        params = [self.link.W]
        if self.has_bias:
            params.append(self.link.b)
        return params

    @property
    def rescaled_weight(self):
        return self.link.W

    @property
    def has_bias(self) -> bool:
        return getattr(self.link, 'b', None) is not None

    @property
    def out_size(self) -> int:
        """d_out: output units (Linear) or channels (Convolution2D)."""
        out = getattr(self.link, 'out_size', None)
        return int(out if out is not None else self.link.out_channels)

    output_size = out_size

    @property
    def in_size(self) -> int:
        """Columns of the weight matrix, bias column included."""
        return int(numpy.prod(self.link.W.shape[1:])) + int(self.has_bias)

    def factor_shapes(self):
        sizes = {'A': self.in_size, 'G': self.out_size}
        return {n: (s,) if n in self.diagonal else (s, s)
                for n, s in sizes.items()}

    @staticmethod
    def trace_split(a, g, damping: float):
        """Return (γ_A, γ_G): ``damping`` split by the trace norm π of the
        factors ``a`` and ``g`` (each a matrix, a diagonal or low rank)."""
        trace_a = low_rank.mean_eigenvalue(a)
        trace_g = low_rank.mean_eigenvalue(g)
        root = math.sqrt(damping)
        if trace_a > 0 and trace_g > 0 and math.isfinite(trace_a * trace_g):
            pi = math.sqrt(trace_a / trace_g)
        else:
            pi = 1.0
        return pi * root, root / pi

    def _call_has_bias(self, function) -> bool:
        """Whether this call of the layer's function passed the link's
        bias: ``F.linear(x, link.W)`` on a link with one does not, and its
        input contributes 0, not 1, to the bias's row of A."""
        return self.has_bias and len(function.inputs) > 2

    def _bias_row(self, value, ones: bool):
        """``value`` with the bias's row: the 1s it holds, or (a call
        without the bias) zeros."""
        if self.has_bias and not ones:
            return low_rank.with_zero_row(value)
        return value

    def traced_factors(self, candidates):
        a, g = self._pair(candidates)
        return [] if a is None or g is None else [a, g]

    def _pair(self, candidates):
        # π needs both factors: the refreshed one and, if only one is
        # refreshed this step, the other as stored.
        return (candidates.get('A', self.factors.get('A')),
                candidates.get('G', self.factors.get('G')))

    def inverse_requests(self, candidates, damping):
        a, g = self._pair(candidates)
        if a is None or g is None:
            return {}
        damping_a, damping_g = self.trace_split(a, g, damping)
        split = {'A': (a, damping_a), 'G': (g, damping_g)}
        return {name: (low_rank.worth_keeping(
            split[name][0], self.precondition_width(name)), split[name][1])
            for name in candidates}

    # -- low rank (chainerkfac.low_rank) -----------------------------------
    def low_rank_capable(self, factor):
        return self._options.low_rank and factor not in self.diagonal

    def precondition_width(self, factor):
        return self.out_size if factor == 'A' else self.in_size

    def precondition(self, grads, damping):
        weight = self.link.W.array
        # a float16 gradient is preconditioned in float32: G⁻¹∇W alone
        # (1/γ_G of a few thousand) overflowed float16, where the whole
        # direction fits, and the step was skipped
        dtype = grads[0].dtype if grads[0] is not None else weight.dtype
        regularized = [r.astype(linalg.compute_dtype(dtype), copy=False)
                       for r in self.regularized_grads(grads, damping)]
        a_inv = self.inverses.get('A')
        if self.has_inverses() and getattr(a_inv, 'ndim', 0) == 1:
            # A diagonal: the bias's column does not mix with W's. Each is
            # preconditioned on its own, in place (no concatenated copy:
            # the largest layers are those whose A is kept diagonal).
            g_inv = self.inverses['G']
            matrix = low_rank.left_multiply(
                g_inv, regularized[0].reshape(self.out_size, -1),
                overwrite=True)
            out = [low_rank.right_multiply(
                matrix, a_inv[:matrix.shape[1]], overwrite=True).reshape(
                    weight.shape)]
            if self.has_bias:
                bias = low_rank.left_multiply(
                    g_inv, regularized[1][:, None], overwrite=True)
                out.append(low_rank.right_multiply(
                    bias, a_inv[-1:], overwrite=True)[:, 0])
            return [d.astype(dtype, copy=False) for d in out]
        matrix = regularized[0].reshape(self.out_size, -1)
        if self.has_bias:
            grad_b = regularized[1]
            xp = get_array_module(matrix)
            matrix = xp.concatenate([matrix, grad_b[:, None]], axis=1)
        if self.has_inverses():
            # TF32 for dense Kronecker blocks only: one kept diagonal is
            # exact (as the A-diagonal branch above, and the batch)
            tf32 = self.precondition_tf32 and getattr(
                self.inverses['G'], 'ndim', 0) == 2
            matrix = low_rank.left_multiply(self.inverses['G'], matrix,
                                            tf32=tf32)
            matrix = low_rank.right_multiply(matrix, a_inv, tf32=tf32)
        matrix = matrix.astype(dtype, copy=False)
        if self.has_bias:
            return [matrix[:, :-1].reshape(weight.shape), matrix[:, -1]]
        return [matrix.reshape(weight.shape)]


class LinearBlock(KroneckerBlock):
    """K-FAC block of :class:`chainer.links.Linear`."""

    kind = 'Linear (K-FAC)'
    function_types = (linear_module.LinearFunction,)

    def capture_inputs(self, function, in_data):
        x = in_data[0]
        rows = x.reshape(x.shape[0], -1)
        ones = self._call_has_bias(function)
        if self._columns_fit('A', x.shape[0]):
            # A = U Uᵀ, U the inputs (and the bias's 1) over √N.
            value = low_rank.columns_of(rows.T, 1.0 / x.shape[0], ones)
        elif 'A' in self.diagonal:
            value = linalg.diagonal_gram(rows, 1.0 / x.shape[0],
                                         append_ones=ones)
        else:
            value = linalg.gram(rows, 1.0 / x.shape[0], self.factor_dtype,
                                append_ones=ones, tf32=self.factor_tf32)
        self.accumulate('A', self._bias_row(value, ones))

    def capture_gradients(self, function, in_data, out_grad):
        gy = out_grad[0]
        # Per-sample gradient N·gy; G = (1/N) Σ (N gy)(N gy)ᵀ = N Σ gy gyᵀ.
        if self._columns_fit('G', gy.shape[0]):
            self.accumulate('G', low_rank.columns_of(
                gy.T, float(gy.shape[0])))
            return
        if 'G' in self.diagonal:
            value = linalg.diagonal_gram(gy, float(gy.shape[0]))
        else:
            value = linalg.gram(gy, float(gy.shape[0]), self.factor_dtype,
                                tf32=self.factor_tf32)
        self.accumulate('G', value)


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
                'group, not modelled'.format(groups),
                rescaled_weight=link.W, output_size=int(link.out_channels))
        super().__init__(name, link, options)

    def capture_inputs(self, function, in_data):
        x = in_data[0]
        geometry = patches.ConvGeometry.of(function, self.link.W.shape[2:])
        oh, ow = geometry.out_size(*x.shape[2:])
        ones = self._call_has_bias(function)
        if self._columns_fit('A', x.shape[0] * oh * ow):
            # A = U Uᵀ, U the patches (and the bias's 1) over √N.
            self.accumulate('A', self._bias_row(low_rank.columns_of(
                patches.unfolded(x, geometry), 1.0 / x.shape[0], ones),
                ones))
            return
        # Summed over locations, averaged over the batch.
        if 'A' in self.diagonal:
            value = patches.patch_square_sums(x, geometry, 1.0 / x.shape[0],
                                              append_ones=ones)
        else:
            strategy = self._options.conv_a_strategy
            if strategy is not None and strategy not in \
                    patches.strategy_costs(x.shape, geometry,
                                           get_array_module(x)):
                strategy = None           # it does not apply to this call
            value = patches.patch_gram(
                x, geometry, 1.0 / x.shape[0], self.factor_dtype,
                append_ones=ones, strategy=strategy,
                tf32=self.factor_tf32)
        self.accumulate('A', self._bias_row(value, ones))

    def capture_gradients(self, function, in_data, out_grad):
        gy = out_grad[0]
        n = gy.shape[0]
        locations = gy.shape[2] * gy.shape[3]
        # Per-sample gradients N·gy, averaged over batch and locations:
        # (1/(N·T)) Σ (N gy)(N gy)ᵀ = (N/T) Σ gy gyᵀ.
        if self._columns_fit('G', n * locations):
            self.accumulate('G', low_rank.columns_of(
                patches.unfolded(gy, patches.POINTWISE),
                float(n) / locations))
            return
        if 'G' in self.diagonal:
            value = patches.channel_square_sums(gy, float(n) / locations)
        else:
            value = patches.channel_gram(gy, float(n) / locations,
                                         self.factor_dtype,
                                         tf32=self.factor_tf32)
        self.accumulate('G', value)


def batch_key(block):
    """Blocks with equal keys can be preconditioned as one batch
    (:func:`precondition_batch`); None for a block that cannot (a
    low-rank inverse among its factors)."""
    if not isinstance(block, KroneckerBlock) or not block.has_inverses():
        return None
    a_inv, g_inv = block.inverses['A'], block.inverses['G']
    if not all(getattr(inverse, 'ndim', 0) in (1, 2)
               for inverse in (a_inv, g_inv)):
        return None             # a Woodbury or Cholesky inverse
    return (tuple(block.link.W.shape), block.has_bias, a_inv.shape,
            g_inv.shape, numpy.dtype(block.link.W.dtype),
            numpy.dtype(a_inv.dtype), type(a_inv))


class InverseStack:
    """The inverses ``names`` of a batch of blocks stacked (B, n, n), kept
    until one of them is another array (a refresh, a restore).

    It holds the inverses it stacked, so that "the same" is identity, not
    an ``id`` that a new array may take over from a freed one. An inverse
    refreshed in place (``commit(..., refill=True)``: the same array, a
    new :attr:`~chainerkfac.fisher_blocks.base.FisherBlock.inverse_count`)
    is copied into its slot again, in place too: a CUDA graph that reads
    the stack sees it. The stack is written slot by slot (not
    ``xp.stack``, whose CuPy implementation copies a table of pointers
    from the host for more than 8 small arrays, which a CUDA graph's
    capture refuses)."""

    def __init__(self, names=('A', 'G')):
        self.names = tuple(names)
        self._members = ()
        self._blocks = ()
        self._versions = ()
        self._stacks = None

    def get(self, blocks):
        """One stack per name, in the order of :attr:`names`."""
        members = tuple(b.inverses[n] for b in blocks for n in self.names)
        if len(members) != len(self._members) or any(
                a is not b for a, b in zip(members, self._members)):
            stacks = []
            for name in self.names:
                first = blocks[0].inverses[name]
                xp = get_array_module(first)
                out = xp.empty((len(blocks),) + first.shape, first.dtype)
                for k, block in enumerate(blocks):
                    out[k] = block.inverses[name]
                stacks.append(out)
            self._stacks = tuple(stacks)
            self._members = members
            self._blocks = tuple(blocks)
            self._versions = self._versions_of(blocks)
        else:
            self.refresh()
        return self._stacks

    def refresh(self) -> None:
        """Copy into their slots the inverses refreshed in place since they
        were stacked (also for a batch its step did not precondition, by
        :meth:`chainerkfac.optimizers.KFAC.refresh_inverse_stacks`). An
        inverse that is another array now is left to :meth:`get`, which
        stacks the batch anew."""
        if self._stacks is None:
            return
        blocks = self._blocks
        versions = self._versions_of(blocks)
        if versions == self._versions:
            return
        members = tuple(b.inverses.get(n) for b in blocks
                        for n in self.names)
        if any(a is not b for a, b in zip(members, self._members)):
            return
        width = len(self.names)
        for k, block in enumerate(blocks):
            mine = slice(k * width, (k + 1) * width)
            if versions[mine] != self._versions[mine]:
                for name, stack in zip(self.names, self._stacks):
                    stack[k] = block.inverses[name]
        self._versions = versions

    def arrays(self) -> list:
        """The stacks (a CUDA graph's buffers)."""
        return list(self._stacks or ())

    def _versions_of(self, blocks) -> tuple:
        return tuple(b.inverse_count[n] for b in blocks for n in self.names)


def precondition_batch(blocks, grads, damping, stack: InverseStack,
                       tf32: bool = False):
    """:meth:`KroneckerBlock.precondition` of several blocks of one
    :func:`batch_key` at once: a few batched kernels instead of a few per
    block (the GPU's launch count).

    Parameters
    ----------
    blocks : list of KroneckerBlock
        Equal :func:`batch_key`, not None.
    grads : list of list
        Each block's gradients aligned with its ``params`` (none None).
    damping : float
        The blocks' γ.
    stack : InverseStack
        The cache of the batch's stacked inverses.
    tf32 : bool
        The stacked products on TF32 Tensor Cores where they are float32
        (:func:`chainerkfac.linalg.matmul`).

    Returns
    -------
    list of list
        Each block's directions, as :meth:`KroneckerBlock.precondition`.
    """
    xp = get_array_module(grads[0][0])
    first = blocks[0]
    out_size = first.out_size
    # eq. (13) into the slots of one stack (not xp.stack: see multi_tensor)
    grad_w = xp.empty((len(blocks),) + first.link.W.shape,
                      grads[0][0].dtype)
    multi_tensor.regularized([g[0] for g in grads],
                             [b.link.W.array for b in blocks], damping, 0.0,
                             list(grad_w))
    matrix = grad_w.reshape(len(blocks), out_size, -1)
    if first.has_bias:
        grad_b = xp.empty((len(blocks), out_size), grads[0][1].dtype)
        multi_tensor.regularized([g[1] for g in grads],
                                 [b.link.b.array for b in blocks], damping,
                                 0.0, list(grad_b))
        matrix = xp.concatenate([matrix, grad_b[:, :, None]], axis=2)
    dtype = matrix.dtype            # float16: preconditioned in float32
    matrix = matrix.astype(linalg.compute_dtype(dtype), copy=False)
    a_inv, g_inv = stack.get(blocks)
    a_inv = a_inv.astype(matrix.dtype, copy=False)
    g_inv = g_inv.astype(matrix.dtype, copy=False)
    # a block with a factor kept diagonal stays exact, as block by block
    tf32 = tf32 and a_inv.ndim == 3 and g_inv.ndim == 3
    matrix = (linalg.matmul(g_inv, matrix, tf32=tf32) if g_inv.ndim == 3
              else g_inv[:, :, None] * matrix)
    matrix = (linalg.matmul(matrix, a_inv, tf32=tf32) if a_inv.ndim == 3
              else matrix * a_inv[:, None, :])
    matrix = matrix.astype(dtype, copy=False)
    shape = first.link.W.shape
    if first.has_bias:
        return [[matrix[i, :, :-1].reshape(shape), matrix[i, :, -1]]
                for i in range(len(blocks))]
    return [[matrix[i].reshape(shape)] for i in range(len(blocks))]
