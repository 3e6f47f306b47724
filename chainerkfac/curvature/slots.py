"""One slot per parameter: its uses, and what one backward pass gives it.

A parameter may enter several calls (shared weights, a link called on two
inputs): its per-sample gradient in a pass is the sum over its calls, so
squares, norms and Kronecker ``B`` vectors are taken of that sum. A
parameter with a single call takes the adapters' shortcuts (squares of a
Linear weight from the squares of its two sides, without forming the
per-sample gradients).
"""
from typing import Dict, List, Optional

from chainerkfac.curvature.adapters import ConvolutionAdapter, Use


class Slot:
    """A parameter whose per-sample gradients come from its calls.

    Parameters
    ----------
    path : str
        ``namedparams()`` path of the parameter.
    uses : list of Use
    """

    def __init__(self, path: str, uses: List[Use]):
        self.path = path
        self.uses = uses

    @property
    def role(self) -> Optional[str]:
        """The parameter's role if it is the same in all its calls."""
        roles = {use.role for use in self.uses}
        return roles.pop() if len(roles) == 1 else None

    @property
    def kronecker(self) -> bool:
        """Whether the parameter gets Kronecker factors: the weight or bias
        of Linear or ungrouped Convolution2D calls, in every call."""
        return self.role in ('weight', 'bias') and all(
            use.call.adapter.kronecker and not (
                isinstance(use.call.adapter, ConvolutionAdapter) and
                use.call.adapter.groups(use.call) != 1)
            for use in self.uses)

    def reached(self, grads: Dict) -> List[Use]:
        """The uses a pass reached (a pass from a hidden variable reaches
        only the calls below it)."""
        return [use for use in self.uses if grads.get(use.call) is not None]

    def per_sample(self, grads: Dict):
        """The per-sample gradients in a pass, summed over calls, or None
        if the pass reaches none of them."""
        total = None
        for use in self.reached(grads):
            value = use.call.adapter.per_sample(use.call, grads[use.call],
                                                use.role)
            total = value if total is None else total + value
        return total

    def square_sum(self, grads: Dict, weights=None, per_sample=None):
        """``Σ_n w_n g_n²`` of the per-sample gradients ``g_n`` of a pass
        (from ``per_sample`` when at hand), or None."""
        reached = self.reached(grads)
        if per_sample is None and len(self.uses) == 1 and reached:
            call, role = reached[0]
            return call.adapter.square_sum(call, grads[call], role, weights)
        if per_sample is None:
            per_sample = self.per_sample(grads)
        if per_sample is None:
            return None
        squares = per_sample * per_sample
        if weights is not None:
            squares *= weights.reshape((-1,) + (1,) * (squares.ndim - 1))
        return squares.sum(axis=0)

    def sample_norms(self, grads: Dict, per_sample=None):
        """``‖g_n‖²`` per sample (from ``per_sample`` when at hand)."""
        if per_sample is None and len(self.uses) == 1:
            call, role = self.uses[0]
            return call.adapter.sample_norms(call, grads[call], role)
        if per_sample is None:
            per_sample = self.per_sample(grads)
        return sample_norms(per_sample)

    # -- Kronecker factors ------------------------------------------------
    def output_vectors(self, grads: Dict):
        """The per-sample bias gradient of a pass, summed over calls (the
        vectors of BackPACK's ``B``), or None."""
        total = None
        for use in self.reached(grads):
            value = use.call.adapter.output_vectors(use.call, grads[use.call])
            total = value if total is None else total + value
        return total

    def position_gram(self, grads: Dict):
        """KFC's ``Γ`` of a pass: ``(1/T) Σ_n Σ_positions g gᵀ``, averaged
        over the calls (the optimizer's convention for ``G``), or None."""
        reached = self.reached(grads)
        if not reached:
            return None
        total = 0
        for call, _ in reached:
            total = total + call.adapter.position_gram(call, grads[call]) / \
                call.adapter.output_positions(call)
        return total / len(self.uses)

    def input_factor(self, scale: float):
        """``scale · Σ_calls Σ_n Σ_positions u uᵀ`` (the weight's ``A``)."""
        total = 0
        for call, _ in self.uses:
            total = total + call.adapter.input_factor(call, scale)
        return total


def sample_norms(per_sample):
    """``‖g_n‖²`` of per-sample gradients ``[N, ...]``."""
    return (per_sample * per_sample).reshape(len(per_sample), -1).sum(axis=1)
