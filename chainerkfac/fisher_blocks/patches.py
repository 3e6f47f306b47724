"""Kronecker factors of a convolution, formed without Chainer's im2col.

KFC's input factor ``A = scale · Σ_n Σ_locations p pᵀ`` runs over the
patches ``p`` of the layer input, a patch being ordered (channel, kernel row,
kernel column) like ``W.reshape(d_out, -1)``; the output-gradient factor
``G`` is the Gram matrix of the channel vectors of ``gy`` over samples and
locations. This module forms both for NumPy and CuPy alike, in one of two
ways (:func:`patch_gram` picks the cheaper by :func:`strategy_costs`):

* **unfolded** (any stride, padding, dilation, ``cover_all``): the patch
  matrix is written once, directly in the layout of the product,
  ``(C·kh·kw, N·oh·ow)``, by ``kh·kw`` strided slice copies of the input
  (no padded copy, no transposed copy), then multiplied by its own
  transpose (NumPy sees the two operands are one array and calls ``syrk``).
  A 1×1 convolution is a channel-major copy (a subsample for stride > 1),
  and so is ``G``.
* **shifted** (stride 1, a kernel larger than 1×1): the Gram matrix of the
  patches is block-Toeplitz. Block ``((a, b), (a', b'))`` is the
  correlation of the input with itself at the offset
  ``((a'−a)·dy, (b'−b)·dx)``, summed over the locations tap ``(a, b)``
  sees, so all blocks come from ``kw + (2kw−1)·(kh−1)`` offsets (the
  others are their transposes) instead of ``(kh·kw)²`` pairs of taps:
  products of ``2kw−1`` horizontally shifted copies of the input against
  ``kh`` vertically shifted copies, ``13·C²`` multiply-adds per location
  for a 3×3 kernel instead of ``(9·C)²/2``. The taps' windows differ
  only at the border: the image is cut into a few row and column bands,
  the products are summed over each (row band, column band) rectangle,
  and each block adds up the rectangles inside its window
  (:func:`_shifted_plan`).

With ``factor_dtype='float16'`` the operands are written in half precision,
scaled by ``√scale / max|x|`` in the same copy that lays them out, the
products accumulate in fp32 (:func:`chainerkfac.linalg.half_matmul`, Tensor
Cores on GPU) and round to fp16, and the assembly runs in fp32.

With ``tf32`` (``factor_dtype='tf32'``), float32 products take their
operands to TF32's 10-bit mantissa: the unfolded product on the GPU runs
on TF32 Tensor Cores (:func:`chainerkfac.linalg.tf32_matmul`); on NumPy,
and for the shifted product anywhere, the input is rounded
(:func:`chainerkfac.linalg.round_to_tf32`) and multiplied exactly: the
same operands, so the CPU is the GPU's twin. The bias's sums
(``append_ones``) are of the input as it is.
"""
import functools
from typing import Dict, NamedTuple, Tuple

import numpy

import chainer
from chainer.backend import get_array_module
from chainer.utils import conv

from chainerkfac import linalg

#: Cost of copying one element, in multiply-add equivalents, for
#: :func:`strategy_costs`: a strided copy moves ~1.5e9 elements/s and a GEMM
#: does ~1.5e10 multiply-adds/s on one core of the development machine.
COPY_COST = 10.0
#: Positions per chunk of the shifted product: BLAS runs skinny products
#: (small output, long sum) ~2x faster as a batch of sums of 128-512 terms.
CHUNK = 256
#: Samples moved per copy when the input is laid out with samples innermost.
SAMPLE_BLOCK = 8
#: Split-K of the unfolded product on GPU (:func:`column_gram`): terms per
#: piece, and the most elements of partial products. Not measured yet: the
#: GPU benchmark's capture by layer type is where to calibrate them.
SPLIT_K_CHUNK = 4096
SPLIT_K_MEMORY = 2 ** 25


class ConvGeometry(NamedTuple):
    """Kernel size, stride, padding, dilation and ``cover_all`` of a call of
    :class:`chainer.functions.connection.convolution_2d.Convolution2DFunction`
    (pixels)."""
    kh: int
    kw: int
    sy: int = 1
    sx: int = 1
    ph: int = 0
    pw: int = 0
    dy: int = 1
    dx: int = 1
    cover_all: bool = False

    @classmethod
    def of(cls, function, kernel_shape: Tuple[int, int]) -> 'ConvGeometry':
        """The geometry of a convolution call with a ``kh×kw`` kernel."""
        kh, kw = (int(k) for k in kernel_shape)
        return cls(kh, kw, function.sy, function.sx, function.ph,
                   function.pw, function.dy, function.dx,
                   bool(function.cover_all))

    def out_size(self, h: int, w: int) -> Tuple[int, int]:
        """``(oh, ow)``, the output locations for an ``h×w`` input."""
        return (conv.get_conv_outsize(h, self.kh, self.sy, self.ph,
                                      self.cover_all, self.dy),
                conv.get_conv_outsize(w, self.kw, self.sx, self.pw,
                                      self.cover_all, self.dx))


#: A 1×1 convolution with stride 1: the channel vectors themselves.
POINTWISE = ConvGeometry(1, 1)


def patch_gram(x, geometry: ConvGeometry, scale: float,
               factor_dtype=numpy.float32, append_ones: bool = False,
               strategy: str = None, tf32: bool = False):
    """``scale · Σ_n Σ_locations p pᵀ`` over the patches ``p`` of ``x``.

    Parameters
    ----------
    x : array of shape (N, C, H, W)
        The convolution's input.
    geometry : ConvGeometry
        Kernel size, stride, padding, dilation, ``cover_all``.
    scale : float
        Multiplier of the sum (``1/N`` for KFC's A).
    factor_dtype : dtype
        ``float16``: half-precision operands with fp32 accumulation (see the
        module docstring); anything else: the storage dtype.
    append_ones : bool
        Patches augmented by a constant 1 (the bias): one more row and
        column, ``scale · Σ p`` and ``scale · N·oh·ow``.
    strategy : {'unfolded', 'shifted'}, optional
        Force a way of forming the product (tests); by default the cheaper
        one by :func:`strategy_costs` on the CPU, and unfolded on the GPU
        (measured faster there).
    tf32 : bool
        Products of TF32 operands (module docstring); float32 inputs only
        (float64 keeps float64 products), not with ``float16``.

    Returns
    -------
    array of shape (D, D), D = C·kh·kw (+1 with ``append_ones``), fp32
    (fp64 for fp64 inputs).
    """
    xp = get_array_module(x)
    costs = strategy_costs(x.shape, geometry, xp)
    if strategy is None:
        # On the GPU the shifted product's many small kernels lose to one
        # unfolded product: ResNet-50, batch 32, one H100, Conv A capture
        # 0.062 s unfolded against 0.117 s as the CPU cost model chose.
        strategy = ('unfolded' if xp is not numpy
                    else min(costs, key=costs.get))
    elif strategy not in costs:
        raise ValueError('strategy {!r} does not apply to {} (possible: {})'
                         .format(strategy, geometry, ', '.join(costs)))
    factor_dtype = numpy.dtype(factor_dtype)
    tf32 = linalg.tf32_products(tf32, x.dtype, factor_dtype)
    if strategy == 'shifted':
        gram = _shifted_gram(linalg.round_to_tf32(x) if tf32 else x,
                             geometry, scale, factor_dtype)
    else:
        gram = _unfolded_gram(x, geometry, scale, factor_dtype, tf32)
    if not append_ones:
        return gram
    oh, ow = geometry.out_size(*x.shape[2:])
    return linalg.append_ones_row(gram, _patch_sums(x, geometry, gram.dtype),
                                  x.shape[0] * oh * ow, scale)


def channel_gram(y, scale: float, factor_dtype=numpy.float32,
                 tf32: bool = False):
    """``scale · Σ_n Σ_locations y yᵀ`` over the channel vectors of ``y``
    (N, C, H, W): a convolution's G from its output gradient (``tf32`` as
    :func:`patch_gram`'s)."""
    return _unfolded_gram(y, POINTWISE, scale, numpy.dtype(factor_dtype),
                          linalg.tf32_products(tf32, y.dtype, factor_dtype))


def patch_square_sums(x, geometry: ConvGeometry, scale: float,
                      append_ones: bool = False):
    """The diagonal of :func:`patch_gram`: ``scale · Σ_n Σ_locations p²``
    per patch entry (C·kh·kw,), +1 entry ``scale · N·oh·ow`` with
    ``append_ones``; in the factor dtype (a factor kept as its diagonal)."""
    xp = get_array_module(x)
    dtype = linalg.factor_dtype_for(x.dtype)
    x = x.astype(dtype, copy=False)
    diagonal = _patch_sums(x * x, geometry, dtype) * dtype.type(scale)
    if not append_ones:
        return diagonal
    oh, ow = geometry.out_size(*x.shape[2:])
    return xp.concatenate([diagonal, xp.full(
        (1,), x.shape[0] * oh * ow * scale, dtype=dtype)])


def channel_square_sums(y, scale: float):
    """The diagonal of :func:`channel_gram`: ``scale · Σ_n Σ_locations y²``
    per channel."""
    dtype = linalg.factor_dtype_for(y.dtype)
    y = y.astype(dtype, copy=False)
    return (y * y).sum(axis=(0, 2, 3)) * dtype.type(scale)


def strategy_costs(x_shape, geometry: ConvGeometry, xp=numpy
                   ) -> Dict[str, float]:
    """Estimated cost of each applicable strategy, in multiply-adds.

    Copies count :data:`COPY_COST` each; the unfolded product counts half
    its multiply-adds on NumPy (``syrk``) and all of them on CuPy (GEMM).
    """
    n, c, h, w = (int(s) for s in x_shape)
    g = geometry
    oh, ow = g.out_size(h, w)
    d = c * g.kh * g.kw
    columns = n * oh * ow
    symmetric = 0.5 if xp is numpy else 1.0
    costs = {'unfolded': d * d * columns * symmetric +
             COPY_COST * d * columns}
    if g.sy == g.sx == 1 and g.kh * g.kw > 1:
        plan = _shifted_plan(h, w, g)
        outputs = gathered = 0
        for lo, hi in plan.row_bands:
            for c_lo, c_hi in plan.col_bands:
                rows, run = hi - lo, (c_hi - c_lo) * n
                if run < CHUNK and rows > 1:
                    gathered += rows * run
                    rows, run = 1, rows * run
                outputs += rows * _pieces(run)
        products = g.kw + plan.left * (g.kh - 1)
        shifts, width, terms = plan.coefficients.shape
        taps = (g.kh * g.kw) ** 2
        # Operands, gathered rectangles, partial products, and the
        # assembly: sums, weighted sums, their gather, the transposed pairs.
        copies = ((plan.left + g.kh + 1) * c * n * h * w +
                  (plan.left + g.kh) * c * gathered +
                  (outputs * products + 2 * shifts * terms + shifts * width +
                   6 * taps) * c * c)
        costs['shifted'] = (products * c * c * n * h * w +
                            plan.coefficients.size * c * c +
                            COPY_COST * copies)
    return costs


# -- unfolded -----------------------------------------------------------
def unfolded(x, geometry: ConvGeometry, dtype=None, normaliser=None):
    """The patches of ``x`` (N, C, H, W) as the columns of a
    ``(C·kh·kw, N·oh·ow)`` matrix (rows ordered like
    ``W.reshape(d_out, -1)``'s columns, columns sample-major), in ``dtype``
    (default: the factor dtype), multiplied by ``normaliser``'s factor when
    given (fp16 operands). With :data:`POINTWISE`, the channel vectors."""
    xp = get_array_module(x)
    dtype = linalg.factor_dtype_for(x.dtype) if dtype is None else dtype
    n, c, h, w = x.shape
    g = geometry
    oh, ow = g.out_size(h, w)
    rows = [_taps(a * g.dy - g.ph, g.sy, oh, h) for a in range(g.kh)]
    cols = [_taps(b * g.dx - g.pw, g.sx, ow, w) for b in range(g.kw)]
    # Zeros only where a tap reads padding.
    covered = all(i == slice(0, oh) for i, _ in rows) and all(
        j == slice(0, ow) for j, _ in cols)
    columns = (xp.empty if covered else xp.zeros)(
        (c, g.kh, g.kw, n, oh, ow), dtype=dtype)
    channels_first = x.transpose(1, 0, 2, 3)
    for a, (i, u) in enumerate(rows):
        for b, (j, v) in enumerate(cols):
            if i.stop > i.start and j.stop > j.start:
                linalg.write_scaled(columns[:, a, b, :, i, j],
                                    channels_first[:, :, u, v], normaliser)
    return columns.reshape(c * g.kh * g.kw, n * oh * ow)


def _unfolded_gram(x, geometry, scale, factor_dtype, tf32=False):
    xp = get_array_module(x)
    out_dtype = linalg.factor_dtype_for(x.dtype)
    half = factor_dtype == numpy.float16
    normaliser = linalg.half_normaliser(x, scale) if half else None
    matrix = unfolded(x, geometry, numpy.float16 if half else out_dtype,
                      normaliser)
    if xp is numpy and not half:
        if tf32:
            matrix = linalg.round_to_tf32(matrix)   # the GPU's operands
        # Operands that are one array and its transpose: syrk.
        return matrix.dot(matrix.T) * out_dtype.type(scale)
    product = column_gram(matrix, half, out_dtype, tf32=tf32)
    if half:
        return linalg.restore_half(product, out_dtype, normaliser)
    return product * out_dtype.type(scale)


def column_gram(matrix, half: bool, out_dtype, pieces: int = None,
                tf32: bool = False):
    """``matrix · matrixᵀ`` of a (D, K) matrix with a long K, as the sum of
    ``pieces`` products over equal pieces of K (split-K: a D×D product
    alone keeps few GPU multiprocessors busy when D is small), in
    ``out_dtype``; fp16 operands (``half``) by :func:`linalg.half_matmul`,
    float32 ones in TF32 (``tf32``) by :func:`linalg.tf32_matmul`, others
    by :func:`linalg.in_place_matmul`. On the GPU the pieces are views of
    ``matrix`` that cuBLAS reads where they are (the rows K apart, the
    pieces K / pieces apart; the second operand, the transpose, with
    cuBLAS's flag): no copy of the patches (CuPy's matmul made two, one
    of them transposed).

    ``pieces`` defaults to about one per :data:`SPLIT_K_CHUNK` terms, as
    many as fit :data:`SPLIT_K_MEMORY` elements of partial products.
    """
    d, k = matrix.shape
    if pieces is None:
        pieces = _pieces(k, SPLIT_K_CHUNK)
        while pieces > 1 and pieces * d * d > SPLIT_K_MEMORY:
            pieces = _pieces(k, k // (pieces - 1))
    batch = matrix.reshape(d, pieces, -1).transpose(1, 0, 2)
    if tf32:
        products = linalg.tf32_matmul(batch, batch.transpose(0, 2, 1))
    elif half:
        products = linalg.half_matmul(batch, batch.transpose(0, 2, 1))
    else:
        products = linalg.in_place_matmul(batch, batch.transpose(0, 2, 1))
    return products.sum(axis=0, dtype=out_dtype)


def _taps(offset, stride, outputs, size):
    """Output indices ``i`` whose input index ``i·stride + offset`` falls in
    ``[0, size)`` (a slice of ``range(outputs)``), and those input indices
    (a slice of ``range(size)``)."""
    first = max(0, (stride - 1 - offset) // stride)
    last = max(first, min(outputs, (size - 1 - offset) // stride + 1))
    start = first * stride + offset
    return (slice(first, last),
            slice(start, start + (last - first - 1) * stride + 1, stride))


def _patch_sums(x, geometry, dtype):
    """``Σ_n Σ_locations p`` per patch entry (C·kh·kw,), from ``x``."""
    xp = get_array_module(x)
    n, c, h, w = x.shape
    g = geometry
    oh, ow = g.out_size(h, w)
    image = x.sum(axis=0, dtype=dtype)
    sums = xp.zeros((c, g.kh, g.kw), dtype=dtype)
    for a in range(g.kh):
        _, u = _taps(a * g.dy - g.ph, g.sy, oh, h)
        for b in range(g.kw):
            _, v = _taps(b * g.dx - g.pw, g.sx, ow, w)
            sums[:, a, b] = image[:, u, v].sum(axis=(1, 2))
    return sums.reshape(-1)


# -- shifted ------------------------------------------------------------
class _ShiftedPlan(NamedTuple):
    """What :func:`_shifted_gram` needs beyond the data (host arrays)."""
    left: int                  # 2kw − 1 horizontal shifts
    row_bands: Tuple[Tuple[int, int], ...]
    col_bands: Tuple[Tuple[int, int], ...]
    #: (shifts, blocks per shift, row bands · column bands): which band
    #: sums make each computed block (shift index ``b·kh + a``).
    coefficients: numpy.ndarray
    #: Per pair of taps (kh·kw · kh·kw, row-major): the computed block it
    #: is (index into shifts · blocks per shift), and the weights of that
    #: block and of its transpose (1, 0; 0, 1; or ½, ½ on the diagonal,
    #: which makes it exactly symmetric).
    source: numpy.ndarray
    direct: numpy.ndarray
    mirrored: numpy.ndarray


@functools.lru_cache(maxsize=256)
def _shifted_plan(h: int, w: int, geometry: ConvGeometry) -> _ShiftedPlan:
    """Which sums make each block of :func:`_shifted_gram`, for one size.

    Sums run over the locations ``(u, v)`` (and all samples) of the input.
    The product of the ``b``-th left operand (the input shifted by ``−sx``
    columns, ``sx = (b − kw + 1)·dx``) and the ``a``-th right operand
    (shifted by ``a·dy`` rows) pairs, at location ``(u, v)``, the input at
    ``(u, v − sx)`` with the one at ``(u + a·dy, v)``: in the flat layout
    (C, H, W, N), ``sx·N`` positions before and ``a·dy·W·N`` after. For the
    block of kernel taps ``(a₁, b₁)``, ``(a₁ + a, b₂)`` with
    ``(b₂ − b₁)·dx = sx``, the wanted pairs are those whose ``(u, v)`` lies
    in rows ``[max(0, a₁·dy − ph), min(H, a₁·dy − ph + oh, H − a·dy))`` and
    columns ``[max(0, b₂·dx − pw, sx), min(W, b₂·dx − pw + ow, W + sx))``:
    the first element inside its tap's window of output locations, no wrap
    across a row or an image. The bounds of all blocks cut the rows and the
    columns into bands; each block is a sum of (row band, column band)
    sums. Blocks with ``a < 0``, or ``a = 0`` and ``sx < 0``, are
    transposes of others.
    """
    g = geometry
    oh, ow = g.out_size(h, w)
    left = 2 * g.kw - 1
    blocks = []   # (shift index, taps, row bounds, column bounds)
    for a in range(g.kh):
        for b in range(left):
            sx = (b - g.kw + 1) * g.dx
            for a1 in range(g.kh - a):
                row_lo = min(h, max(0, a1 * g.dy - g.ph))
                row_hi = max(row_lo, min(h, a1 * g.dy - g.ph + oh,
                                         h - a * g.dy))
                for b1 in range(g.kw):
                    b2 = b1 + b - g.kw + 1
                    if not 0 <= b2 < g.kw or (a == 0 and sx < 0):
                        continue
                    col_lo = min(w, max(0, b2 * g.dx - g.pw, sx))
                    col_hi = max(col_lo, min(w, b2 * g.dx - g.pw + ow,
                                             w + sx))
                    blocks.append((b * g.kh + a, (a1, b1, a1 + a, b2),
                                   (row_lo, row_hi), (col_lo, col_hi)))
    row_bands = _bands(h, [k for _, _, bounds, _ in blocks for k in bounds])
    col_bands = _bands(w, [k for _, _, _, bounds in blocks for k in bounds])
    shifts = g.kh * left
    per_shift = [0] * shifts
    slots = []
    for shift, _, _, _ in blocks:
        slots.append(per_shift[shift])
        per_shift[shift] += 1
    width = max(per_shift)
    coefficients = numpy.zeros((shifts, width, len(row_bands),
                                len(col_bands)))
    taps = g.kh * g.kw
    source = numpy.full((taps, taps), -1, numpy.intp)
    direct = numpy.zeros((taps, taps))
    mirrored = numpy.zeros((taps, taps))
    for (shift, (a1, b1, a2, b2), (row_lo, row_hi), (col_lo, col_hi)), \
            slot in zip(blocks, slots):
        for i, (lo, hi) in enumerate(row_bands):
            for j, (c_lo, c_hi) in enumerate(col_bands):
                if row_lo <= lo and hi <= row_hi and \
                        col_lo <= c_lo and c_hi <= col_hi:
                    coefficients[shift, slot, i, j] = 1.0
        first, second = a1 * g.kw + b1, a2 * g.kw + b2
        source[first, second] = source[second, first] = shift * width + slot
        if first == second:
            direct[first, first] = mirrored[first, first] = 0.5
        else:
            direct[first, second] = mirrored[second, first] = 1.0
    assert (source >= 0).all()
    return _ShiftedPlan(left, row_bands, col_bands,
                        coefficients.reshape(shifts, width, -1),
                        source.reshape(-1), direct.reshape(-1),
                        mirrored.reshape(-1))


@functools.lru_cache(maxsize=256)
def _plan_arrays(h: int, w: int, geometry: ConvGeometry, xp, dtype,
                 device: str):
    """The plan's arrays on ``device`` (cached: no host-to-device copy,
    hence no synchronisation, per call): coefficients, source, direct and
    mirrored weights, the latter as (pairs, 1, 1)."""
    plan = _shifted_plan(h, w, geometry)
    return (xp.asarray(plan.coefficients, dtype=dtype),
            xp.asarray(plan.source),
            xp.asarray(plan.direct, dtype=dtype).reshape(-1, 1, 1),
            xp.asarray(plan.mirrored, dtype=dtype).reshape(-1, 1, 1))


def _bands(size, bounds):
    """The non-empty intervals between consecutive cut points of
    ``[0, size)``."""
    cuts = sorted({0, size} | {k for k in bounds if 0 < k < size})
    return tuple(zip(cuts[:-1], cuts[1:]))


def _shifted_gram(x, geometry, scale, factor_dtype):
    xp = get_array_module(x)
    out_dtype = linalg.factor_dtype_for(x.dtype)
    n, c, h, w = x.shape
    g = geometry
    plan = _shifted_plan(h, w, g)
    half = factor_dtype == numpy.float16
    work_dtype = numpy.float16 if half else out_dtype
    normaliser = linalg.half_normaliser(x, scale) if half else None
    row = w * n
    size = h * row
    # The input laid out (C, H, W, N), the samples of a location adjacent,
    # with zero margins, so that every shifted operand is a slice:
    # (kw − 1)·dx locations before, as many plus (kh − 1)·dy rows after.
    margin = (g.kw - 1) * g.dx * n
    flat = xp.zeros((c, 2 * margin + (g.kh - 1) * g.dy * row + size),
                    dtype=work_dtype)
    locations = flat[:, margin:margin + size].reshape(c, h, w, n)
    # A few samples at a time: each copy then reads that many contiguous
    # streams (10x faster on NumPy than the whole transpose at once).
    for first in range(0, n, SAMPLE_BLOCK):
        samples = slice(first, first + SAMPLE_BLOCK)
        linalg.write_scaled(locations[..., samples],
                            x[samples].transpose(1, 2, 3, 0), normaliser)
    del locations
    left = xp.empty((plan.left, c, size), dtype=work_dtype)
    for b in range(plan.left):
        start = margin - (b - g.kw + 1) * g.dx * n
        left[b] = flat[:, start:start + size]
    right = xp.empty((g.kh, c, size), dtype=work_dtype)
    for a in range(g.kh):
        start = margin + a * g.dy * row
        right[a] = flat[:, start:start + size]
    del flat
    left_c, right_c = plan.left * c, g.kh * c
    left = left.reshape(left_c, h, row)
    right = right.reshape(right_c, h, row)
    # The sum over each (row band, column band) rectangle, every location
    # once, as a batch of products over pieces of about CHUNK locations
    # (the pieces make the skinny product GEMMs of a size BLAS does well):
    # in place, a row at a time, when a row of the rectangle is that long;
    # else from a contiguous copy of the rectangle. Offsets in the same row
    # (a = 0) only for sx ≥ 0: the others are their transposes.
    terms = len(plan.row_bands) * len(plan.col_bands)
    # Sums per (shift b·kh + a, term), written in place by the reductions.
    basis = xp.zeros((plan.left, g.kh, terms, c, c), dtype=out_dtype)
    term = 0
    for r_lo, r_hi in plan.row_bands:
        for c_lo, c_hi in plan.col_bands:
            lhs, rhs = (_rectangle(operand, r_lo, r_hi, c_lo * n, c_hi * n)
                        for operand in (left, right))
            rhs = rhs.transpose(0, 1, 3, 2)
            batch = lhs.shape[:2]
            same_row = _matmul(lhs[:, :, (g.kw - 1) * c:], rhs[..., :c], half)
            same_row.reshape(batch + (g.kw, c, c)).sum(
                axis=(0, 1), dtype=out_dtype,
                out=basis[g.kw - 1:, 0, term])
            if g.kh > 1:
                below = _matmul(lhs, rhs[..., c:], half)
                below.reshape(batch + (plan.left, c, g.kh - 1, c)).sum(
                    axis=(0, 1), dtype=out_dtype,
                    out=basis[:, 1:, term].transpose(0, 2, 1, 3))
            term += 1
    del left, right
    weights, source, direct, mirrored = _plan_arrays(
        h, w, g, xp, out_dtype, str(chainer.backend.get_device_from_array(x)))
    blocks = xp.matmul(weights, basis.reshape(plan.left * g.kh, terms, -1))
    blocks = blocks.reshape(-1, c, c)[source]
    # Scale (or, for fp16 operands, their normalisation) restored on the
    # way into the (C, kh, kw, C, kh, kw) layout of the factor.
    restore = (normaliser.peak * normaliser.peak if half
               else out_dtype.type(scale))
    taps = (g.kh, g.kw) * 2
    gram = xp.empty((c, g.kh, g.kw, c, g.kh, g.kw), dtype=out_dtype)
    pairs = gram.transpose(1, 2, 4, 5, 0, 3)   # a view: (taps², C, C)
    xp.multiply(blocks.reshape(taps + (c, c)),
                (direct * restore).reshape(taps + (1, 1)), out=pairs)
    pairs += (blocks.transpose(0, 2, 1) * (mirrored * restore)).reshape(
        taps + (c, c))
    return gram.reshape(c * g.kh * g.kw, -1)


def _rectangle(operand, r_lo, r_hi, c_lo, c_hi):
    """Rows ``[r_lo, r_hi)`` and positions ``[c_lo, c_hi)`` within a row of
    a (k·C, rows, row) operand as a batch (rows or 1, pieces, k·C, piece)."""
    rows, run = r_hi - r_lo, c_hi - c_lo
    block = operand[:, r_lo:r_hi, c_lo:c_hi]
    if run < CHUNK and rows > 1:
        block = get_array_module(operand).ascontiguousarray(block).reshape(
            operand.shape[0], 1, rows * run)
        rows, run = 1, rows * run
    pieces = _pieces(run)
    return block.reshape(operand.shape[0], rows, pieces, -1).transpose(
        1, 2, 0, 3)


def _pieces(length: int, chunk: int = None) -> int:
    """Into how many equal chunks of about ``chunk`` (:data:`CHUNK`)
    positions a run of ``length`` positions is cut for a batched product."""
    pieces = max(1, length // (chunk or CHUNK))
    while length % pieces:
        pieces -= 1
    return pieces


def _matmul(a, b, half):
    """``a @ b``; for fp16 operands (``half``) with fp32 accumulation."""
    return linalg.half_matmul(a, b) if half else get_array_module(a).matmul(
        a, b)
