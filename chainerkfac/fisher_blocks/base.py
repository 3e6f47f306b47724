"""The interface every Fisher block implements.

A block owns the curvature of one link: it accumulates its factors from the
values the capture hook hands it (stage 1-2), turns averaged factors into
damped inverses (stage 4), and preconditions the gradients of its parameters
(stage 5). Who computes which block, and how factors travel, is decided
elsewhere (:mod:`chainerkfac.assignment`, :mod:`chainerkfac.transport`);
blocks only do the maths, identically on NumPy and CuPy.
"""
from typing import Dict, List, Sequence, Tuple

import numpy

from chainer.backend import get_array_module

from chainerkfac import linalg


class FisherBlock:
    """Base class of the per-link curvature blocks.

    Parameters
    ----------
    name : str
        The link's path in the model (``'/res2/a/conv1'``).
    link : chainer.Link
        The link whose parameters this block preconditions.
    factor_dtype : numpy.dtype
        ``float16`` builds factors from half-precision GEMMs.
    """

    #: Short label in the registration table.
    kind = 'base'
    #: Factor names, e.g. ``('A', 'G')``; empty for unpreconditioned params.
    factor_names: Tuple[str, ...] = ()
    #: Which factors come from the forward pass (stage 1).
    forward_factors: Tuple[str, ...] = ()
    #: FunctionNode type(s) this block captures from.
    function_types: tuple = ()

    def __init__(self, name: str, link, factor_dtype=numpy.float32):
        self.name = name
        self.link = link
        self.factor_dtype = numpy.dtype(factor_dtype)
        self._sums: Dict[str, object] = {}
        self._calls: Dict[str, int] = {}
        #: Averaged (and reduced) factors, as last refreshed.
        self.factors: Dict[str, object] = {}
        #: Damped inverses computed from :attr:`factors`.
        self.inverses: Dict[str, object] = {}
        #: Diff(t) of eq. (21) at the last refresh of each factor.
        self.diff: Dict[str, float] = {}
        #: How many times each factor was computed / inverted (diagnostics).
        self.refresh_count: Dict[str, int] = {n: 0 for n in self.factor_names}
        self.inverse_count: Dict[str, int] = {n: 0 for n in self.factor_names}

    # -- description -------------------------------------------------------
    @property
    def params(self) -> List:
        """Parameters in the order :meth:`precondition` takes them."""
        raise NotImplementedError

    def factor_shapes(self) -> Dict[str, Tuple[int, ...]]:
        raise NotImplementedError

    def symmetric(self, factor: str) -> bool:
        """Whether a factor is a symmetric matrix (travels packed)."""
        return len(self.factor_shapes()[factor]) == 2

    def inverse_cost(self) -> float:
        """Cost model for assignment: inverting an n×n factor ~ n³."""
        cost = 0.0
        for shape in self.factor_shapes().values():
            cost += float(shape[0]) ** 3 if len(shape) == 2 else shape[0]
        return cost

    def damping_scale(self, rho_bn: float) -> float:
        """Multiplier of the global damping for this block (ρ_BN for BN)."""
        return 1.0

    # -- stage 1-2: capture --------------------------------------------------
    def capture_forward(self, function, in_data) -> None:
        """Called by the capture hook before ``function``'s forward."""

    def capture_backward(self, function, in_data, out_grad) -> None:
        """Called by the capture hook before ``function``'s backward."""

    def _accumulate(self, factor: str, value) -> None:
        # A link called several times per step contributes every call.
        if factor in self._sums:
            self._sums[factor] += value
        else:
            self._sums[factor] = value
        self._calls[factor] = self._calls.get(factor, 0) + 1

    def reset_capture(self) -> None:
        self._sums = {}
        self._calls = {}

    def local_factors(self, names: Sequence[str], n_micro_batches: int
                      ) -> Dict[str, object]:
        """This process's factor estimates, averaged over micro-batches.

        Raises
        ------
        RuntimeError
            if a factor due this step was not captured (the link was not
            called inside ``optimizer.update``).
        """
        out = {}
        for factor in names:
            if factor not in self._sums:
                raise RuntimeError(
                    'K-FAC: factor {} of layer {} was due this step but the '
                    'layer was not called inside optimizer.update(lossfun, '
                    '...)'.format(factor, self.name))
            out[factor] = self._sums[factor] / n_micro_batches
        self.reset_capture()
        return out

    # -- stage 4: factors and inverses --------------------------------------
    def set_factors(self, new: Dict[str, object], decay: float = 0.0,
                    with_diff: bool = False) -> None:
        """Store refreshed factors (optionally an exponential average)."""
        for factor, value in new.items():
            old = self.factors.get(factor)
            if old is not None and decay > 0:
                value = decay * old + (1.0 - decay) * value
            if with_diff and old is not None:
                xp = get_array_module(value)
                denom = float(xp.linalg.norm(old))
                self.diff[factor] = (float(xp.linalg.norm(value - old)) / denom
                                     if denom > 0 else float('inf'))
            self.factors[factor] = value
            self.refresh_count[factor] += 1

    def update_inverses(self, names: Sequence[str], damping: float
                        ) -> Dict[str, int]:
        """Recompute the inverses of the named factors; return retries.

        A factor whose damped inverse fails even after raising the damping
        keeps its previous inverse (none on the first step: that block then
        goes unpreconditioned); the count of failed tries is returned so the
        optimizer can report it.
        """
        raise NotImplementedError

    def _store_inverse(self, factor: str, result: linalg.InverseResult
                       ) -> int:
        if result.inverse is not None:
            self.inverses[factor] = result.inverse
            self.inverse_count[factor] += 1
        return result.retries

    # -- stage 5: precondition ----------------------------------------------
    def precondition(self, grads: Sequence, damping: float) -> List:
        """Return ``(F + γI)⁻¹ ∇E`` for this block's parameters.

        ``grads`` are the (reduced) gradients ∇L aligned with :attr:`params`;
        ∇E = ∇L + γ(w − μ) (eq. 13) is formed here. ``damping`` is this
        block's γ (already multiplied by :meth:`damping_scale`).
        """
        raise NotImplementedError

    def has_inverses(self) -> bool:
        return all(n in self.inverses for n in self.factor_names)

    # -- state ----------------------------------------------------------------
    def serialize(self, serializer) -> None:
        like = self.params[0].array
        for factor in self.factor_names:
            for store, key in ((self.factors, factor),
                               (self.inverses, factor + '_inv')):
                value = linalg.to_device_of(
                    serializer(key, store.get(factor)), like)
                if value is None:
                    store.pop(factor, None)
                else:
                    store[factor] = value
            self.refresh_count[factor] = int(
                serializer('refresh_count_' + factor,
                           self.refresh_count[factor]))
            self.inverse_count[factor] = int(
                serializer('inverse_count_' + factor,
                           self.inverse_count[factor]))

    def describe(self) -> str:
        shapes = self.factor_shapes()
        if not shapes:
            return ''
        return ', '.join('{} {}'.format(n, 'x'.join(map(str, shapes[n])))
                         for n in self.factor_names)


class PlainBlock(FisherBlock):
    """Parameters of links K-FAC does not model: momentum-SGD direction.

    They still travel through the same stages (reduced, "preconditioned" by
    the identity, gathered), so every parameter belongs to exactly one block.
    """

    kind = 'plain (no curvature)'

    def __init__(self, name, link, factor_dtype=numpy.float32, params=None):
        super().__init__(name, link, factor_dtype)
        self._params = list(params)

    @property
    def params(self):
        return self._params

    def factor_shapes(self):
        return {}

    def inverse_cost(self):
        return float(sum(p.size for p in self._params if p.array is not None))

    def update_inverses(self, names, damping):
        return {}

    def precondition(self, grads, damping):
        return list(grads)

    def serialize(self, serializer):
        pass


def regularized_grad(grad, weight, damping: float, mean: float = 0.0):
    """∇E = ∇L + γ (w − μ) of eq. (13)."""
    if mean:
        return grad + damping * (weight - mean)
    return grad + damping * weight
