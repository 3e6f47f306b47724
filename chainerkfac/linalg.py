"""Dense linear algebra of K-FAC, written once for NumPy and CuPy.

* :func:`gram` builds a Kronecker factor ``scale · XᵀX`` from rows ``X``,
  optionally with fp16 inputs and fp32 accumulation, or TF32 products
  (:func:`tf32_matmul`; Tensor Cores on GPU, where the NumPy twins round
  the same way so tests can compare the two). Its
  fp16 pieces (:func:`half_normaliser`, :func:`write_scaled`,
  :func:`half_matmul`, :func:`restore_half`) and :func:`append_ones_row`
  also serve the convolution factors of
  :mod:`chainerkfac.fisher_blocks.patches`.
* :func:`damped_inverses` inverts ``M + d·I`` by Cholesky for all factors of
  a step at once and, where ``M + d·I`` is not positive definite, raises ``d``
  and retries; :func:`damped_inverse` is its one-factor case. On the GPU the
  work runs in :mod:`chainerkfac.linalg_cuda` (cuSOLVER on CUDA streams).
  With ``method='newton_schulz'`` the factors up to a size go by batched
  GEMMs instead (:mod:`chainerkfac.newton_schulz`), Cholesky deciding for
  the rest.
"""
import functools
from typing import List, NamedTuple, Optional, Sequence

import numpy

import chainer
from chainer.backend import get_array_module

from chainerkfac.dtypes import factor_dtype_for, inverse_dtype  # NOQA

#: How much the damping of a block grows on each failed Cholesky, and how
#: many times it is tried.
DAMPING_BOOST = 10.0
MAX_INVERSE_TRIES = 6
#: How :func:`damped_inverses` inverts: LAPACK / cuSOLVER Cholesky, or the
#: Newton–Schulz iteration batched over factors of equal size (with
#: Cholesky for what it does not settle).
INVERSE_METHODS = ('cholesky', 'newton_schulz', 'cholesky_solve')


def compute_dtype(dtype):
    """The dtype stage 5 multiplies a gradient of ``dtype`` in: float32
    for float16 (whose range a product with a damped inverse leaves, 1/γ
    being thousands), else ``dtype``."""
    dtype = numpy.dtype(dtype)
    return numpy.dtype(numpy.float32) if dtype == numpy.float16 else dtype


def gram(rows, scale: float, factor_dtype=numpy.float32,
         append_ones: bool = False, tf32: bool = False):
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
    tf32 : bool
        fp32 products from TF32 operands (:func:`tf32_matmul`); fp64 inputs
        keep fp64 products. The bias's row and column (``append_ones``)
        are sums of the rows as they are.

    Returns
    -------
    array of shape (D, D), fp32 (fp64 for fp64 inputs).
    """
    core = _gram(rows, scale, numpy.dtype(factor_dtype), tf32)
    if not append_ones:
        return core
    return append_ones_row(core, rows.sum(axis=0, dtype=core.dtype),
                           rows.shape[0], scale)


def _gram(rows, scale, factor_dtype, tf32=False):
    xp = get_array_module(rows)
    out_dtype = factor_dtype_for(rows.dtype)
    if tf32_products(tf32, rows.dtype, factor_dtype):
        rows = rows.astype(out_dtype, copy=False)
        if xp is numpy:
            rows = round_to_tf32(rows)    # then syrk, as below
        else:
            return tf32_matmul(rows.T, rows) * out_dtype.type(scale)
    if factor_dtype == numpy.float16:
        normaliser = half_normaliser(rows, scale)
        half = xp.empty(rows.shape, dtype=numpy.float16)
        write_scaled(half, rows, normaliser)
        return restore_half(half_matmul(half.T, half), out_dtype, normaliser)
    rows = rows.astype(out_dtype, copy=False)
    if xp is numpy:
        # One array and its transpose: NumPy calls syrk.
        return rows.T.dot(rows) * out_dtype.type(scale)
    # CuPy's dot calls its own cuBLAS, which a capturing stream refuses
    # (the refresh steps' passes are captured: chainerkfac.graphs)
    return in_place_matmul(rows.T, rows) * out_dtype.type(scale)


def diagonal_gram(rows, scale: float, append_ones: bool = False):
    """The diagonal of :func:`gram`: ``scale · Σ_rows x²`` per column (a
    factor kept as its diagonal), in the factor dtype; with
    ``append_ones``, one more entry ``scale · M`` for the constant 1."""
    xp = get_array_module(rows)
    dtype = factor_dtype_for(rows.dtype)
    rows = rows.astype(dtype, copy=False)
    diagonal = (rows * rows).sum(axis=0) * dtype.type(scale)
    if not append_ones:
        return diagonal
    return xp.concatenate([diagonal, xp.full(
        (1,), rows.shape[0] * scale, dtype=dtype)])


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
    fp16 result: cuBLAS (Tensor Cores) on CuPy, views read in place
    (:func:`in_place_matmul`); on NumPy its twin, which
    multiplies the same fp16 values in fp32 and rounds the result to fp16,
    so that tests on CPU see the GPU's roundings."""
    xp = get_array_module(a)
    if xp is not numpy:
        return in_place_matmul(a, b)
    return numpy.matmul(a.astype(numpy.float32),
                        b.astype(numpy.float32)).astype(numpy.float16)


def round_to_tf32(array):
    """float32 values rounded to TF32's 10-bit mantissa (to nearest, ties
    to even), as float32; NumPy or CuPy. Rounding twice changes nothing."""
    xp = get_array_module(array)
    bits = xp.ascontiguousarray(array, numpy.float32).view(numpy.uint32)
    rounded = (bits + numpy.uint32(0xFFF) + ((bits >> 13) & 1)) & \
        numpy.uint32(0xFFFFE000)
    return rounded.view(numpy.float32)


def tf32_products(asked: bool, array_dtype, factor_dtype) -> bool:
    """Whether a factor of ``array_dtype`` data takes TF32 products:
    asked, a float32 factor (a float64 model keeps float64 products), and
    not fp16 products (``factor_dtype`` float16)."""
    return bool(asked) and factor_dtype_for(array_dtype) == numpy.float32 \
        and numpy.dtype(factor_dtype) != numpy.float16


def tf32_matmul(a, b):
    """``a @ b`` of float32 matrices (or equal stacks of them) on TF32
    Tensor Cores: the operands taken to TF32's 10-bit mantissa, the
    products summed in fp32. On CuPy our cuBLAS handle in TF32 math
    (:func:`chainerkfac.graphs.gemm.tf32_matmul`); on NumPy its twin, which
    rounds the operands (:func:`round_to_tf32`) and multiplies them in
    fp32, so that tests on the CPU see the GPU's operands."""
    xp = get_array_module(a)
    if xp is numpy:
        return numpy.matmul(round_to_tf32(a), round_to_tf32(b))
    from chainerkfac.graphs import gemm
    return gemm.tf32_matmul(xp, a, b)


def in_place_matmul(a, b):
    """``a @ b`` of 2-D or 3-D operands that may be views (row-strided, or
    the transposes of such: the split-K pieces of a product and their
    transposes): on CuPy by our cuBLAS handle, which reads them where they
    are (:func:`chainerkfac.graphs.gemm.in_place_matmul`), where CuPy's
    matmul would copy both first; CuPy's own where that handle is not
    there or does not serve them; NumPy's on the CPU."""
    xp = get_array_module(a)
    if xp is numpy:
        return numpy.matmul(a, b)
    from chainerkfac.graphs import gemm
    product = gemm.in_place_matmul(xp, a, b)
    return xp.matmul(a, b) if product is None else product


def matmul(a, b, tf32: bool = False):
    """``a @ b`` of 2-D (or 2-D and 1-D) arrays, or of equal stacks (3-D):
    NumPy's ``matmul``; on CuPy ``cupy.matmul``, which a captured CUDA
    graph routes to GEMMs it may capture
    (:func:`chainerkfac.graphs.gemm.route_matmul`). ``tf32``: where both
    are float32 and of one rank, :func:`tf32_matmul` (TF32 Tensor Cores;
    other dtypes stay exact)."""
    if tf32 and a.dtype == b.dtype == numpy.float32 and a.ndim == b.ndim:
        return tf32_matmul(a, b)
    xp = get_array_module(a)
    if xp is numpy:
        return a.dot(b) if a.ndim <= 2 else numpy.matmul(a, b)
    return xp.matmul(a, b)


class InverseResult(NamedTuple):
    """Outcome of :func:`damped_inverses` for one factor."""
    inverse: Optional[object]   # None when every try failed
    damping: float              # the damping finally used
    retries: int                # failed tries before success (or all)


def same_layout(a, b) -> bool:
    """Whether ``b`` can be copied into ``a`` as it is: arrays of one
    module, shape, dtype and memory layout (strides: what reads ``a``
    then computes as it would with ``b``), ``a`` writable."""
    return (type(a) is type(b) and getattr(a, 'shape', None) == b.shape
            and a.dtype == b.dtype and a.strides == b.strides and
            getattr(a.flags, 'writeable', True))


class CholeskyInverse:
    """``(M + d·I)⁻¹`` kept as the upper Cholesky factor ``U`` of
    ``M + d·I = Uᵀ U`` and applied by two triangular solves, never formed
    (``inverse_method='cholesky_solve'``, the CPU).

    A refresh then costs Cholesky's n³/3 flops alone, where forming the
    inverse (``potri``) adds 2n³/3 more; each use costs two triangular
    solves, the same flops as the product with a formed inverse (2n²k for
    an (n, k) matrix).

    Parameters
    ----------
    upper : numpy.ndarray (n, n)
        ``U`` in its upper triangle (what LAPACK ``potrf`` returns; the
        strict lower triangle is not read).
    """

    def __init__(self, upper):
        self.upper = upper

    @property
    def dim(self) -> int:
        return int(self.upper.shape[0])

    @property
    def dtype(self):
        return self.upper.dtype

    def left(self, matrix):
        """``F⁻¹ · matrix`` for an (n, k) matrix (or an (n,) vector),
        solved in the factor's dtype and returned in the matrix's."""
        from scipy.linalg import solve_triangular
        rhs = matrix.astype(self.upper.dtype, copy=False)
        # Uᵀ y = matrix, then U x = y
        y = solve_triangular(self.upper, rhs, trans='T', lower=False,
                             check_finite=False)
        x = solve_triangular(self.upper, y, lower=False, overwrite_b=True,
                             check_finite=False)
        return x.astype(matrix.dtype, copy=False)

    def right(self, matrix):
        """``matrix · F⁻¹`` for a (k, n) matrix (F is symmetric)."""
        return self.left(matrix.T).T

    def refill(self, other: 'CholeskyInverse') -> bool:
        """Take ``other``'s factor into this object's array, in place, where
        shape, dtype and layout match (as
        :meth:`chainerkfac.low_rank.WoodburyInverse.refill`)."""
        mine, theirs = self.upper, other.upper
        if not same_layout(mine, theirs):
            return False
        if theirs is not mine:
            mine[...] = theirs
        return True

    def arrays(self) -> list:
        return [self.upper]

    def dense(self):
        """The inverse as an (n, n) array (tests)."""
        return self.left(numpy.eye(self.dim, dtype=self.upper.dtype))


def _potrf_cpu(matrix):
    """The upper Cholesky factor of a CPU matrix (LAPACK ``potrf``; the
    strict lower triangle keeps the input's values), or None where it is
    not positive definite."""
    from scipy.linalg import lapack
    potrf = lapack.dpotrf if matrix.dtype == numpy.float64 else lapack.spotrf
    chol, info = potrf(matrix, lower=False, clean=False)
    return chol if info == 0 else None


def _cholesky_inverse_cpu(matrix):
    from scipy.linalg import lapack
    potri = lapack.dpotri if matrix.dtype == numpy.float64 else lapack.spotri
    chol = _potrf_cpu(matrix)
    if chol is None:
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


def _attempt_cpu(matrices, dampings, check_input, factor_only=False):
    """One try for each factor on the CPU (LAPACK potrf + potri; with
    ``factor_only``, potrf alone, the inverse kept as a
    :class:`CholeskyInverse`).

    Returns, per factor, ``(input_finite, inverse or None)``; the input is
    checked only with ``check_input``.
    """
    outcomes = []
    for matrix, damping in zip(matrices, dampings):
        if check_input and not numpy.isfinite(matrix).all():
            outcomes.append((False, None))
            continue
        dtype = inverse_dtype(matrix.dtype).type
        if matrix.ndim == 1:
            shifted = matrix.astype(dtype) + dtype(damping)
            inverse = dtype(1) / shifted if (shifted > 0).all() else None
        else:
            damped = matrix.astype(dtype)
            diag = numpy.arange(matrix.shape[0])
            damped[diag, diag] += dtype(damping)
            if factor_only:
                upper = _potrf_cpu(damped)
                inverse = None if upper is None or not numpy.isfinite(
                    numpy.diagonal(upper)).all() else CholeskyInverse(upper)
            else:
                inverse = _cholesky_inverse_cpu(damped)
        if inverse is not None and not isinstance(inverse, CholeskyInverse) \
                and not numpy.isfinite(inverse).all():
            inverse = None
        outcomes.append((True, inverse))
    return outcomes


def damped_inverses(matrices: Sequence, dampings: Sequence[float],
                    max_tries: int = MAX_INVERSE_TRIES,
                    boost: float = DAMPING_BOOST, method: str = 'cholesky',
                    newton_schulz_max_dim: Optional[int] = None
                    ) -> List[InverseResult]:
    """Invert ``M + d·I`` for every factor of a step, raising a factor's
    damping (×``boost``) until its damped matrix is positive definite.

    Parameters
    ----------
    matrices : sequence of numpy.ndarray or cupy.ndarray
        All of one array module. A 2-D entry (n, n) is a symmetric positive
        semi-definite factor, inverted by Cholesky. A 1-D entry (n,) is the
        diagonal of a diagonal Fisher (BatchNormalization's
        ``bn_fisher='diag'``): its inverse is ``1 / (diag + d)``, and it
        counts as positive definite when every ``diag + d > 0``.
    dampings : sequence of float
        The first damping ``d`` of each factor.
    max_tries : int
        Tries per factor: the k-th (from 0) uses ``d · boost ** k``.
    boost : float
        Damping multiplier between tries.
    method : {'cholesky', 'newton_schulz', 'cholesky_solve'}
        ``'cholesky_solve'`` (CPU arrays only): a square factor's inverse
        is its :class:`CholeskyInverse`, applied by triangular solves and
        never formed. ``'newton_schulz'``: each try first runs the square factors of size
        up to ``newton_schulz_max_dim`` (default
        :data:`chainerkfac.newton_schulz.MAX_DIM`) through the Newton–Schulz
        iteration, stacked by size (:mod:`chainerkfac.newton_schulz`); the
        others, and those it does not settle, go by Cholesky. A damping is
        raised only where Cholesky fails, as with ``'cholesky'``.
    newton_schulz_max_dim : int, optional
        See ``method``.

    Returns
    -------
    list of InverseResult
        Aligned with ``matrices``. ``inverse`` has the factor's shape, in
        fp32 for fp32/fp16 factors and fp64 for fp64 ones, and is exactly
        symmetric for 2-D factors. A factor with NaN or Inf cannot be
        repaired by damping: ``InverseResult(None, d, max_tries)``, and the
        caller keeps its previous inverse (or none) — NaN is never
        returned. A factor that fails every try gives
        ``InverseResult(None, d · boost ** (max_tries - 1), max_tries)``.

    Notes
    -----
    Only the factors that failed a try are tried again. On the CPU each
    factor is one LAPACK ``potrf`` + ``potri``. On the GPU all the factors
    of a try run concurrently on CUDA streams and their checks (finite
    input, Cholesky and inverse status, finite output) come back to the
    host in one synchronisation per try (:mod:`chainerkfac.linalg_cuda`).
    """
    if len(matrices) != len(dampings):
        raise ValueError('damped_inverses: {} matrices but {} dampings'
                         .format(len(matrices), len(dampings)))
    for matrix in matrices:
        if matrix.ndim not in (1, 2) or (
                matrix.ndim == 2 and matrix.shape[0] != matrix.shape[1]):
            raise ValueError('damped_inverses: a factor must be square or '
                             '1-D (a diagonal), got shape {}'.format(
                                 matrix.shape))
    if method not in INVERSE_METHODS:
        raise ValueError('damped_inverses: method must be one of {}, got '
                         '{!r}'.format(INVERSE_METHODS, method))
    if not len(matrices):
        return []
    if get_array_module(*matrices) is numpy:
        attempt = functools.partial(
            _attempt_cpu, factor_only=method == 'cholesky_solve')
    elif method == 'cholesky_solve':
        raise ValueError(
            "damped_inverses: method='cholesky_solve' runs on the CPU only; "
            "on a GPU use 'cholesky' (or 'newton_schulz')")
    else:
        from chainerkfac import linalg_cuda
        attempt = linalg_cuda.attempt
    if method == 'newton_schulz':
        from chainerkfac import newton_schulz
        attempt = functools.partial(
            newton_schulz.attempt, fallback=attempt,
            max_dim=(newton_schulz.MAX_DIM if newton_schulz_max_dim is None
                     else newton_schulz_max_dim))
    results: List[Optional[InverseResult]] = [None] * len(matrices)
    used = list(dampings)
    pending = list(range(len(matrices)))
    for tries in range(max_tries):
        for k in pending:
            used[k] = dampings[k] * boost ** tries
        outcomes = attempt([matrices[k] for k in pending],
                           [used[k] for k in pending], tries == 0)
        failed = []
        for k, (input_finite, inverse) in zip(pending, outcomes):
            if not input_finite:
                results[k] = InverseResult(None, dampings[k], max_tries)
            elif inverse is not None:
                results[k] = InverseResult(inverse, used[k], tries)
            else:
                failed.append(k)
        pending = failed
        if not pending:
            break
    for k in pending:
        results[k] = InverseResult(None, used[k], max_tries)
    return results


def damped_inverse(matrix, damping: float,
                   max_tries: int = MAX_INVERSE_TRIES,
                   boost: float = DAMPING_BOOST) -> InverseResult:
    """Invert ``matrix + damping · I`` by Cholesky, raising the damping
    (×``boost``) until the damped matrix is positive definite.

    The one-factor case of :func:`damped_inverses` (same semantics, same
    result).
    """
    return damped_inverses([matrix], [damping], max_tries, boost)[0]


def to_device_of(array, like):
    """Send ``array`` (e.g. loaded by a deserializer) to ``like``'s device."""
    if array is None:
        return None
    return chainer.backend.get_device_from_array(like).send(array)
