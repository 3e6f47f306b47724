"""Row-major GEMMs on our own cuBLAS handle (:mod:`chainerkfac.graphs.
cublas`), which a CUDA graph may capture, and Chainer's ``F.linear``
routed through them.

:class:`Gemm` keeps one handle per thread and device, sets it to CuPy's
current stream only when the stream changed, and gives it a workspace of
its own for each stream (:data:`WORKSPACE_BYTES`; cuBLAS then allocates
nothing while a stream is captured). :meth:`Gemm.matmul` computes
``op(a) @ op(b)`` for C-contiguous float32 / float64 matrices (2-D) or
equal-length stacks of them (3-D, strided batched), in IEEE single or
double precision (``CUBLAS_DEFAULT_MATH``: no TF32, as CuPy's and
PyTorch's default), or,
asked for float32 (``tf32=True``), on TF32 Tensor Cores (a second handle,
in ``CUBLAS_TF32_TENSOR_OP_MATH``): K-FAC's factor products with
``factor_dtype='tf32'`` (:func:`tf32_matmul`).

cuBLAS is column-major: a C-contiguous ``r x c`` matrix is the
column-major ``c x r`` matrix with leading dimension ``c``, its transpose.
So ``C = op(A) op(B)`` (row-major) is computed as ``Cᵀ = op(B)ᵀ op(A)ᵀ``
(column-major): the operands swap, each keeps its own transposition flag.

:func:`route_linear` makes Chainer's ``LinearFunction``,
``LinearGradData`` and ``LinearGradWeight`` (``F.linear`` and its
gradients) use :meth:`Gemm.matmul` for the arrays it serves, so a step
with a Linear layer has no CuPy cuBLAS call left; other arrays (NumPy, or
a dtype it does not serve) take Chainer's own code. It patches those three
``forward`` methods and restores them on exit (a ``with`` block).
:func:`route_matmul` does the same for ``cupy.matmul`` (K-FAC's stage 5,
:func:`chainerkfac.linalg.matmul`), and :func:`route_step` both, around a
whole step.
"""
import contextlib
import ctypes
import logging
import threading
from typing import Dict, Optional, Tuple

import numpy

from chainerkfac.graphs import cublas

logger = logging.getLogger(__name__)

#: Workspace per handle and stream (cuBLAS's own default on Hopper is 32
#: MiB; the probe captured sgemm with this size).
WORKSPACE_BYTES = 32 * 1024 * 1024

_GEMMS = {'f': ('cublasSgemm_v2', 'cublasSgemmStridedBatched',
                ctypes.c_float),
          'd': ('cublasDgemm_v2', 'cublasDgemmStridedBatched',
                ctypes.c_double),
          # fp16 operands and result, fp32 accumulation (fp32 scalars)
          'e': ('cublasGemmEx', 'cublasGemmStridedBatchedEx',
                ctypes.c_float)}
_SCALARS = {char: (ctypes.byref(ctype(1.0)), ctypes.byref(ctype(0.0)))
            for char, (_, _, ctype) in _GEMMS.items()}


class CupyArrays:
    """What :class:`Gemm` needs from CuPy (the tests pass a NumPy twin)."""

    def __init__(self, cupy):
        self._cupy = cupy

    def serves(self, array) -> bool:
        return isinstance(array, self._cupy.ndarray)

    def empty(self, shape, dtype):
        return self._cupy.empty(shape, dtype)

    def pointer(self, array) -> int:
        return array.data.ptr

    def alloc(self, nbytes: int):
        memory = self._cupy.cuda.alloc(nbytes)
        return memory.ptr, memory

    def device_id(self) -> int:
        return self._cupy.cuda.runtime.getDevice()

    def stream(self) -> int:
        return self._cupy.cuda.get_current_stream().ptr


class Gemm:
    """GEMMs on this process's own cuBLAS handles (module docstring).

    Parameters
    ----------
    lib : chainerkfac.graphs.cublas.Library
    arrays : CupyArrays
    """

    def __init__(self, lib, arrays):
        self.lib = lib
        self.arrays = arrays
        self._local = threading.local()
        self._lock = threading.Lock()
        self._handles = []
        # (handle, stream) -> (pointer, owner): kept for the process (a
        # captured graph may use it)
        self._workspaces: Dict[Tuple[int, int], Tuple[int, object]] = {}
        # every thread's [handle, stream] (release_stream resets them)
        self._entries = []

    def handle(self, math: int = cublas.CUBLAS_DEFAULT_MATH) -> int:
        """This thread's handle on the current device in the math mode
        ``math`` (exact by default), on the current stream, with its
        workspace for that stream."""
        mine = getattr(self._local, 'handles', None)
        if mine is None:
            mine = self._local.handles = {}
        device = self.arrays.device_id()
        entry = mine.get((device, math))
        if entry is None:
            handle = self.lib.create()
            self.lib.call('cublasSetMathMode', handle, math)
            entry = mine[(device, math)] = [handle, None]
            with self._lock:
                self._handles.append(handle)
                self._entries.append(entry)
        stream = self.arrays.stream()
        if entry[1] != stream:
            handle = entry[0]
            self.lib.call('cublasSetStream_v2', handle, stream)
            # cublasSetStream resets the workspace to cuBLAS's own pool:
            # give it ours for this stream, after.
            key = (handle, stream)
            with self._lock:
                if key not in self._workspaces:
                    self._workspaces[key] = self.arrays.alloc(
                        WORKSPACE_BYTES)
                pointer, _ = self._workspaces[key]
            self.lib.call('cublasSetWorkspace_v2', handle, pointer,
                          WORKSPACE_BYTES)
            entry[1] = stream
        return entry[0]

    def serves(self, *arrays) -> bool:
        """Whether :meth:`matmul` takes these operands: device arrays of
        one dtype, float16, float32 or float64, 2-D or 3-D alike, each
        row-major
        (:func:`row_major`: C-contiguous, or rows at a regular stride,
        e.g. a column block of a wider matrix, and matrices of a stack at
        any regular stride)."""
        first = arrays[0]
        return (all(self.arrays.serves(a) for a in arrays) and
                first.dtype.char in _GEMMS and first.ndim in (2, 3) and
                all(a.dtype == first.dtype and a.ndim == first.ndim and
                    row_major(a) is not None for a in arrays))

    def matmul(self, a, b, transa: bool = False, transb: bool = False,
               out=None, tf32: bool = False):
        """``op(a) @ op(b)`` (``op`` transposes the last two axes when
        asked) into ``out`` or a new array; see :meth:`serves`. ``tf32``:
        float32 operands on TF32 Tensor Cores (float64 stays exact).
        float16: ``cublasGemmEx``, fp32 accumulation, an fp16 result
        (CuPy's fp16 matmul)."""
        if not self.serves(a, b):
            raise TypeError('Gemm.matmul takes row-major (C-contiguous or '
                            'row-strided) float16, float32 or float64 '
                            'device arrays of one dtype, both 2-D or both '
                            '3-D (got {} {} '
                            '{} and {} {} {})'.format(
                                a.shape, a.dtype, a.strides, b.shape,
                                b.dtype, b.strides))
        rows_a, cols_a = a.shape[-2:]
        rows_b, cols_b = b.shape[-2:]
        m, k = (cols_a, rows_a) if transa else (rows_a, cols_a)
        k_b, n = (cols_b, rows_b) if transb else (rows_b, cols_b)
        batch = a.shape[0] if a.ndim == 3 else None
        if k != k_b or (batch is not None and b.shape[0] != batch):
            raise ValueError('matmul: shapes {} and {} do not match (transa='
                             '{}, transb={})'.format(a.shape, b.shape,
                                                     transa, transb))
        shape = (m, n) if batch is None else (batch, m, n)
        if out is None:
            out = self.arrays.empty(shape, a.dtype)
        elif tuple(out.shape) != shape or not self.serves(a, out) or \
                not out.flags.c_contiguous:
            raise ValueError('matmul: out must be C-contiguous {} {}'.format(
                shape, a.dtype))
        single, strided, _ = _GEMMS[a.dtype.char]
        one, zero = _SCALARS[a.dtype.char]
        p = self.arrays.pointer
        (ld_a, stride_a), (ld_b, stride_b) = row_major(a), row_major(b)
        ops = (cublas.CUBLAS_OP_T if transb else cublas.CUBLAS_OP_N,
               cublas.CUBLAS_OP_T if transa else cublas.CUBLAS_OP_N)
        if a.dtype.char == 'e':
            # Tensor Cores (the default math, as CuPy's fp16 matmul), the
            # partial sums of a split-K in fp32 too (not the fp16 output's
            # precision, which cuBLAS allows unless told not to)
            handle = self.handle(
                cublas.CUBLAS_DEFAULT_MATH |
                cublas.CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)
            half, tail = cublas.CUDA_R_16F, (cublas.CUBLAS_COMPUTE_32F,
                                             cublas.CUBLAS_GEMM_DEFAULT)
            if batch is None:
                self.lib.call(single, handle, *ops, n, m, k, one, p(b), half,
                              ld_b, p(a), half, ld_a, zero, p(out), half, n,
                              *tail)
            elif batch:
                self.lib.call(strided, handle, *ops, n, m, k, one, p(b),
                              half, ld_b, stride_b, p(a), half, ld_a,
                              stride_a, zero, p(out), half, n, m * n, batch,
                              *tail)
            return out
        # The default math computes in at least the operands' precision
        # (no TF32 for float32), cuBLAS's fastest such kernels; its
        # pedantic math (used here until 2026-11-26) is, in cuBLAS's words,
        # for numerical robustness studies and "might not be as
        # performant".
        handle = self.handle(
            cublas.CUBLAS_TF32_TENSOR_OP_MATH if tf32 and a.dtype.char == 'f'
            else cublas.CUBLAS_DEFAULT_MATH)
        if batch is None:
            self.lib.call(single, handle, *ops, n, m, k, one, p(b), ld_b,
                          p(a), ld_a, zero, p(out), n)
        elif batch:
            self.lib.call(strided, handle, *ops, n, m, k, one, p(b), ld_b,
                          stride_b, p(a), ld_a, stride_a, zero, p(out), n,
                          m * n, batch)
        return out

    def release_stream(self, stream: int) -> None:
        """Let go of the workspaces given for ``stream`` (a closed
        StepGraph's side stream); a handle set to it is set again on its
        next use (on any thread)."""
        with self._lock:
            for key in [k for k in self._workspaces if k[1] == stream]:
                del self._workspaces[key]
            for entry in self._entries:
                if entry[1] == stream:
                    entry[1] = None     # stream and workspace set anew

    def close(self) -> None:
        """Destroy every handle (at exit) and let the workspaces go."""
        with self._lock:
            handles, self._handles = self._handles, []
            self._workspaces.clear()
            self._entries = []
        self._local = threading.local()
        for handle in handles:
            self.lib.call('cublasDestroy_v2', handle)


def row_major(array) -> Optional[Tuple[int, int]]:
    """``(ld, stride)`` in elements where cuBLAS can read ``array`` (2-D,
    or a 3-D stack) in place as row-major matrices: the elements of a row
    adjacent, the rows ``ld`` apart (at least a row's length), the
    matrices of a stack ``stride`` apart (0 for 2-D); else None. A
    C-contiguous array has ``ld`` = its columns; a column block of a wider
    matrix (``x[:, a:b]``), or the pieces of a split-K product
    (``x.reshape(d, p, -1).transpose(1, 0, 2)``), need no copy."""
    itemsize = array.dtype.itemsize
    if array.ndim not in (2, 3) or any(s % itemsize or s < 0
                                       for s in array.strides):
        return None
    rows, cols = array.shape[-2:]
    ld, step = (s // itemsize for s in array.strides[-2:])
    if cols > 1 and step != 1:
        return None
    if rows <= 1:
        ld = max(cols, 1)        # the row stride of a single row is moot
    if ld < max(cols, 1):
        return None
    # the matrices of a stack may interleave (split-K pieces): cuBLAS
    # reads its operands, any stride will do
    return ld, array.strides[0] // itemsize if array.ndim == 3 else 0


_gemm: Optional[Gemm] = None


def default() -> Gemm:
    """The process's :class:`Gemm` over CuPy and the cuBLAS of
    :func:`chainerkfac.graphs.cublas.load` (made on first use; closed at
    exit)."""
    global _gemm
    if _gemm is None:
        import atexit
        import cupy
        # CuPy opens its cuBLAS lazily (for its first handle): open it now,
        # so that cublas.load() takes that build rather than looking for
        # one of its own (CUDA 13's wheels are on no loader path)
        try:
            cupy.cuda.device.get_cublas_handle()
        except Exception as error:  # load() says what is missing
            logger.debug('CuPy could not open its cuBLAS: %s', error)
        _gemm = Gemm(cublas.load(), CupyArrays(cupy))
        atexit.register(_gemm.close)
    return _gemm


def in_place_matmul(cupy, a, b):
    """``a @ b`` of float16 / float32 / float64 device operands that are
    views — row-strided (:func:`row_major`) or the transposes of such —
    read by cuBLAS where they are; None where this process has no cuBLAS
    of its own (:func:`chainerkfac.graphs.cublas.load` found none) or the
    operands are not served. CuPy's matmul copies both operands of a 3-D
    product C-contiguous first (one of them transposed): for K-FAC's
    split-K Gram of a convolution's patches, two passes over the largest
    matrix of a refresh step."""
    global _no_library
    if _no_library:
        return None
    try:
        gemm = default()
    except OSError:          # LibraryNotFound, or a cuBLAS without a symbol
        _no_library = True
        return None
    return _routed(gemm, cupy, a, b)


_no_library = False


@contextlib.contextmanager
def route_linear(gemm: Optional[Gemm] = None):
    """Within the block, Chainer's Linear and its gradients compute with
    ``gemm`` (default :func:`default`) for the arrays it serves (module
    docstring)."""
    import chainer
    from chainer.functions.connection import linear as chainer_linear
    gemm = gemm or default()
    classes = (chainer_linear.LinearFunction, chainer_linear.LinearGradData,
               chainer_linear.LinearGradWeight)
    originals = [c.forward for c in classes]

    def linear_forward(self, inputs):
        x, W = inputs[:2]
        if not gemm.serves(x, W) or x.ndim != 2:
            return originals[0](self, inputs)
        self._config_use_ideep = chainer.config.use_ideep
        y = gemm.matmul(x, W, transb=True)
        if len(inputs) == 3:
            y += inputs[2]
        self.retain_inputs((0, 1))
        return y,

    def grad_data_forward(self, inputs):
        W, gy = inputs
        if not gemm.serves(W, gy) or W.ndim != 2:
            return originals[1](self, inputs)
        self._config_use_ideep = chainer.config.use_ideep
        self.retain_inputs((0, 1))
        return gemm.matmul(gy, W),

    def grad_weight_forward(self, inputs):
        x, gy = inputs
        if (not gemm.serves(x, gy) or x.ndim != 2 or
                numpy.dtype(self._w_dtype) != x.dtype):
            return originals[2](self, inputs)
        self._config_use_ideep = chainer.config.use_ideep
        self.retain_inputs((0, 1))
        return gemm.matmul(gy, x, transa=True),

    for cls, forward in zip(classes, (linear_forward, grad_data_forward,
                                      grad_weight_forward)):
        cls.forward = forward
    try:
        yield gemm
    finally:
        for cls, forward in zip(classes, originals):
            cls.forward = forward


@contextlib.contextmanager
def route_matmul(cupy, gemm: Optional[Gemm] = None):
    """Within the block, ``cupy.matmul(a, b)`` computes with ``gemm``
    (default :func:`default`) where it serves the operands (both 2-D or
    both 3-D, or a 2-D matrix times a vector); other calls take CuPy's
    own.

    An operand that is the transpose of a C-contiguous matrix (``u.T``,
    or a stack's last two axes swapped) goes as that matrix with cuBLAS's
    transposition flag; any other strided operand is copied C-contiguous
    first (a copy kernel, which a graph captures). CuPy's own matmul would
    call its cuBLAS, which refuses a capturing stream."""
    gemm = gemm or default()
    original = cupy.matmul

    def matmul(a, b, *args, **kwds):
        if args or kwds:
            return original(a, b, *args, **kwds)
        if getattr(a, 'ndim', 0) == 2 and getattr(b, 'ndim', 0) == 1:
            column = _routed(gemm, cupy, a, b.reshape(-1, 1))
            if column is not None:
                return column.reshape(-1)
        routed = _routed(gemm, cupy, a, b)
        return original(a, b) if routed is None else routed

    cupy.matmul = matmul
    try:
        yield gemm
    finally:
        cupy.matmul = original


def _as_operand(cupy, array):
    """``(matrix, transposed)``: ``array`` is ``op(matrix)`` with ``matrix``
    row-major (:func:`row_major`; module docstring of
    :func:`route_matmul`), a C-contiguous copy where neither it nor its
    transpose is."""
    if row_major(array) is not None:
        return array, False
    swapped = array.swapaxes(-1, -2)
    if row_major(swapped) is not None:
        return swapped, True
    return cupy.ascontiguousarray(array), False


def _routed(gemm: Gemm, cupy, a, b, tf32: bool = False):
    """``a @ b`` by ``gemm`` (``tf32``: on TF32 Tensor Cores), or None
    where it does not serve them."""
    if not (getattr(a, 'ndim', 0) == getattr(b, 'ndim', 0) and
            a.ndim in (2, 3) and gemm.arrays.serves(a) and
            gemm.arrays.serves(b)):
        return None
    (a, transa), (b, transb) = _as_operand(cupy, a), _as_operand(cupy, b)
    if not gemm.serves(a, b):
        return None
    return gemm.matmul(a, b, transa=transa, transb=transb, tf32=tf32)


def tf32_matmul(cupy, a, b, gemm: Optional[Gemm] = None):
    """``a @ b`` of float32 device matrices (or equal stacks) on TF32
    Tensor Cores by ``gemm`` (default :func:`default`): a transposed
    operand goes with cuBLAS's flag, any other strided one is copied
    C-contiguous first (:func:`route_matmul`'s rule)."""
    product = _routed(gemm or default(), cupy, a, b, tf32=True)
    if product is None:
        raise TypeError('tf32_matmul takes float32 device arrays, both 2-D '
                        'or both 3-D (got {} {} and {} {})'.format(
                            a.shape, a.dtype, b.shape, b.dtype))
    return product


@contextlib.contextmanager
def route_step(cupy=None, gemm: Optional[Gemm] = None):
    """:func:`route_linear` and :func:`route_matmul` together: a training
    step (forward, backward, K-FAC's stage 5) whose GEMMs go through our
    cuBLAS handle."""
    if cupy is None:
        import cupy
    gemm = gemm or default()
    with route_linear(gemm), route_matmul(cupy, gemm):
        yield gemm
