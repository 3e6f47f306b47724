"""Damped inverses by the Newton–Schulz iteration, batched over factors of
equal size: GEMMs only (Tensor Cores on a GPU), for NumPy and CuPy alike.

An alternative for one try of :func:`chainerkfac.linalg.damped_inverses`
(``method='newton_schulz'``), for the many small factors of a network,
whose Cholesky inverses on a GPU are bound by launches and latency rather
than by flops. It is *not* faster on a CPU, where a factor's Cholesky
inverse costs ≈ n³ flops and the iteration 4 n³ per step.

The iteration, for ``D = M + d·I`` with ``M`` a symmetric positive
semi-definite factor::

    X₀ = 2 / (u + d) · I,     X_{k+1} = 2 X_k − X_k D X_k

where ``u = max_i Σ_j |D_ij|`` (Gershgorin: every eigenvalue of ``D`` lies
in ``[d, u]``). Then ``I − D X_k = (I − D X₀)^(2^k)``, whose norm is at most
``e^(2^k)`` with ``e = (u − d) / (u + d)``: the number of steps that brings
it below the dtype's rounding unit is known before the first one
(:func:`steps_needed`; ≈ log₂(κ) + 4 for κ = u / d), and every factor of a
group (same size, same dtype) runs as one stacked GEMM per product.

**Acceptance.** Rounding stalls the iteration at an error of about
``n·ε·κ``: there, the residual ``I − D X`` says nothing about ``X`` (its
norm can exceed 1 while ``X`` is within 2 % of the exact inverse). The test
is the size of the last correction, ``δ = ‖X_k − X_{k−1}‖_F / ‖X_k‖_F``.
The last correction is the error of ``X_{k−1}``, so that of ``X_k`` is
about ``δ²`` while converging, and about ``δ`` once stalled. A factor is
accepted when ``δ ≤`` :data:`TOLERANCE` of its dtype and ``X`` is finite.
Otherwise the caller's Cholesky try decides for it, as for a factor whose
steps exceed :data:`MAX_STEPS` or whose size exceeds the ``max_dim``
argument. That covers a non-finite input, a damped factor that is not
positive definite (the iteration diverges) and one whose smallest
eigenvalue fell below ``d`` by rounding (it converges too slowly). So a
damping is raised exactly when Cholesky fails.

Against fp64 Cholesky, on the 159 factors of n ≤ 1024 of one capture of
the small ResNet (batch 128, 32²) and of ResNet-50 (batch 4, 224²): the
fp32 iteration's relative errors (Frobenius) had median 4.4e-7 and
maximum 1.5 % (the factor of κ ≈ 4e6, where fp32 Cholesky's was 2.0 %);
fp32 Cholesky's, median 3.2e-7 and maximum 2.0 %. In fp64 the iteration's
largest was 4.9e-11. ``tests/chainerkfac/test_newton_schulz.py`` holds
that comparison on a smaller set.
"""
import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy

from chainer.backend import get_array_module

from chainerkfac import dtypes

#: Largest accepted last correction ``δ`` by inverse dtype: the error of the
#: result is then about ``δ²`` (or the rounding floor, which Cholesky has
#: too).
TOLERANCE = {numpy.dtype(numpy.float32): 0.1,
             numpy.dtype(numpy.float64): 1e-4}
#: A factor that would need more steps (κ beyond ≈ 10¹² in fp64) is left to
#: Cholesky.
MAX_STEPS = 50
#: Default largest factor size given to the iteration. Above it, Cholesky's
#: ≈ n³ flops beat the iteration's ≈ 4 n³ per step even on Tensor Cores.
MAX_DIM = 1024


def steps_needed(upper: float, damping: float, dtype) -> Optional[int]:
    """Steps after which ``‖I − D X‖₂ ≤ ε`` (the dtype's rounding unit) in
    exact arithmetic, for a matrix whose eigenvalues lie in ``[damping,
    upper]``; None if more than :data:`MAX_STEPS`, or if the bounds are not
    usable (non-finite, ``damping ≤ 0``).

    Parameters
    ----------
    upper : float
        An upper bound of the largest eigenvalue (the largest absolute row
        sum of the damped factor).
    damping : float
        The damping added, a lower bound of the smallest eigenvalue.
    dtype : numpy.dtype
        The dtype of the iteration (its ε).
    """
    if not (math.isfinite(upper) and damping > 0):
        return None
    upper = max(upper, damping)
    contraction = (upper - damping) / (upper + damping)
    if contraction <= 0.0:
        return 1
    epsilon = float(numpy.finfo(dtype).eps)
    if contraction >= 1.0:
        return None
    steps = math.ceil(math.log2(math.log(epsilon) / math.log(contraction)))
    # One step more: the last correction is the acceptance test's δ.
    steps = max(steps, 0) + 1
    return steps if steps <= MAX_STEPS else None


def attempt(matrices: Sequence, dampings: Sequence[float],
            check_input: bool, fallback,
            max_dim: int = MAX_DIM) -> List[Tuple[bool, Optional[object]]]:
    """One try of :func:`chainerkfac.linalg.damped_inverses` by the
    iteration, with ``fallback`` (a Cholesky try of the same signature) for
    the factors it does not take or does not accept.

    Parameters
    ----------
    matrices : sequence of numpy.ndarray or cupy.ndarray
        Symmetric factors (2-D) or diagonals (1-D); fp16/32/64.
    dampings : sequence of float
        This try's damping, per factor.
    check_input : bool
        Passed to ``fallback`` (it reports non-finite inputs).
    fallback : callable
        ``fallback(matrices, dampings, check_input)`` → the same outcomes;
        called once, on the diagonals, the factors larger than ``max_dim``
        and those the iteration did not settle.
    max_dim : int
        Largest factor size given to the iteration.

    Returns
    -------
    list of (bool, array or None)
        Per factor: whether its input is finite, and its inverse (exactly
        symmetric, in :func:`chainerkfac.dtypes.inverse_dtype`) or None.
    """
    groups: Dict[Tuple[int, numpy.dtype], List[int]] = {}
    for k, matrix in enumerate(matrices):
        if matrix.ndim == 2 and matrix.shape[0] <= max_dim:
            key = (matrix.shape[0], dtypes.inverse_dtype(matrix.dtype))
            groups.setdefault(key, []).append(k)
    accepted = _iterate_groups(matrices, dampings, groups)
    outcomes: List = [(True, accepted[k]) if k in accepted else None
                      for k in range(len(matrices))]
    rest = [k for k in range(len(matrices)) if k not in accepted]
    if rest:
        for k, outcome in zip(rest, fallback(
                [matrices[k] for k in rest], [dampings[k] for k in rest],
                check_input)):
            outcomes[k] = outcome
    return outcomes


def _iterate_groups(matrices, dampings, groups) -> Dict[int, object]:
    """Run every group: the accepted inverses by factor index. Two host
    synchronisations in all: the groups' bounds, then their corrections."""
    if not groups:
        return {}
    xp = get_array_module(*[matrices[g[0]] for g in groups.values()])
    stacks = {}
    for (n, dtype), members in groups.items():
        stack = xp.stack([matrices[k] for k in members]).astype(dtype)
        damping = xp.asarray([dampings[k] for k in members], dtype=dtype)
        diagonal = xp.arange(n)
        stack[:, diagonal, diagonal] += damping[:, None]
        # Gershgorin: the largest absolute row sum bounds the eigenvalues.
        upper = abs(stack).sum(axis=2).max(axis=1)
        stacks[(n, dtype)] = (stack, damping, upper)
    upper_of = iter(xp.concatenate([
        s[2].astype(numpy.float64) for s in stacks.values()]).tolist())
    runs = []   # synchronisation 1 above; the steps are known now
    for key, members in groups.items():
        steps = [steps_needed(next(upper_of), dampings[k], key[1])
                 for k in members]
        usable = [i for i, s in enumerate(steps) if s is not None]
        if not usable:
            continue
        stack, damping, upper = stacks[key]
        if len(usable) < len(members):
            pick = xp.asarray(usable)
            stack, damping, upper = stack[pick], damping[pick], upper[pick]
        inverse, correction = _iterate(stack, damping, upper,
                                       max(steps[i] for i in usable))
        runs.append((key[1], [members[i] for i in usable], inverse,
                     correction))
    if not runs:
        return {}
    corrections = iter(xp.concatenate(   # synchronisation 2
        [r[3].astype(numpy.float64) for r in runs]).tolist())
    accepted = {}
    for dtype, members, inverse, _ in runs:
        for i, k in enumerate(members):
            delta = next(corrections)
            if math.isfinite(delta) and delta <= TOLERANCE[dtype]:
                accepted[k] = inverse[i]
    return accepted


def _iterate(stack, damping, upper, steps: int):
    """``steps`` (≥ 1) Newton–Schulz steps on a stack (B, n, n) of damped
    factors; the symmetrised inverses and, per matrix, the last correction
    ``δ`` (NaN where the iterate is not finite)."""
    xp = get_array_module(stack)
    n = stack.shape[1]
    dtype = stack.dtype
    scale = dtype.type(2) / (upper + damping)
    inverse = xp.zeros_like(stack)
    diagonal = xp.arange(n)
    inverse[:, diagonal, diagonal] = scale[:, None]
    # A factor that is not positive definite diverges: its overflow is
    # expected here and judged below (NumPy would warn; CuPy does not).
    with numpy.errstate(over='ignore', invalid='ignore'):
        for _ in range(steps):
            previous = inverse
            inverse = 2 * previous - xp.matmul(previous,
                                               xp.matmul(stack, previous))
        correction = _frobenius(inverse - previous) / _frobenius(inverse)
    correction[~xp.isfinite(correction)] = numpy.nan
    inverse = (inverse + inverse.transpose(0, 2, 1)) * dtype.type(0.5)
    return inverse, correction


def _frobenius(stack):
    return ((stack * stack).sum(axis=(1, 2))) ** 0.5
