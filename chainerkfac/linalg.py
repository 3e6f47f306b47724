"""Dense linear algebra of K-FAC, written once for NumPy and CuPy.

* :func:`gram` builds a Kronecker factor ``scale · XᵀX`` from rows ``X``,
  optionally with fp16 inputs and fp32 accumulation (Tensor Cores on GPU;
  the NumPy twin rounds the same way so tests can compare the two). Its
  fp16 pieces (:func:`half_normaliser`, :func:`write_scaled`,
  :func:`half_matmul`, :func:`restore_half`) and :func:`append_ones_row`
  also serve the convolution factors of
  :mod:`chainerkfac.fisher_blocks.patches`.
* :func:`damped_inverse` inverts ``M + d·I`` by Cholesky and, when ``M + d·I``
  is not positive definite, raises ``d`` and retries.
"""
from typing import NamedTuple, Optional

import numpy

import chainer
from chainer.backend import get_array_module

#: How much the damping of a block grows on each failed Cholesky, and how
#: many times it is tried.
DAMPING_BOOST = 10.0
MAX_INVERSE_TRIES = 6


def factor_dtype_for(array_dtype) -> numpy.dtype:
    """The dtype a factor is stored in: fp64 for an fp64 model, else fp32
    (whatever ``factor_dtype`` the products run in)."""
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
        (restored afterwards in fp32) so that the product cannot overflow
        (:func:`half_normaliser`). Anything else computes in the storage
        dtype (fp32, or fp64 for fp64 inputs).

    Returns
    -------
    array of shape (D, D), fp32 (fp64 for fp64 inputs).
    """
    core = _gram(rows, scale, numpy.dtype(factor_dtype))
    if not append_ones:
        return core
    return append_ones_row(core, rows.sum(axis=0, dtype=core.dtype),
                           rows.shape[0], scale)


def _gram(rows, scale, factor_dtype):
    xp = get_array_module(rows)
    out_dtype = factor_dtype_for(rows.dtype)
    if factor_dtype == numpy.float16:
        normaliser = half_normaliser(rows, scale)
        half = xp.empty(rows.shape, dtype=numpy.float16)
        write_scaled(half, rows, normaliser)
        return restore_half(half_matmul(half.T, half), out_dtype, normaliser)
    rows = rows.astype(out_dtype, copy=False)
    # One array and its transpose: NumPy calls syrk.
    return rows.T.dot(rows) * out_dtype.type(scale)


def append_ones_row(core, sums, count: int, scale: float):
    """``core`` (D, D) bordered by the row and column ``scale · sums`` and
    the corner ``scale · count``: the Gram matrix of vectors augmented by a
    constant 1, given the Gram matrix of the vectors, their sum and count."""
    xp = get_array_module(core)
    d = core.shape[0]
    out = xp.empty((d + 1, d + 1), dtype=core.dtype)
    out[:d, :d] = core
    column = sums.astype(core.dtype, copy=False) * core.dtype.type(scale)
    out[:d, d] = column
    out[d, :d] = column
    out[d, d] = count * scale
    return out


class HalfNormaliser(NamedTuple):
    """How fp16 operands of a Gram product were scaled (device scalars)."""
    factor: object   # multiplier of the inputs: √scale / peak
    peak: object     # largest input magnitude (≥ 1e-30)


def half_normaliser(array, scale: float) -> HalfNormaliser:
    """Scaling that keeps an fp16 Gram product of ``array`` from overflowing.

    The inputs are multiplied by ``√scale / max|array|`` before the cast to
    fp16, so every product entry is bounded by the number of summed terms
    times ``scale``; :func:`restore_half` multiplies by ``peak²``. The peak
    is ``max(max(array), −min(array))``: two reductions and no temporary
    (``abs(array).max()`` writes a copy of the array first), and no host
    synchronisation (it stays on the device).
    """
    xp = get_array_module(array)
    dtype = factor_dtype_for(array.dtype)
    peak = xp.maximum(xp.maximum(array.max(), -array.min()).astype(dtype),
                      dtype.type(1e-30))
    return HalfNormaliser(dtype.type(numpy.sqrt(scale)) / peak, peak)


def write_scaled(out, values, normaliser: Optional[HalfNormaliser]) -> None:
    """``out[...] = values`` (cast to ``out``'s dtype), multiplied by the
    normaliser's factor when there is one, in one pass: the product is
    computed in the factor's precision and rounded once to ``out``'s."""
    if normaliser is None:
        out[...] = values
    else:
        get_array_module(out).multiply(values, normaliser.factor, out=out)


def restore_half(product, out_dtype, normaliser: HalfNormaliser):
    """An fp16 product of normalised operands, back at scale in
    ``out_dtype``."""
    return product.astype(out_dtype, copy=False) * (normaliser.peak *
                                                    normaliser.peak)


def half_matmul(a, b):
    """``a @ b`` of fp16 matrices (or batches) with fp32 accumulation and an
    fp16 result: cuBLAS (Tensor Cores) on CuPy; on NumPy its twin, which
    multiplies the same fp16 values in fp32 and rounds the result to fp16,
    so that tests on CPU see the GPU's roundings."""
    xp = get_array_module(a)
    if xp is not numpy:
        return xp.matmul(a, b)
    return numpy.matmul(a.astype(numpy.float32),
                        b.astype(numpy.float32)).astype(numpy.float16)


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


def to_device_of(array, like):
    """Send ``array`` (e.g. loaded by a deserializer) to ``like``'s device."""
    if array is None:
        return None
    return chainer.backend.get_device_from_array(like).send(array)
