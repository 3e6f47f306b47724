"""Kronecker factors of a convolution, formed without Chainer's im2col.

KFC's input factor ``A = scale · Σ_n Σ_locations p pᵀ`` runs over the
patches ``p`` of the layer input, a patch being ordered (channel, kernel row,
kernel column) like ``W.reshape(d_out, -1)``; the output-gradient factor
``G`` is the Gram matrix of the channel vectors of ``gy`` over samples and
locations. This module forms both for NumPy and CuPy alike, in one of two
ways (:func:`patch_gram` picks the cheaper by :func:`strategy_costs` on the
CPU, the faster by timing on the GPU under ``chainer.config.autotune``):

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
  one product of ``2kw−1`` horizontally shifted copies of the input
  against ``kh`` vertically shifted copies, ``15·C²`` multiply-adds per
  location for a 3×3 kernel (13 of them used) instead of ``(9·C)²`` (a
  GEMM) or half that (``syrk``). The input is laid out with zeros after
  each row, so that the product over every location is each offset's
  full correlation; the taps' windows differ from it only at the border,
  and a few products over the border rows, columns and their crossings
  correct each block (:func:`_shifted_plan`). On the GPU that is five
  cuBLAS calls a layer, the first split-K, reading its operands in place.

With ``factor_dtype='float16'`` the operands are written in half precision,
scaled by ``√scale / max|x|`` in the same copy that lays them out, the
products accumulate in fp32 (:func:`chainerkfac.linalg.half_matmul`, Tensor
Cores on GPU) and round to fp16, and the assembly runs in fp32.

With ``tf32`` (``factor_dtype='tf32'``), float32 products take their
operands to TF32's 10-bit mantissa: on the GPU they run on TF32 Tensor
Cores (:func:`chainerkfac.linalg.tf32_matmul`); on NumPy the operands are
rounded (:func:`chainerkfac.linalg.round_to_tf32`) and multiplied exactly:
the same operands, so the CPU is the GPU's twin. The bias's sums
(``append_ones``) are of the input as it is.
"""
import functools
import logging
from typing import Callable, Dict, NamedTuple, Tuple

import numpy

import chainer
from chainer.backend import get_array_module
from chainer.utils import conv

from chainerkfac import linalg
from chainerkfac.stage_timer import device_timed as _timed

logger = logging.getLogger(__name__)

#: Cost of copying one element, in multiply-add equivalents, for
#: :func:`strategy_costs`: fitted to both strategies' times on ResNet-style
#: 3×3 layers (C 16-512, H 7-56, batches 8 and 32; a 2-core Xeon, OpenBLAS
#: with 2 threads), where a GEMM does ~9e10 multiply-adds/s and a strided
#: copy into fresh memory moves ~7e8 elements/s. Every layer of that grid
#: then takes the faster strategy, or one within 0.4 ms of it.
COPY_COST = 100.0
#: Samples moved per copy when the input is laid out with samples innermost.
SAMPLE_BLOCK = 8
#: Split-K of the unfolded product on GPU (:func:`column_gram`): terms per
#: piece, and the most elements of partial products. Not measured yet: the
#: GPU benchmark's capture by layer type is where to calibrate them.
SPLIT_K_CHUNK = 4096
SPLIT_K_MEMORY = 2 ** 25
#: On the GPU each split-K piece of the shifted product's full term starts
#: a multiple of this many elements into its row (the rows too): 32 bytes
#: in fp32, 16 in fp16, the alignment cuBLAS's vectorised and Tensor Core
#: kernels need (ResNet-50's res2 at batch 32 had pieces 4158 elements
#: apart, rows 103950). The positions added are zeros.
POSITION_ALIGN = 8


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
        Force a way of forming the product. By default the cheaper one by
        :func:`strategy_costs` on the CPU; on the GPU the unfolded one,
        unless ``chainer.config.autotune`` is set (as for cuDNN's
        algorithms): then both are timed the first time an input shape
        is seen and the faster is kept for it (:func:`timed_choices`).
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
    if strategy is not None and strategy not in costs:
        raise ValueError('strategy {!r} does not apply to {} (possible: {})'
                         .format(strategy, geometry, ', '.join(costs)))
    factor_dtype = numpy.dtype(factor_dtype)
    tf32 = linalg.tf32_products(tf32, x.dtype, factor_dtype)

    def form(way):
        if way == 'shifted':
            return _shifted_gram(x, geometry, scale, factor_dtype, tf32)
        return _unfolded_gram(x, geometry, scale, factor_dtype, tf32)

    if strategy is not None:
        gram = form(strategy)
    elif xp is numpy:
        gram = form(min(costs, key=costs.get))
    elif len(costs) > 1 and chainer.config.autotune:
        key = (x.shape, x.dtype.str, geometry, factor_dtype.str, tf32,
               str(chainer.backend.get_device_from_array(x)))
        if xp.cuda.get_current_stream().is_capturing():
            # no timing in a CUDA graph's capture: the way an eager step
            # timed for this shape (a refresh step's replayed passes form
            # A as its eager ones do), else the unfolded one
            gram = form(_TIMED.get(key, 'unfolded'))
        else:
            gram = _timed_choice(key, form, xp)
    else:
        # On the GPU the shifted product as it was then (a product per
        # band rectangle, CuPy's matmul copying operands) lost to the
        # unfolded one: ResNet-50, batch 32, one H100, Conv A capture
        # 0.062 s unfolded against 0.117 s as the CPU cost model chose.
        # Today's (five cuBLAS calls a layer, 2.6-4.9x fewer multiply-adds
        # on ResNet-50's 3x3 layers) has not been timed on a GPU: it is
        # chosen where it is timed faster (``chainer.config.autotune``).
        gram = form('unfolded')
    if not append_ones:
        return gram
    oh, ow = geometry.out_size(*x.shape[2:])
    return linalg.append_ones_row(gram, _patch_sums(x, geometry, gram.dtype),
                                  x.shape[0] * oh * ow, scale)


#: :func:`patch_gram`'s choices by timing (CuPy, ``chainer.config.
#: autotune``): input shape, dtype, geometry, factor dtype, TF32, device
#: → the strategy kept.
_TIMED: Dict[tuple, str] = {}
#: How far the two strategies' factors may differ for the timing to
#: choose between them, relative to the factor's largest entry: the
#: roundings of sums in other orders (fp32; fp16 rounds each split-K
#: piece's sum, 2^-11), where one border row or column missing would be
#: off by about 1/H of an entry (2 % at H = 56).
AGREEMENT = {'float32': 1e-4, 'float64': 1e-10}
AGREEMENT_REDUCED = 5e-3   # TF32 or fp16 operands


def timed_choices() -> Dict[tuple, str]:
    """The strategies :func:`patch_gram` chose by timing in this process:
    ``(shape, dtype, geometry, factor dtype, tf32, device) → strategy``."""
    return dict(_TIMED)


def _timed_choice(key: tuple, form: Callable[[str], object], xp):
    """The factor by the strategy timed faster for ``key`` (timed, with a
    warm-up of each, the first time the key is seen). A strategy that
    raises, or whose factor does not agree with the other's, is not
    chosen, and the reason is logged once."""
    chosen = _TIMED.get(key)
    if chosen is not None:
        return form(chosen)
    results, seconds = {}, {}
    for way in ('unfolded', 'shifted'):
        try:
            form(way)                                   # warm-up
            results[way], seconds[way] = _timed(xp, lambda: form(way))
        except Exception as error:   # any failure: the way is not chosen
            if way == 'unfolded':
                raise
            logger.warning('convolution A %s: the shifted product failed '
                           '(%s: %s); the unfolded one is kept', key,
                           type(error).__name__, error)
    chosen = 'unfolded'
    if 'shifted' in results:
        unfolded, shifted = results['unfolded'], results['shifted']
        peak = float(abs(unfolded).max())
        tolerance = (AGREEMENT_REDUCED if key[3] == numpy.dtype(
            numpy.float16).str or key[4] else AGREEMENT.get(
                numpy.dtype(unfolded.dtype).name, 1e-4)) * peak
        gap = float(abs(shifted - unfolded).max())
        if not gap <= tolerance:
            logger.warning('convolution A %s: the shifted product differs '
                           'from the unfolded one by %.3g (largest entry '
                           '%.3g); the unfolded one is kept', key, gap, peak)
        elif seconds['shifted'] < seconds['unfolded']:
            chosen = 'shifted'
    _TIMED[key] = chosen
    logger.debug('convolution A %s: unfolded %.3g s, shifted %s s: %s', key,
                 seconds['unfolded'], seconds.get('shifted'), chosen)
    return results[chosen]


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
        positions, pieces, _, length = _shifted_layout(h, w, n, g, xp)
        operands = (plan.left + g.kh) * c
        # Positions of the border terms: rows (with their gaps), columns,
        # cells.
        border = (len(plan.rows) * (w + plan.gap) * n + len(plan.cols) *
                  h * n + len(plan.rows) * len(plan.cols) * n)
        shifts, taps = plan.left * g.kh, (g.kh * g.kw) ** 2
        # The layout, the shifted operands, the gathered border, the
        # partial products and terms, and the assembly: the blocks (all
        # slots), their gather, the pairs (half of them transposed).
        copies = (c * length + operands * (positions + border) +
                  (pieces + plan.terms) * shifts * c * c +
                  (plan.weights.shape[0] * plan.weights.shape[1] +
                   len(plan.first) + 2 * taps) * c * c)
        costs['shifted'] = (shifts * c * c * (positions + border) +
                            plan.weights.size * c * c +
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
    return split_k_product(matrix, matrix, half, out_dtype, pieces, tf32)


def split_k_product(left, right, half: bool, out_dtype, pieces: int = None,
                    tf32: bool = False):
    """``left · rightᵀ`` of a (D₁, K) and a (D₂, K) matrix, as
    :func:`column_gram` forms ``matrix · matrixᵀ`` (``pieces`` must
    divide K)."""
    (d1, k), d2 = left.shape, right.shape[0]
    if pieces is None:
        pieces = _pieces(k, SPLIT_K_CHUNK)
        while pieces > 1 and pieces * d1 * d2 > SPLIT_K_MEMORY:
            pieces = _pieces(k, k // (pieces - 1))
    lhs, rhs = (operand.reshape(operand.shape[0], pieces, -1).transpose(
        1, 0, 2) for operand in (left, right))
    return _matmul(lhs, rhs.transpose(0, 2, 1), half, tf32).sum(
        axis=0, dtype=out_dtype)


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
    gap: int                   # zero columns after each row of the layout
    #: Input rows (columns) outside some tap's window: each has a term.
    rows: Tuple[int, ...]
    cols: Tuple[int, ...]
    #: (shifts, slots, terms), shift index ``a·left + b``: how the terms'
    #: C×C blocks of a shift make the blocks of the factor at that shift,
    #: +1 or −1 (slots beyond a shift's blocks are zero). The terms: the
    #: full sum, then one per row, column and (row, column) cell above.
    weights: numpy.ndarray
    #: The blocks of the factor computed, the diagonal's first: each one's
    #: slot (shift · slots + slot), and its pair of taps (kernel row · kw +
    #: kernel column), first and second.
    slot: numpy.ndarray
    first: numpy.ndarray
    second: numpy.ndarray

    @property
    def terms(self) -> int:
        return self.weights.shape[2]


def _window(tap: int, step: int, pad: int, outputs: int, size: int):
    """``(lo, hi)``: the input indices in ``[0, size)`` that a kernel tap
    (row or column) reads over the ``outputs`` locations of a stride-1
    convolution."""
    first = tap * step - pad
    return min(size, max(0, first)), max(0, min(size, first + outputs))


@functools.lru_cache(maxsize=256)
def _shifted_plan(h: int, w: int, geometry: ConvGeometry) -> _ShiftedPlan:
    """Which sums make each block of :func:`_shifted_gram`, for one size.

    The input is laid out (C, H, W + gap, N), each row followed by
    ``gap = (kw − 1)·dx`` zero columns and the image by zero rows, so that
    a shifted read past a row's end, or the image's, reads zeros. A
    position ``t = (u, v)`` of that layout (any column, gap included)
    pairs the ``b``-th left operand, the input shifted by
    ``sx = (b − kw + 1)·dx`` columns, with the ``a``-th right operand,
    shifted by ``a·dy`` rows: the input at ``(u, v − sx)`` with the one at
    ``(u + a·dy, v)``, and zero where either lies outside the image. Summed
    over all positions, that is every pair of input locations at that
    offset: the *full* term. The block of kernel taps ``(a₁, b₁)``,
    ``(a₁ + a, b₂)`` with ``(b₂ − b₁)·dx = sx`` wants the positions whose
    row ``u`` the tap ``a₁`` reads (:func:`_window`; the row of the first
    element) and whose column ``v`` the tap ``b₂`` reads (the column of
    the second): the full term less the rows and the columns outside those
    windows, plus their crossings, counted twice. Windows differ from the
    image only at its border, so the terms are the full one, and one per
    such row, column and (row, column) cell: for a 3×3 kernel with padding
    1, nine. Blocks with ``a < 0``, or ``a = 0`` and ``sx < 0``, are
    transposes of others.
    """
    g = geometry
    oh, ow = g.out_size(h, w)
    left = 2 * g.kw - 1
    row_windows = [_window(a, g.dy, g.ph, oh, h) for a in range(g.kh)]
    col_windows = [_window(b, g.dx, g.pw, ow, w) for b in range(g.kw)]
    rows = tuple(sorted({u for lo, hi in row_windows for u in range(h)
                         if not lo <= u < hi}))
    cols = tuple(sorted({v for lo, hi in col_windows for v in range(w)
                         if not lo <= v < hi}))
    terms = 1 + len(rows) + len(cols) + len(rows) * len(cols)

    def signs(a1, b2):
        """The terms of the block whose row window is tap ``a1``'s and
        whose column window is tap ``b2``'s, with their signs."""
        lo, hi = row_windows[a1]
        c_lo, c_hi = col_windows[b2]
        out_r = [i for i, u in enumerate(rows) if not lo <= u < hi]
        out_c = [j for j, v in enumerate(cols) if not c_lo <= v < c_hi]
        return ([(0, 1.0)] + [(1 + i, -1.0) for i in out_r] +
                [(1 + len(rows) + j, -1.0) for j in out_c] +
                [(1 + len(rows) + len(cols) + i * len(cols) + j, 1.0)
                 for i in out_r for j in out_c])

    blocks = {}   # shift → [(a1, b1, b2)]
    for a in range(g.kh):
        for b in range(left):
            blocks[a * left + b] = [
                (a1, b1, b1 + b - g.kw + 1) for a1 in range(g.kh - a)
                for b1 in range(g.kw)
                if 0 <= b1 + b - g.kw + 1 < g.kw and
                not (a == 0 and b < g.kw - 1)]
    slots = max(len(taps) for taps in blocks.values())
    weights = numpy.zeros((g.kh * left, slots, terms))
    computed = []   # (off the diagonal, slot, first, second)
    for shift, taps in blocks.items():
        a = shift // left
        for slot, (a1, b1, b2) in enumerate(taps):
            for term, sign in signs(a1, b2):
                weights[shift, slot, term] = sign
            first, second = a1 * g.kw + b1, (a1 + a) * g.kw + b2
            computed.append((first != second, shift * slots + slot, first,
                             second))
    computed.sort()
    assert len(computed) == g.kh * g.kw * (g.kh * g.kw + 1) // 2
    _, slot, first, second = (numpy.array(column, dtype=numpy.intp)
                              for column in zip(*computed))
    return _ShiftedPlan(left, (g.kw - 1) * g.dx, rows, cols, weights, slot,
                        first, second)


@functools.lru_cache(maxsize=256)
def _plan_arrays(h: int, w: int, n: int, geometry: ConvGeometry, xp, dtype,
                 device: str):
    """The plan's arrays on ``device`` (cached: no host-to-device copy,
    hence no synchronisation, per call): the weights; the slots and both
    taps' kernel rows and columns of the blocks on the diagonal, then of
    the others; the positions of the border terms
    (:func:`_border_positions`)."""
    g = geometry
    plan = _shifted_plan(h, w, g)
    taps = g.kh * g.kw

    def blocks(part):
        return tuple(xp.asarray(index) for index in (
            plan.slot[part], plan.first[part] // g.kw,
            plan.first[part] % g.kw, plan.second[part] // g.kw,
            plan.second[part] % g.kw))

    # on the device they are cached for, whichever is current
    with chainer.using_device(chainer.get_device(device)):
        return (xp.asarray(plan.weights, dtype=dtype),
                blocks(slice(None, taps)), blocks(slice(taps, None)),
                [(count, xp.asarray(where)) for count, where in
                 _border_positions(h, w, n, plan)])


def _border_positions(h: int, w: int, n: int, plan: _ShiftedPlan):
    """``(terms, positions)`` of the border rows, columns and cells (those
    there are), in the layout of :func:`_shifted_gram`: the positions of
    each term in turn, equally many."""
    grid = numpy.arange(h * (w + plan.gap) * n).reshape(h, -1, n)
    rows, cols = list(plan.rows), list(plan.cols)
    groups = [(len(rows), grid[rows]),
              (len(cols), grid[:, cols].transpose(1, 0, 2)),
              (len(rows) * len(cols), grid[rows][:, cols])]
    return [(count, where.reshape(-1)) for count, where in groups if count]


def _shifted_layout(h: int, w: int, n: int, geometry: ConvGeometry,
                    xp) -> Tuple[int, int, int, int]:
    """``(positions, pieces, front, length)`` of :func:`_shifted_gram`'s
    layout: the positions summed (the image's rows with their gaps, then
    zeros up to a multiple of ``pieces``, on CuPy of ``pieces ·``
    :data:`POSITION_ALIGN`), the split-K pieces of the full term (about
    :data:`SPLIT_K_CHUNK` positions each on CuPy), the zeros
    before the image, and the length of a channel's row."""
    g = geometry
    gap = (g.kw - 1) * g.dx
    row = (w + gap) * n
    image = h * row
    # One product on NumPy (measured faster than pieces of 256 to 4096
    # positions), split-K on CuPy, every piece aligned.
    pieces = 1 if xp is numpy else max(1, round(image / SPLIT_K_CHUNK))
    step = pieces if xp is numpy else pieces * POSITION_ALIGN
    positions = -(-image // step) * step
    front = gap * n
    # Reads run up to gap columns before and after a position (left
    # operands) and (kh − 1)·dy rows after it (right operands).
    return (positions, pieces, front,
            front + positions + max(gap * n, (g.kh - 1) * g.dy * row))


def _shifted_gram(x, geometry, scale, factor_dtype, tf32=False):
    xp = get_array_module(x)
    out_dtype = linalg.factor_dtype_for(x.dtype)
    n, c, h, w = x.shape
    g = geometry
    plan = _shifted_plan(h, w, g)
    weights, diagonal, others, border = _plan_arrays(
        h, w, n, g, xp, out_dtype,
        str(chainer.backend.get_device_from_array(x)))
    half = factor_dtype == numpy.float16
    work_dtype = numpy.float16 if half else out_dtype
    normaliser = linalg.half_normaliser(x, scale) if half else None
    positions, pieces, front, length = _shifted_layout(h, w, n, g, xp)
    wide = w + plan.gap
    row = wide * n
    # The input laid out (C, H, W + gap, N), the samples of a location
    # adjacent, zeros around (_shifted_plan).
    flat = xp.zeros((c, length), dtype=work_dtype)
    image = flat[:, front:front + h * row].reshape(c, h, wide, n)
    # A few samples at a time: each copy then reads that many contiguous
    # streams (10x faster on NumPy than the whole transpose at once).
    for first in range(0, n, SAMPLE_BLOCK):
        samples = slice(first, first + SAMPLE_BLOCK)
        linalg.write_scaled(image[:, :, :w, samples],
                            x[samples].transpose(1, 2, 3, 0), normaliser)
    del image
    left = xp.empty((plan.left, c, positions), dtype=work_dtype)
    for b in range(plan.left):
        start = front - (b - g.kw + 1) * g.dx * n
        left[b] = flat[:, start:start + positions]
    right = xp.empty((g.kh, c, positions), dtype=work_dtype)
    for a in range(g.kh):
        start = front + a * g.dy * row
        right[a] = flat[:, start:start + positions]
    del flat
    left = left.reshape(plan.left * c, positions)
    right = right.reshape(g.kh * c, positions)
    # The terms, (kh, left) blocks of C×C each, products of the operands
    # over some positions: the full one over all of them (split-K), and
    # those of the border rows, columns and cells, gathered (a few
    # positions each).
    terms = xp.empty((plan.terms, g.kh, plan.left, c, c), dtype=out_dtype)
    as_blocks = (-1, plan.left, c, g.kh, c)
    terms[0] = split_k_product(left, right, half, out_dtype, pieces,
                               tf32).reshape(as_blocks).transpose(
                                   0, 3, 1, 2, 4)[0]
    done = 1
    for count, where in border:
        lhs, rhs = (operand.take(where, axis=1).reshape(
            operand.shape[0], count, -1).transpose(1, 0, 2)
            for operand in (left, right))
        terms[done:done + count] = _matmul(
            lhs, rhs.transpose(0, 2, 1), half, tf32).reshape(
                as_blocks).transpose(0, 3, 1, 2, 4)
        done += count
    del left, right
    # Each block of the factor, its shift's blocks of the terms weighted,
    # the scale (or, for fp16 operands, their normalisation) restored;
    # then into the (C, kh, kw, C, kh, kw) layout of the factor: the
    # diagonal's made exactly symmetric, the others with their transposes.
    restore = (normaliser.peak * normaliser.peak if half
               else out_dtype.type(scale))
    blocks = linalg.in_place_matmul(
        weights * restore,
        terms.reshape(plan.terms, -1, c * c).transpose(1, 0, 2))
    blocks = blocks.reshape(-1, c, c)
    del terms
    gram = xp.empty((c, g.kh, g.kw, c, g.kh, g.kw), dtype=out_dtype)
    # a view: (kh, kw, kh, kw, C, C), a block per pair of taps
    pairs = gram.transpose(1, 2, 4, 5, 0, 3)
    slot, a1, b1, a2, b2 = diagonal
    square = blocks.take(slot, axis=0)
    pairs[a1, b1, a1, b1] = (square + square.transpose(0, 2, 1)) * \
        out_dtype.type(0.5)
    slot, a1, b1, a2, b2 = others
    square = blocks.take(slot, axis=0)
    pairs[a1, b1, a2, b2] = square
    pairs[a2, b2, a1, b1] = square.transpose(0, 2, 1)
    return gram.reshape(c * g.kh * g.kw, -1)


def _pieces(length: int, chunk: int) -> int:
    """Into how many equal chunks of about ``chunk`` positions a run of
    ``length`` positions is cut for a batched product."""
    pieces = max(1, length // chunk)
    while length % pieces:
        pieces -= 1
    return pieces


def _matmul(a, b, half: bool, tf32: bool = False):
    """``a @ b``: for fp16 operands (``half``) with fp32 accumulation, for
    ``tf32`` ones on TF32 Tensor Cores, else exact; operands that are
    views are read where they are (:func:`linalg.in_place_matmul`)."""
    if half:
        return linalg.half_matmul(a, b)
    if tf32:
        return linalg.tf32_matmul(a, b)
    return linalg.in_place_matmul(a, b)
