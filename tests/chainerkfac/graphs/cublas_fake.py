"""A cuBLAS stand-in that computes on the CPU: the GEMMs read and write
memory through their pointers with cuBLAS's column-major semantics, so the
row-major mapping of :mod:`chainerkfac.graphs.gemm` is checked against
NumPy; every call is recorded. And a NumPy stand-in for
:class:`chainerkfac.graphs.gemm.CupyArrays`."""
import ctypes

import numpy

from chainerkfac import linalg
from chainerkfac.graphs import cublas


def _memory(ptr, count, dtype):
    buffer = (ctypes.c_byte * (count * dtype.itemsize)).from_address(ptr)
    return numpy.frombuffer(buffer, dtype=dtype)


def _col_major(ptr, rows, cols, ld, dtype, offset=0):
    """The ``rows x cols`` column-major matrix at ``ptr`` with leading
    dimension ``ld``: element (i, j) at ``i + j·ld``."""
    flat = _memory(ptr, offset + ld * (cols - 1) + rows, dtype)[offset:]
    return numpy.lib.stride_tricks.as_strided(
        flat, (rows, cols), (dtype.itemsize, ld * dtype.itemsize))


class FakeCublas:
    def __init__(self):
        self.calls = []
        self.live = set()
        self._next = 0x100
        self.math = {}      # handle -> cublasMath_t (TF32: rounded operands)

    def library(self):
        functions = {name: self._function(name)
                     for name in cublas.PROTOTYPES}
        return cublas.Library(functions, 'fake libcublas.so.13')

    def named(self, name):
        return [args for n, args in self.calls if n == name]

    def _function(self, name):
        prototype = cublas.PROTOTYPES[name]

        def function(*args):
            assert len(args) == len(prototype.argtypes), name
            for argtype, arg in zip(prototype.argtypes, args):
                argtype.from_param(arg)
            return self._run(name, args)
        return function

    def _run(self, name, args):
        if name == 'cublasGetStatusString':
            return b'CUBLAS_STATUS_' + str(args[0]).encode()
        self.calls.append((name, args))
        if name == 'cublasCreate_v2':
            self._next += 0x10
            args[0]._obj.value = self._next
            self.live.add(self._next)
        elif name == 'cublasDestroy_v2':
            self.live.remove(args[0])
        elif name == 'cublasSetMathMode':
            self.math[args[0]] = args[1]
        elif 'gemm' in name.lower():
            self._gemm(name, args)
        return 0

    def _gemm(self, name, args):
        if name.startswith('cublasGemm'):      # Ex: fp16 in and out
            return self._gemm_ex(name, args)
        dtype = numpy.dtype('f' if name.startswith('cublasS') else 'd')
        ctype = ctypes.c_float if dtype.char == 'f' else ctypes.c_double
        strided = name.endswith('StridedBatched')
        handle, ta, tb, m, n, k, alpha = args[:7]
        tf32 = (dtype.char == 'f' and self.math.get(handle) ==
                cublas.CUBLAS_TF32_TENSOR_OP_MATH)
        rest = list(args[7:])
        if strided:
            a, lda, sa, b, ldb, sb, beta, c, ldc, sc, count = rest
        else:
            (a, lda, b, ldb, beta, c, ldc), sa, sb, sc, count = \
                rest, 0, 0, 0, 1
        _check_arguments(name, ta, tb, m, n, k, lda, ldb, ldc, sc, count)
        if not isinstance(alpha, int):
            assert type(alpha._obj) is ctype and type(beta._obj) is ctype, \
                '{}: alpha and beta must point to {}'.format(name, ctype)
        alpha = ctypes.cast(alpha, ctypes.POINTER(ctype)).contents.value \
            if isinstance(alpha, int) else alpha._obj.value
        beta = beta._obj.value
        for opa, opb, C in _operands(dtype, ta, tb, m, n, k, (a, lda, sa),
                                     (b, ldb, sb), (c, ldc, sc), count):
            if tf32:    # Tensor Cores: operands with a 10-bit mantissa
                opa, opb = linalg.round_to_tf32(opa), linalg.round_to_tf32(opb)
            C[...] = alpha * opa.dot(opb) + (beta * C if beta else 0)

    def _gemm_ex(self, name, args):
        """cublasGemmEx / cublasGemmStridedBatchedEx with fp16 operands
        and result and fp32 accumulation (what the library asks): the
        fp16 values multiplied in fp32, the result rounded to fp16."""
        handle, ta, tb, m, n, k, alpha = args[:7]
        rest = list(args[7:])
        if name.endswith('StridedBatchedEx'):
            (a, ta_, lda, sa, b, tb_, ldb, sb, beta, c, tc, ldc, sc, count,
             compute, algo) = rest
        else:
            (a, ta_, lda, b, tb_, ldb, beta, c, tc, ldc, compute, algo) = rest
            sa = sb = sc = 0
            count = 1
        assert ta_ == tb_ == tc == cublas.CUDA_R_16F
        assert compute == cublas.CUBLAS_COMPUTE_32F
        _check_arguments(name, ta, tb, m, n, k, lda, ldb, ldc, sc, count)
        # the scalars are of the compute type (fp32), not the data's
        assert type(alpha._obj) is ctypes.c_float and \
            type(beta._obj) is ctypes.c_float, name
        alpha = numpy.float32(alpha._obj.value)
        beta = numpy.float32(beta._obj.value)
        for opa, opb, C in _operands(numpy.dtype(numpy.float16), ta, tb, m, n,
                                     k, (a, lda, sa), (b, ldb, sb),
                                     (c, ldc, sc), count):
            product = alpha * opa.astype(numpy.float32).dot(
                opb.astype(numpy.float32))
            if beta:
                product += beta * C.astype(numpy.float32)
            C[...] = product.astype(numpy.float16)


INT_MAX = 2 ** 31 - 1


def _check_arguments(name, ta, tb, m, n, k, lda, ldb, ldc, stride_c,
                     count):
    """What cuBLAS refuses with CUBLAS_STATUS_INVALID_VALUE (its API
    reference): sizes and leading dimensions out of ``int`` (ctypes would
    truncate them silently), a leading dimension shorter than the
    column-major rows of its operand (``lda ≥ max(1, m)`` for an
    untransposed A, ``max(1, k)`` for a transposed one; alike for B and
    C), and a batch whose results overlap."""
    values = dict(m=m, n=n, k=k, lda=lda, ldb=ldb, ldc=ldc, batch=count)
    for label, value in values.items():
        assert 0 <= value <= INT_MAX, '{}: {}={} out of int'.format(
            name, label, value)
    rows = dict(lda=k if ta else m, ldb=n if tb else k, ldc=m)
    for label, least in rows.items():
        assert values[label] >= max(1, least), '{}: {}={} < max(1, {})'.format(
            name, label, values[label], least)
    assert count <= 1 or stride_c >= ldc * n, \
        '{}: results overlap (strideC {} < ldc·n {})'.format(
            name, stride_c, ldc * n)


def _operands(dtype, ta, tb, m, n, k, a, b, c, count):
    """Per matrix of a (strided batched) GEMM, ``(op(A), op(B), C)`` read
    from memory as cuBLAS reads it: ``a``, ``b``, ``c`` are ``(pointer,
    leading dimension, stride)``, column-major."""
    for i in range(count):
        A = _col_major(a[0], *((k, m) if ta else (m, k)), a[1], dtype,
                       i * a[2])
        B = _col_major(b[0], *((n, k) if tb else (k, n)), b[1], dtype,
                       i * b[2])
        yield (A.T if ta else A), (B.T if tb else B), _col_major(
            c[0], m, n, c[1], dtype, i * c[2])


class NumpyArrays:
    """:class:`chainerkfac.graphs.gemm.CupyArrays` over NumPy."""

    def __init__(self):
        self.current_stream = 0x5000
        self.allocations = []

    def serves(self, array):
        return isinstance(array, numpy.ndarray)

    def empty(self, shape, dtype):
        return numpy.full(shape, numpy.nan, dtype)

    def pointer(self, array):
        return array.ctypes.data

    def alloc(self, nbytes):
        self.allocations.append(nbytes)
        return 0x9000 + len(self.allocations), None

    def device_id(self):
        return 0

    def stream(self):
        return self.current_stream
