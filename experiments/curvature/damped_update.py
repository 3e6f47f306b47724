"""The seed's damped curvature update (section 4, appendix C.3).

``θ ← θ − α (G + λI)⁻¹ ∇L`` per parameter, with ``G`` one of

* a diagonal (``diag_ggn``, ``diag_ggn_mc``): elementwise;
* Kronecker factors ``B ⊗ A`` (``kfac``, ``kflr``, ``kfra``) of a weight:
  ``(B ⊗ A + λI)⁻¹`` replaced by
  ``(B + (√λ/π) I)⁻¹ ⊗ (A + π√λ I)⁻¹`` with Martens & Grosse's
  ``π² = (tr A / dim A) / (tr B / dim B)`` (eqs. 28-29), i.e.
  ``ΔW = (B + √λ/π I)⁻¹ ∇W (A + π√λ I)⁻¹`` on ``W.reshape(d_out, -1)``;
  a bias has the full matrix ``B``: ``(B + λI)⁻¹ ∇b``.

No L2 term (``η = 0``); the curvature of every step comes from
:func:`chainerkfac.curvature.extract` on that step's batch.
"""
import math
from typing import Optional

import numpy

from chainerkfac import curvature

DIAGONAL = ('diag_ggn', 'diag_ggn_mc')
KRONECKER = ('kfac', 'kflr', 'kfra')


class DampedCurvatureUpdate:
    """One optimizer of the seed's Figure 7.

    Parameters
    ----------
    model : chainer.Link
        Returns logits.
    quantity : str
        ``'diag_ggn'``, ``'diag_ggn_mc'``, ``'kfac'``, ``'kflr'`` or
        ``'kfra'``.
    lr : float
        ``α``.
    damping : float
        ``λ``.
    seed : int, optional
        Of the Monte-Carlo draws (one stream over all steps).
    """

    def __init__(self, model, quantity: str, lr: float, damping: float,
                 seed: Optional[int] = None):
        if quantity not in DIAGONAL + KRONECKER:
            raise ValueError('unknown curvature {!r}'.format(quantity))
        self.model = model
        self.quantity = quantity
        self.lr = lr
        self.damping = damping
        self.rng = numpy.random.RandomState(seed)

    def update(self, x, t) -> None:
        """One step on the batch ``(x, t)``."""
        values = curvature.extract(
            self.model, x, t, quantities=(self.quantity,),
            seed=int(self.rng.randint(2 ** 31)))
        for path, param in self.model.namedparams():
            if param.grad is None:
                continue
            q = values[path]
            param.array -= self.lr * self.direction(param.grad, q)

    def direction(self, grad, q):
        """``(G + λI)⁻¹ grad`` for one parameter."""
        if self.quantity in DIAGONAL:
            return grad / (q[self.quantity] + self.damping)
        b = q[self.quantity + '_B']
        a = q.get(self.quantity + '_A')
        if a is None:                     # a bias: its full GGN matrix
            return numpy.linalg.solve(
                b + self.damping * numpy.eye(len(b)), grad)
        return kronecker_solve(a, b, grad, self.damping)


def kronecker_solve(a, b, grad, damping: float):
    """``(B + √λ/π I)⁻¹ G (A + π√λ I)⁻¹`` for the gradient ``G`` shaped
    like the weight (``W.reshape(d_out, -1)`` inside)."""
    trace_a = numpy.trace(a) / len(a)
    trace_b = numpy.trace(b) / len(b)
    pi = math.sqrt(trace_a / trace_b) if trace_a > 0 and trace_b > 0 \
        else 1.0
    root = math.sqrt(damping)
    matrix = grad.reshape(len(b), -1)
    left = numpy.linalg.solve(b + root / pi * numpy.eye(len(b)), matrix)
    right = numpy.linalg.solve(a + pi * root * numpy.eye(len(a)), left.T).T
    return right.reshape(grad.shape)
