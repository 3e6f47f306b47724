"""The loss Hessian w.r.t. the logits: exact and sampled symmetric roots.

Every second-order quantity starts from roots ``S_n`` with
``S_n S_nᵀ = ∇²ℓ_n / N`` (BackPACK's convention: the ``1/N`` of the batch
mean is carried by the root), one column per extra backward pass:

* softmax cross-entropy (Chainer's ``F.softmax_cross_entropy`` with integer
  labels, batch mean, no class weights): the closed form
  ``diag(√p) − p √pᵀ`` (:func:`chainerkfac.estimator.softmax_hessian_root`,
  the optimizer's ``fisher='exact'``); sampled columns are
  ``(p − e_ŷ) / √(N·M)`` with labels ``ŷ`` drawn from the model's softmax;
* any other loss that is a batch mean of independent per-sample losses:
  the per-sample Hessians by ``C`` double-backprop passes, their roots by
  an eigendecomposition (refused unless positive semi-definite: the GGN
  needs a convex loss); sampled columns ``S_n ξ / √M``, ``ξ ~ N(0, I)``.

The draws of a process are its rows of a draw for the whole global batch,
so ``N`` processes sample exactly what one process does.
"""
import math

import numpy

import chainer
import chainer.functions as F
from chainer.functions.loss import softmax_cross_entropy as sce_module

from chainerkfac import capture as capture_module
from chainerkfac import sampling
from chainerkfac.estimator import softmax_hessian_root

#: Eigenvalues below ``-tolerance · max|λ|`` make a loss Hessian indefinite
#: (rounding leaves tiny negative ones on a semi-definite one): the
#: tolerance is this, or a hundred roundings of the Hessian's dtype where
#: that is coarser (float32: 1.2e-5; a softmax Hessian's zero eigenvalue
#: comes out near -4e-10 relative there).
NEGATIVE_TOLERANCE = 1e-8


def is_softmax_cross_entropy(loss, t) -> bool:
    """Whether ``loss`` is the batch mean of a softmax cross-entropy with
    integer labels, no class weights and no ignored labels."""
    creator = loss.creator
    if not isinstance(creator, sce_module.SoftmaxCrossEntropy):
        return False
    labels = getattr(t, 'array', t)
    if labels is None or labels.ndim != 1 or labels.dtype.kind not in 'iu':
        return False
    if (labels == creator.ignore_label).any():
        raise ValueError(
            'the labels contain ignore_label={}: the loss is then not the '
            'mean over the N samples that the conventions assume'.format(
                creator.ignore_label))
    return creator.class_weight is None and creator.reduce == 'mean'


class LossHessian:
    """Roots of the per-sample loss Hessians of one batch.

    Parameters
    ----------
    loss : chainer.Variable
        The mean loss scaled to the global batch (``Σ_local ℓ_n / N``).
    logits : chainer.Variable
    softmax : bool
        The loss is a softmax cross-entropy (closed form).
    batch : chainerkfac.curvature.reduction.Batch
    """

    def __init__(self, loss, logits, softmax: bool, batch):
        self.loss = loss
        self.logits = logits
        self.softmax = softmax
        self.batch = batch
        self._root = None

    def exact_root(self):
        """(n, C, K): ``root[n] root[n]ᵀ = ∇²ℓ_n / N``."""
        if self._root is None:
            if self.softmax:
                self._root = softmax_hessian_root(self.logits.array) / \
                    math.sqrt(self.batch.total)
            else:
                self._root = _root_of(self._hessians())
        return self._root

    def _hessians(self):
        """(n, C, C) per-sample Hessians of the scaled loss, by double
        backprop: pass ``c`` gives row ``c`` of every sample's Hessian (the
        losses are independent, so no sample's block mixes with another)."""
        logits = self.logits
        xp = chainer.backend.get_array_module(logits.array)
        n, classes = logits.shape
        hessians = xp.zeros((n, classes, classes), dtype=logits.dtype)
        with capture_module.unobserved():
            try:
                gradient, = chainer.grad([self.loss], [logits],
                                         enable_double_backprop=True)
                for c in range(classes):
                    unit = xp.zeros((n, classes), dtype=logits.dtype)
                    unit[:, c] = 1
                    row, = chainer.grad([gradient], [logits],
                                        grad_outputs=[chainer.Variable(unit)])
                    if row is not None:
                        hessians[:, c] = row.array
            except Exception as error:  # NOQA: the loss's own error, reworded
                raise ValueError(
                    'the Hessian of the loss w.r.t. the logits needs double '
                    'backpropagation through the loss function ({}: {})'
                    .format(type(error).__name__, error)) from error
        return (hessians + hessians.transpose(0, 2, 1)) / 2

    def sampled_roots(self, mc_samples: int, rng: numpy.random.RandomState):
        """(M, n, C): ``M = mc_samples`` sampled columns per sample with
        ``E[Σ_m s s ᵀ] = ∇²ℓ_n / N``."""
        batch = self.batch
        rows = slice(batch.offset, batch.offset + batch.local)
        logits = self.logits.array
        xp = chainer.backend.get_array_module(logits)
        if self.softmax:
            uniforms = rng.random_sample((mc_samples, batch.total))[:, rows]
            probs = F.softmax(logits).array
            labels = sampling.inverse_cdf(
                chainer.backend.CpuDevice().send(probs), uniforms)
            onehot = xp.eye(probs.shape[1], dtype=probs.dtype)[
                xp.asarray(labels)]
            return (probs[None] - onehot) / math.sqrt(
                mc_samples * batch.total)
        root = self.exact_root()
        normals = xp.asarray(rng.standard_normal(
            (mc_samples, batch.total, root.shape[2]))[:, rows],
            dtype=root.dtype)
        return xp.einsum('nck,mnk->mnc', root, normals) / math.sqrt(
            mc_samples)


def _root_of(hessians):
    """Symmetric roots ``Q √Λ`` of positive semi-definite matrices
    (n, C, C)."""
    xp = chainer.backend.get_array_module(hessians)
    values, vectors = xp.linalg.eigh(hessians)
    scale = float(xp.abs(values).max()) if values.size else 0.0
    tolerance = max(NEGATIVE_TOLERANCE,
                    100 * float(numpy.finfo(values.dtype).eps))
    if scale > 0 and float(values.min()) < -tolerance * scale:
        raise ValueError(
            'the loss Hessian w.r.t. the logits has a negative eigenvalue '
            '({:.3g}): the generalized Gauss-Newton needs a convex loss'
            .format(float(values.min())))
    return vectors * xp.sqrt(xp.maximum(values, 0))[:, None, :]
