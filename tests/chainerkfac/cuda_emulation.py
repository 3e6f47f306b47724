"""A CPU stand-in for the few CuPy, cuSOLVER and cuBLAS calls of
:mod:`chainerkfac.linalg_cuda`, so that its control flow and conventions
(one status row per factor, devInfo pointers, streams and handles, the retry
rounds, column-major triangles) are tested on machines without a GPU.

Arrays are NumPy arrays whose ``.data.ptr`` is their real address, and the
cuSOLVER stand-ins read and write memory through those pointers with
cuSOLVER's column-major semantics: ``uplo=0`` (lower) is the lower triangle
of the column-major matrix. Only what linalg_cuda calls is emulated.
"""
import contextlib
import ctypes
import types

import numpy

from tests import cuda_cpu


class Array(numpy.ndarray):
    """A NumPy array with CuPy's ``.data.ptr`` and ``.get()``."""

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.ctypes.data)

    def get(self):
        return numpy.array(self)


def array(a, dtype=None):
    return numpy.ascontiguousarray(a, dtype).view(Array)


def _memory(ptr, shape, dtype):
    dtype = numpy.dtype(dtype)
    size = int(numpy.prod(shape)) * dtype.itemsize
    buffer = (ctypes.c_byte * size).from_address(ptr)
    return numpy.frombuffer(buffer, dtype=dtype).reshape(shape)


def _column_major(ptr, n, dtype):
    """The n×n column-major matrix at ``ptr``: (i, j) is memory[i + j·n]."""
    return _memory(ptr, (n, n), dtype).T


class Stream(object):
    _count = 0

    def __init__(self, non_blocking=False):
        Stream._count += 1
        self.ptr = 1000 + Stream._count

    def record(self, event=None):
        return object()

    def wait_event(self, event):
        pass

    def __enter__(self):
        _STACK.append(self)
        return self

    def __exit__(self, *exc):
        _STACK.pop()


_STACK = [Stream()]

#: (function, handle, stream pointer) of every cuSOLVER stand-in call.
CALLS = []


def _nonfinite(x):
    return int((~numpy.isfinite(x)).sum())


def _kernel(in_params, out_params, body, name):
    """The three ElementwiseKernels of linalg_cuda, in NumPy."""
    def damp(m, d, n, slot, out, status):
        x = numpy.asarray(m).astype(out.dtype)
        status.reshape(-1)[slot] += _nonfinite(x)
        out[...] = x
        out[numpy.arange(n), numpy.arange(n)] += d

    def mirror(a, n, slot, out, status):
        upper = numpy.triu(numpy.asarray(a))
        out[...] = upper + numpy.triu(upper, 1).T
        status.reshape(-1)[slot] += _nonfinite(out)

    def diagonal(v, d, slot, out, status):
        flat = status.reshape(-1)
        x = numpy.asarray(v).astype(out.dtype)
        flat[slot] += _nonfinite(x)
        shifted = x + d
        flat[slot + 1] += int((~(shifted > 0)).sum())
        with numpy.errstate(all='ignore'):
            out[...] = out.dtype.type(1) / shifted
        flat[slot + 3] += _nonfinite(out)

    def batch_info(info, rows, status):
        flat = status.reshape(-1)
        for value, row in zip(numpy.asarray(info), numpy.asarray(rows)):
            flat[row * 4 + 1] += int(value != 0)

    return {'chainerkfac_damp': damp, 'chainerkfac_mirror_upper': mirror,
            'chainerkfac_diagonal_inverse': diagonal,
            'chainerkfac_batch_info': batch_info}[name]


def _cusolver_functions(dtype):
    def potrf_buffer_size(handle, uplo, n, a, lda):
        return 5

    def potrf(handle, uplo, n, a, lda, work, lwork, info):
        CALLS.append(('potrf', handle, _STACK[-1].ptr))
        assert uplo == 0 and lda == n and lwork >= 5
        matrix = _column_major(a, n, dtype)
        lower = numpy.tril(matrix).astype(numpy.float64)
        try:
            factor = numpy.linalg.cholesky(lower + numpy.tril(lower, -1).T)
        except numpy.linalg.LinAlgError:
            _memory(info, (1,), numpy.int32)[0] = 1
            return
        matrix[numpy.tril_indices(n)] = factor[numpy.tril_indices(n)]
        _memory(info, (1,), numpy.int32)[0] = 0

    def potrs(handle, uplo, n, nrhs, a, lda, b, ldb, info):
        CALLS.append(('potrs', handle, _STACK[-1].ptr))
        factor = numpy.tril(_column_major(a, n, dtype)).astype(numpy.float64)
        rhs = _column_major(b, n, dtype)
        rhs[...] = numpy.linalg.solve(factor.dot(factor.T), rhs)
        _memory(info, (1,), numpy.int32)[0] = 0

    def potri_buffer_size(handle, uplo, n, a, lda, lwork):
        lwork._obj.value = 9
        return 0

    def potri(handle, uplo, n, a, lda, work, lwork, info):
        CALLS.append(('potri', handle, _STACK[-1].ptr))
        assert uplo == 0 and lda == n and lwork >= 9
        matrix = _column_major(a, n, dtype)
        factor = numpy.tril(matrix).astype(numpy.float64)
        inverse = numpy.linalg.inv(factor.dot(factor.T))
        matrix[numpy.tril_indices(n)] = inverse[numpy.tril_indices(n)]
        matrix[numpy.triu_indices(n, 1)] = -999.0   # not referenced
        _memory(info, (1,), numpy.int32)[0] = 0
        return 0

    def potrf_batched(handle, uplo, n, pointers, lda, info, batch):
        CALLS.append(('potrfBatched', handle, _STACK[-1].ptr))
        assert uplo == 0 and lda == n
        infos = _memory(info, (batch,), numpy.int32)
        for i, ptr in enumerate(_memory(pointers, (batch,), numpy.uint64)):
            matrix = _column_major(int(ptr), n, dtype)
            lower = numpy.tril(matrix).astype(numpy.float64)
            matrix[numpy.triu_indices(n, 1)] = -777.0   # its workspace
            try:
                factor = numpy.linalg.cholesky(
                    lower + numpy.tril(lower, -1).T)
            except numpy.linalg.LinAlgError:
                # cuSOLVER stops where it fails, leaving a triangle that
                # solves to finite garbage: only the info tells
                infos[i] = 1
                continue
            infos[i] = 0
            matrix[numpy.tril_indices(n)] = factor[numpy.tril_indices(n)]

    return ((potrf_buffer_size, potrf, potrs, potrf_batched),
            (potri_buffer_size, potri))


def _cublas_functions(dtype):
    def trsm_batched(handle, side, uplo, trans, diag, m, n, alpha, a, lda,
                     b, ldb, batch):
        """op(L) X = alpha B for column-major lower L (m x m), B (m x n),
        in place; L's other triangle is not read."""
        CALLS.append(('trsmBatched', handle, _STACK[-1].ptr))
        assert (side, uplo, diag) == (0, 0, 0) and lda == m and ldb == m
        scale = _memory(alpha, (1,), dtype)[0]
        a_pointers = _memory(a, (batch,), numpy.uint64)
        b_pointers = _memory(b, (batch,), numpy.uint64)
        for a_ptr, b_ptr in zip(a_pointers, b_pointers):
            lower = numpy.tril(_column_major(int(a_ptr), m, dtype)).astype(
                numpy.float64)
            rhs = _memory(int(b_ptr), (n, m), dtype).T
            rhs[...] = _triangular_solve(lower, scale * rhs.astype(
                numpy.float64), transpose=trans == 1)

    return trsm_batched


def _triangular_solve(lower, rhs, transpose):
    """``op(lower) X = rhs`` by substitution, as trsm computes it: a zero
    on the diagonal gives Inf / NaN, not an error."""
    n = lower.shape[0]
    out = numpy.array(rhs)
    order = range(n - 1, -1, -1) if transpose else range(n)
    with numpy.errstate(all='ignore'):
        for i in order:
            if transpose:   # Lᵀ is upper: row i of Lᵀ is column i of L
                known = lower[i + 1:, i].dot(out[i + 1:])
            else:
                known = lower[i, :i].dot(out[:i])
            out[i] = (out[i] - known) / lower[i, i]
    return out


def raw_potri():
    """Stand-in for ``linalg_cuda._raw_potri()``."""
    functions = {}
    for prefix, dtype in (('s', numpy.float32), ('d', numpy.float64)):
        _, (size, potri) = _cusolver_functions(dtype)
        functions[prefix + 'potri_bufferSize'] = size
        functions[prefix + 'potri'] = potri
    return functions


def modules():
    """``{name: module}`` for ``cupy`` and ``cupy_backends.cuda.libs
    .cusolver``, to put in ``sys.modules``."""
    cupy = types.ModuleType('cupy')
    cupy.zeros = lambda shape, dtype=float: array(numpy.zeros(shape, dtype))
    cupy.empty = lambda shape, dtype=float: array(
        numpy.full(shape, numpy.nan, dtype))
    cupy.eye = lambda n, dtype=float: array(numpy.eye(n, dtype=dtype))
    cupy.arange = lambda n, dtype=None: array(numpy.arange(n, dtype=dtype))
    cupy.asarray = array
    cupy.ascontiguousarray = array
    # linalg_cuda's kernel bodies themselves where a C++ compiler is here
    # (tests/cuda_cpu.py), else their NumPy re-tellings
    cupy.ElementwiseKernel = (_kernel if cuda_cpu.unavailable()
                              else cuda_cpu.ElementwiseKernel)
    cupy.cuda = types.SimpleNamespace(
        get_current_stream=lambda: _STACK[-1], Stream=Stream,
        Device=lambda device_id=0: contextlib.nullcontext(),
        runtime=types.SimpleNamespace(getDevice=lambda: 0),
        device=types.SimpleNamespace(get_cusolver_handle=lambda: 7))
    cusolver = types.ModuleType('cupy_backends.cuda.libs.cusolver')
    handles = iter(range(100, 10 ** 6))
    cusolver.create = lambda: next(handles)
    cusolver.setStream = lambda handle, stream: None
    cublas = types.ModuleType('cupy_backends.cuda.libs.cublas')
    cublas.create = lambda: next(handles)
    cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_T = 0, 1
    cublas.CUBLAS_SIDE_LEFT, cublas.CUBLAS_DIAG_NON_UNIT = 0, 0
    for prefix, dtype in (('s', numpy.float32), ('d', numpy.float64)):
        (size, potrf, potrs, batched), _ = _cusolver_functions(dtype)
        setattr(cusolver, prefix + 'potrf_bufferSize', size)
        setattr(cusolver, prefix + 'potrf', potrf)
        setattr(cusolver, prefix + 'potrs', potrs)
        setattr(cusolver, prefix + 'potrfBatched', batched)
        setattr(cublas, prefix + 'trsmBatched', _cublas_functions(dtype))
    libs = types.ModuleType('cupy_backends.cuda.libs')
    libs.cusolver = cusolver
    libs.cublas = cublas
    return {'cupy': cupy, 'cupy_backends': types.ModuleType('cupy_backends'),
            'cupy_backends.cuda': types.ModuleType('cupy_backends.cuda'),
            'cupy_backends.cuda.libs': libs,
            'cupy_backends.cuda.libs.cusolver': cusolver,
            'cupy_backends.cuda.libs.cublas': cublas}
