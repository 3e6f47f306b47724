"""A cuBLAS handle of our own, bound with ctypes, for GEMMs that a CUDA
graph may capture.

CuPy 14 refuses cuBLAS while a stream is being captured
(``NotImplementedError: calling cuBLAS API during stream capture is
currently unsupported``, raised by its ``setStream``), so Chainer's
``F.linear`` and K-FAC's preconditioning GEMMs cannot be captured through
CuPy. cuBLAS itself can be: a handle set to the capturing stream with
``cublasSetStream_v2`` and given a workspace of its own with
``cublasSetWorkspace_v2`` (no allocation inside cuBLAS during capture)
captures ``cublas<t>gemm`` (probed on an H100 with CuPy 14.2 and
``libcublas.so.13``: the replay with changed inputs matched
``cupy.matmul`` exactly). This module binds those few functions, as
:mod:`chainerkfac.cudnn.library` binds cuDNN's; :mod:`chainerkfac.graphs.
gemm` uses them.

Which library (:func:`candidates`): the ``libcublas`` already mapped into
this process (CuPy's: one cuBLAS build per process;
:func:`chainerkfac.graphs.gemm.default` makes CuPy load it first), then the
one NVIDIA's ``cuda-pathfinder`` finds (what CuPy 14 loads from the CUDA
wheels), then the wheels' folders — ``nvidia/cu13/lib`` of CUDA 13's
``nvidia-cublas``, ``nvidia/cublas/lib`` of ``nvidia-cublas-cu12`` — then
the system loader path, each soname of :data:`SONAMES` in turn.
"""
import ctypes
import importlib.util
import os
from typing import Callable, Dict, Iterator, List, Mapping, NamedTuple

from chainerkfac._binding import (LibraryNotFound, bind_prototypes,
                                  mapped_files, pathfinder_path)

#: Newest first: CUDA 13's cuBLAS, then CUDA 12's.
SONAMES = ('libcublas.so.13', 'libcublas.so.12')

CUBLAS_STATUS_SUCCESS = 0
CUBLAS_STATUS_NOT_INITIALIZED = 1
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
#: cublasMath_t: the default (at least the operands' precision: no TF32
#: for float32), the pedantic (the requested precision in every phase,
#: for robustness studies), and single precision on TF32 Tensor Cores.
CUBLAS_DEFAULT_MATH = 0
CUBLAS_PEDANTIC_MATH = 2
CUBLAS_TF32_TENSOR_OP_MATH = 3
#: A flag of cublasMath_t: a mixed-precision GEMM's reductions (split-K's
#: partial sums) in the accumulator's type, not the lower-precision
#: output's (fp16 factors are accumulated in fp32 throughout).
CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION = 16

_p = ctypes.c_void_p
_i = ctypes.c_int
_ll = ctypes.c_longlong


class Prototype(NamedTuple):
    argtypes: tuple
    restype: object = ctypes.c_int   # cublasStatus_t


def _gemm(strided: bool) -> Prototype:
    # handle, transa, transb, m, n, k, alpha, A, lda, [strideA], B, ldb,
    # [strideB], beta, C, ldc, [strideC, batchCount]
    a = (_p, _i) + ((_ll,) if strided else ())
    tail = (_p, _p, _i) + ((_ll, _i) if strided else ())
    return Prototype((_p, _i, _i, _i, _i, _i, _p) + a + a + tail)


#: The mixed-precision GEMM's types (``cublasGemmEx``): fp16 operands and
#: result (``cudaDataType_t``), fp32 accumulation (``cublasComputeType_t``),
#: cuBLAS's choice of algorithm.
CUDA_R_16F = 2
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1


def _gemm_ex(strided: bool) -> Prototype:
    # handle, transa, transb, m, n, k, alpha, A, Atype, lda, [strideA], B,
    # Btype, ldb, [strideB], beta, C, Ctype, ldc, [strideC, batchCount],
    # computeType, algo
    a = (_p, _i, _i) + ((_ll,) if strided else ())
    tail = (_p, _p, _i, _i) + ((_ll, _i) if strided else ()) + (_i, _i)
    return Prototype((_p, _i, _i, _i, _i, _i, _p) + a + a + tail)


#: C name -> prototype, as in cuBLAS's ``cublas_api.h`` (12.x and 13.x).
PROTOTYPES: Dict[str, Prototype] = {
    'cublasCreate_v2': Prototype((ctypes.POINTER(ctypes.c_void_p),)),
    'cublasDestroy_v2': Prototype((_p,)),
    'cublasGetVersion_v2': Prototype((_p, ctypes.POINTER(ctypes.c_int))),
    'cublasGetStatusString': Prototype((_i,), ctypes.c_char_p),
    'cublasSetStream_v2': Prototype((_p, _p)),
    'cublasSetWorkspace_v2': Prototype((_p, _p, ctypes.c_size_t)),
    'cublasSetMathMode': Prototype((_p, _i)),
    'cublasSgemm_v2': _gemm(False),
    'cublasDgemm_v2': _gemm(False),
    'cublasSgemmStridedBatched': _gemm(True),
    'cublasDgemmStridedBatched': _gemm(True),
    'cublasGemmEx': _gemm_ex(False),
    'cublasGemmStridedBatchedEx': _gemm_ex(True),
}


class CublasError(RuntimeError):
    """A cuBLAS call returned a status other than success."""

    def __init__(self, status: int, message: str):
        super().__init__(status, message)
        self.status = status
        self.message = message

    def __str__(self):
        return 'cuBLAS Error: ' + self.message


class Library:
    """The bound functions of one cuBLAS.

    Parameters
    ----------
    functions : mapping
        C name -> callable for every name of :data:`PROTOTYPES` (ctypes
        functions, or the tests' stand-ins).
    path : str
    """

    def __init__(self, functions: Mapping[str, Callable], path: str):
        missing = sorted(set(PROTOTYPES) - set(functions))
        if missing:
            raise OSError('{} does not export {}'.format(
                path, ', '.join(missing)))
        self._functions = dict(functions)
        self.path = path

    def call(self, name: str, *args) -> None:
        """Call ``name``; raise :class:`CublasError` on a failed status."""
        status = self._functions[name](*args)
        if status != CUBLAS_STATUS_SUCCESS:
            raise CublasError(status, '{} in {}'.format(
                self.status_string(status), name))

    def status_string(self, status: int) -> str:
        text = self._functions['cublasGetStatusString'](status)
        return text.decode() if isinstance(text, bytes) else str(text)

    def create(self) -> int:
        """A new handle (on the current device)."""
        out = ctypes.c_void_p()
        self.call('cublasCreate_v2', ctypes.byref(out))
        return out.value

    def version(self, handle: int) -> int:
        out = ctypes.c_int()
        self.call('cublasGetVersion_v2', handle, ctypes.byref(out))
        return out.value


def _loaded() -> List[str]:
    """The libcublas files mapped into this process (CuPy's)."""
    return mapped_files(SONAMES)


def _pathfinder() -> List[str]:
    """The cuBLAS that NVIDIA's ``cuda-pathfinder`` finds, if any."""
    path = pathfinder_path('cublas')
    return [] if path is None else [path]


#: The library folders of NVIDIA's cuBLAS wheels, by package: CUDA 13's
#: ``nvidia-cublas`` installs into ``nvidia/cu13``, CUDA 12's
#: ``nvidia-cublas-cu12`` into ``nvidia/cublas``.
WHEEL_PACKAGES = ('nvidia.cu13', 'nvidia.cublas')


def wheel_folders() -> List[str]:
    """The ``lib`` folders of the cuBLAS wheels on ``sys.path``
    (:data:`WHEEL_PACKAGES`; namespace packages, found without importing
    them)."""
    folders = []
    for package in WHEEL_PACKAGES:
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        if spec is not None:
            folders += [os.path.join(p, 'lib')
                        for p in (spec.submodule_search_locations or ())]
    return folders


def candidates() -> Iterator[str]:
    """Paths (or sonames for the loader) to try, in order."""
    yield from _loaded()
    yield from _pathfinder()
    for folder in wheel_folders():
        for name in SONAMES:
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                yield path
    yield from SONAMES


def bind(cdll: ctypes.CDLL, path: str) -> Library:
    """Bind every function of :data:`PROTOTYPES` from an open library
    (:class:`Library` names those it lacks)."""
    return Library(bind_prototypes(cdll, PROTOTYPES), path)


def load(paths=None) -> Library:
    """Open and bind the first cuBLAS of ``paths`` (default
    :func:`candidates`).

    Raises
    ------
    LibraryNotFound
        None loads; the message says what was tried.
    OSError
        One loads but does not export every function of
        :data:`PROTOTYPES`; the message names them.
    """
    tried = []
    for path in candidates() if paths is None else paths:
        try:
            cdll = ctypes.CDLL(path)
        except OSError as error:
            tried.append(str(error))
            continue
        return bind(cdll, path)
    raise LibraryNotFound('no cuBLAS found: {}'.format('; '.join(tried)))
