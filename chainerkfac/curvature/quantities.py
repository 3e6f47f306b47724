"""The quantities :func:`chainerkfac.curvature.extract` computes, by name,
and what each needs.

Names, values and scaling are BackPACK's (Dangel, Kunstner & Hennig, ICLR
2020, Table 1 and appendix A), for a loss ``L = (1/N) Σ_n ℓ_n`` that is the
mean of independent per-sample losses. ``J_n`` is the Jacobian of the
logits of sample ``n`` w.r.t. the parameter, ``S_n`` a symmetric root of
the loss Hessian ``∇²ℓ_n = S_n S_nᵀ`` w.r.t. those logits.

================== ========================================================
``batch_grad``     ``∇ℓ_n / N`` per sample, shape ``[N, *param.shape]``;
                   the rows sum to the gradient of ``L``
``batch_l2``       ``‖batch_grad[n]‖²``, shape ``[N]``
``sum_grad_squared`` ``Σ_n batch_grad[n]²``
``variance``       ``mean_n(batch_grad²) − mean_n(batch_grad)²``
``diag_ggn``       ``diag Σ_n J_nᵀ (∇²ℓ_n / N) J_n`` (exact)
``diag_ggn_mc``    the same with ``∇²ℓ_n`` replaced by ``mc_samples``
                   sampled outer products
``diag_hessian``   the diagonal of the Hessian of ``L``
``kfac``           ``kfac_A``, ``kfac_B``: Kronecker factors, ``B`` from
                   the sampled root
``kflr``           ``kflr_A``, ``kflr_B``: ``B`` from the exact root
``kfra``           ``kfra_A``, ``kfra_B``: ``B`` from the batch-averaged
                   curvature propagated layer by layer
================== ========================================================

Kronecker factors exist for the weights of Linear and (ungrouped)
Convolution2D calls; their biases get the ``_B`` factor only.
"""
from typing import FrozenSet, Iterable, Tuple

#: Computed from the gradient pass alone.
FIRST_ORDER: Tuple[str, ...] = ('batch_grad', 'batch_l2', 'sum_grad_squared',
                                'variance')
#: Need extra backward passes from the logits.
SECOND_ORDER: Tuple[str, ...] = ('diag_ggn', 'diag_ggn_mc', 'kfac', 'kflr',
                                 'kfra', 'diag_hessian')
QUANTITIES: Tuple[str, ...] = FIRST_ORDER + SECOND_ORDER
#: Quantities stored as two factors, ``<name>_A`` and ``<name>_B``.
KRONECKER: Tuple[str, ...] = ('kfac', 'kflr', 'kfra')
#: Quantities that keep one row per sample (not reduced across processes).
PER_SAMPLE: Tuple[str, ...] = ('batch_grad', 'batch_l2')

#: How a convolution's ``_B`` factor is formed (see
#: :func:`chainerkfac.curvature.extract`).
CONV_FACTORS: Tuple[str, ...] = ('backpack', 'kfc')


class Request:
    """The quantities asked for, and what they need.

    Parameters
    ----------
    quantities : iterable of str
        Names from :data:`QUANTITIES`.

    Raises
    ------
    ValueError
        for an unknown name.
    """

    def __init__(self, quantities: Iterable[str]):
        if isinstance(quantities, str):
            quantities = (quantities,)
        names = tuple(dict.fromkeys(quantities))
        unknown = [q for q in names if q not in QUANTITIES]
        if unknown:
            raise ValueError('unknown quantities {}; known: {}'.format(
                ', '.join(map(repr, unknown)), ', '.join(QUANTITIES)))
        self.names: FrozenSet[str] = frozenset(names)

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def any(self, *names: str) -> bool:
        return any(n in self.names for n in names)

    @property
    def first_order(self) -> FrozenSet[str]:
        """First-order quantities asked for."""
        return self.names & frozenset(FIRST_ORDER)

    @property
    def exact_passes(self) -> bool:
        """One extra pass per column of the exact loss-Hessian root."""
        return self.any('diag_ggn', 'kflr', 'diag_hessian')

    @property
    def sampled_passes(self) -> bool:
        """``mc_samples`` extra passes with sampled roots."""
        return self.any('diag_ggn_mc', 'kfac')

    @property
    def needs_root(self) -> bool:
        """The loss Hessian's root is needed (extra passes or KFRA)."""
        return self.exact_passes or self.sampled_passes or 'kfra' in self

    @property
    def input_factors(self) -> bool:
        return self.any(*KRONECKER)
