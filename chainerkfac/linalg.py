"""Dense linear algebra of K-FAC, written once for NumPy and CuPy.

* :func:`gram` builds a Kronecker factor ``scale · XᵀX`` from rows ``X``,
  optionally with fp16 inputs and fp32 accumulation (Tensor Cores on GPU;
  the NumPy twin rounds the same way so tests can compare the two).
* :func:`damped_inverse` inverts ``M + d·I`` by Cholesky and, when ``M + d·I``
  is not positive definite, raises ``d`` and retries.
"""
from typing import List, NamedTuple, Optional, Sequence

import numpy

import chainer
from chainer.backend import get_array_module

#: How much the damping of a block grows on each failed Cholesky, and how
#: many times it is tried.
DAMPING_BOOST = 10.0
MAX_INVERSE_TRIES = 6


def factor_dtype_for(array_dtype, factor_dtype) -> numpy.dtype:
    """The dtype a factor is stored in: fp32, or fp64 for an fp64 model."""
    if numpy.dtype(array_dtype) == numpy.float64:
        return numpy.dtype(numpy.float64)
    return numpy.dtype(numpy.float32)


def gram(rows, scale: float, factor_dtype=numpy.float32,
         append_ones: bool = False):
    """Return ``scale · rowsᵀ rows`` as a symmetric matrix.

    With ``append_ones`` the rows are taken as augmented by a constant 1
    (a layer's bias): the extra row and column ``scale · Σ rows`` and
    ``scale · M`` are filled in directly, without copying the rows.

    Parameters
    ----------
    rows : array of shape (M, D)
        One row per sample (or per sample and spatial location).
    scale : float
        Multiplier applied to the sum over rows.
    factor_dtype : dtype
        ``float16`` computes the product from half-precision inputs with fp32
        accumulation; the inputs are normalised by their largest magnitude
        (restored afterwards in fp32) so that the product cannot overflow. Anything else computes in the
        storage dtype (fp32, or fp64 for fp64 models).

    Returns
    -------
    array of shape (D, D), fp32 (fp64 for fp64 inputs).
    """
    core = _gram(rows, scale, factor_dtype)
    if not append_ones:
        return core
    xp = get_array_module(rows)
    d = rows.shape[1]
    out = xp.empty((d + 1, d + 1), dtype=core.dtype)
    out[:d, :d] = core
    column = rows.sum(axis=0, dtype=core.dtype) * core.dtype.type(scale)
    out[:d, d] = column
    out[d, :d] = column
    out[d, d] = rows.shape[0] * scale
    return out


def _gram(rows, scale, factor_dtype):
    xp = get_array_module(rows)
    out_dtype = factor_dtype_for(rows.dtype, factor_dtype)
    if numpy.dtype(factor_dtype) == numpy.float16:
        # Normalise by the largest magnitude so the fp16 product cannot
        # overflow (its entries are bounded by the row count times scale);
        # the magnitude is restored in fp32. No host sync: ``peak`` stays on
        # the device.
        rows = rows.astype(out_dtype, copy=False)
        peak = xp.maximum(xp.abs(rows).max(), out_dtype.type(1e-30))
        half = (rows * (out_dtype.type(numpy.sqrt(scale)) / peak)).astype(
            numpy.float16)
        if xp is numpy:
            # NumPy twin of a Tensor Core GEMM: fp16 inputs, fp32
            # accumulation, result rounded to the fp16 output.
            wide = half.astype(numpy.float32)
            product = wide.T.dot(wide).astype(numpy.float16)
        else:
            product = xp.matmul(half.T, half)
        return product.astype(out_dtype) * (peak * peak)
    rows = rows.astype(out_dtype, copy=False)
    return rows.T.dot(rows) * out_dtype.type(scale)


class InverseResult(NamedTuple):
    """Outcome of :func:`damped_inverse`."""
    inverse: Optional[object]   # None when every try failed
    damping: float              # the damping finally used
    retries: int                # failed tries before success (or all)


def _cholesky_inverse_cpu(matrix):
    from scipy.linalg import lapack
    potrf = lapack.dpotrf if matrix.dtype == numpy.float64 else lapack.spotrf
    potri = lapack.dpotri if matrix.dtype == numpy.float64 else lapack.spotri
    chol, info = potrf(matrix, lower=False, clean=False)
    if info != 0:
        return None
    inv, info = potri(chol, lower=False)
    if info != 0:
        return None
    # potri fills the upper triangle only.
    return mirror_upper(inv)


def mirror_upper(matrix, block: int = 64):
    """Copy the upper triangle of a square matrix onto its lower one, in
    place, by cache-sized panels (~30x faster than ``triu + triu(.., 1).T``
    at n = 4608 on one core)."""
    n = matrix.shape[0]
    for i in range(0, n, block):
        j = min(i + block, n)
        matrix[j:, i:j] = matrix[i:j, j:].T
        diag = matrix[i:j, i:j]
        diag[...] = numpy.triu(diag) + numpy.triu(diag, 1).T
    return matrix


def _cholesky_inverse_gpu(matrix):
    import cupy
    from cupyx import lapack
    eye = cupy.eye(matrix.shape[0], dtype=matrix.dtype)
    try:
        # cuSOLVER potrf + potrs against the identity.
        return lapack.posv(matrix, eye)
    except numpy.linalg.LinAlgError:
        return None


def damped_inverse(matrix, damping: float,
                   max_tries: int = MAX_INVERSE_TRIES,
                   boost: float = DAMPING_BOOST) -> InverseResult:
    """Invert ``matrix + damping · I`` by Cholesky, raising the damping
    (×``boost``) until the damped matrix is positive definite.

    A matrix with NaN or Inf cannot be repaired by damping: the result then
    has ``inverse=None`` and the caller keeps its previous inverse (or uses
    no preconditioning) — it never propagates NaN.

    The inversion runs in fp32 for fp32/fp16 factors and fp64 for fp64
    factors (never in half precision).
    """
    xp = get_array_module(matrix)
    if not bool(xp.isfinite(matrix).all()):
        return InverseResult(None, damping, max_tries)
    dtype = numpy.float64 if matrix.dtype == numpy.float64 else numpy.float32
    matrix = matrix.astype(dtype, copy=False)
    invert = (_cholesky_inverse_cpu if xp is numpy
              else _cholesky_inverse_gpu)
    diag = xp.arange(matrix.shape[0])
    for attempt in range(max_tries):
        used = damping * boost ** attempt
        damped = matrix.copy()
        damped[diag, diag] += dtype(used)
        inverse = invert(damped)
        if inverse is not None and bool(xp.isfinite(inverse).all()):
            return InverseResult(inverse, used, attempt)
    return InverseResult(None, used, max_tries)


def damped_inverses(matrices: Sequence, dampings: Sequence[float],
                    max_tries: int = MAX_INVERSE_TRIES,
                    boost: float = DAMPING_BOOST) -> List[InverseResult]:
    """:func:`damped_inverse` of many factors (one call per stage).

    A 2-D entry is a symmetric positive semi-definite factor; a 1-D entry
    is the diagonal of a diagonal Fisher, inverted elementwise as
    ``1 / (diag + damping)`` (``None`` if it is not finite).
    """
    results = []
    for matrix, damping in zip(matrices, dampings):
        if matrix.ndim == 1:
            results.append(_diagonal_inverse(matrix, damping, max_tries))
        else:
            results.append(damped_inverse(matrix, damping, max_tries, boost))
    return results


def _diagonal_inverse(diag, damping, max_tries):
    xp = get_array_module(diag)
    if not bool(xp.isfinite(diag).all()):
        return InverseResult(None, damping, max_tries)
    # diag >= 0 by construction; damping > 0 keeps it invertible.
    return InverseResult(1.0 / (diag + damping), damping, 0)


def to_device_of(array, like):
    """Send ``array`` (e.g. loaded by a deserializer) to ``like``'s device."""
    if array is None:
        return None
    return chainer.backend.get_device_from_array(like).send(array)
