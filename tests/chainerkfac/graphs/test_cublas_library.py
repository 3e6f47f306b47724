"""chainerkfac.graphs.cublas against a real cuBLAS on a CPU: every symbol
it binds resolves, its prototypes and constants agree with
``cublas_api.h``, a failed status translates (no GPU: cublasCreate fails).

Skipped, with the reason, where no libcublas is found (CI has none). To run
them on a CPU machine, put a wheel on the path, never as a dependency:
``pip download --no-deps nvidia-cublas`` (CUDA 13; ``nvidia-cublas-cu12``
for 12), unzip its ``nvidia/`` into /tmp/cublas and
``PYTHONPATH=/tmp/cublas pytest tests/chainerkfac/graphs`` (cuBLAS is
found in ``nvidia/cu13/lib``, its header in ``nvidia/cu13/include``).
"""
import ctypes
import os
import re

import pytest

from chainerkfac.graphs import cublas


def _load():
    """The cuBLAS found here, or why none is. Only "none can be opened"
    skips: a library that opens but lacks a function the binding needs
    raises here, so the module fails to import and the run fails."""
    try:
        return cublas.load(), None
    except cublas.LibraryNotFound as error:
        return None, str(error)


LIB, WHY_NOT = _load()
pytestmark = pytest.mark.skipif(
    LIB is None, reason='no cuBLAS library here ({}); see the module '
    'docstring to run these'.format(WHY_NOT))


def _header():
    if LIB is None:
        return None
    path = os.path.join(os.path.dirname(os.path.dirname(LIB.path)),
                        'include', 'cublas_api.h')
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        text = f.read()
    text = re.sub(r'/\*.*?\*/', ' ', text, flags=re.S)
    return re.sub(r'//[^\n]*', ' ', text)


HEADER = _header()
needs_header = pytest.mark.skipif(
    HEADER is None, reason='no cublas_api.h beside the library (the '
    'nvidia-cublas wheels ship it in nvidia/cu13/include)')


def test_every_symbol_resolves():
    assert set(LIB._functions) == set(cublas.PROTOTYPES)
    for name, function in LIB._functions.items():
        assert isinstance(function, ctypes._CFuncPtr), name


def test_create_without_a_gpu_translates_the_status():
    try:
        handle = LIB.create()
    except cublas.CublasError as error:
        assert error.status == cublas.CUBLAS_STATUS_NOT_INITIALIZED
        assert 'in cublasCreate_v2' in str(error)
        assert str(error).startswith('cuBLAS Error: ')
    else:
        LIB.call('cublasDestroy_v2', handle)
        pytest.skip('a GPU is here: cublasCreate succeeds')


@needs_header
def test_prototypes_match_the_header():
    def kind(declaration):
        declaration = ' '.join(declaration.replace('const', ' ').split())
        if '*' in declaration or declaration.split()[0] in (
                'cublasHandle_t', 'cudaStream_t'):
            return 'pointer'
        base = ' '.join(declaration.split()[:-1])
        if base in ('int', 'cublasOperation_t', 'cublasStatus_t',
                    'cublasMath_t', 'cudaDataType', 'cudaDataType_t',
                    'cublasComputeType_t', 'cublasGemmAlgo_t'):
            return ctypes.c_int     # enums: int-sized
        return {'size_t': ctypes.c_size_t,
                'long long int': ctypes.c_longlong}[base]

    def ours(argtype):
        if argtype in (ctypes.c_void_p, ctypes.c_char_p) or \
                issubclass(argtype, ctypes._Pointer):
            return 'pointer'
        return argtype

    for name, prototype in cublas.PROTOTYPES.items():
        # CUDA 12's declarations start with CUBLASAPI, CUDA 13's do not
        match = re.search(r'(?:CUBLASAPI\s+)?\b([\w \t\*]+?)\s*'
                          r'CUBLASWINAPI\s+' + name + r'\s*\(([^)]*)\)',
                          HEADER)
        assert match, name
        result = match.group(1).strip()
        expected = {'cublasStatus_t': ctypes.c_int,
                    'const char*': ctypes.c_char_p}[result]
        assert prototype.restype is expected, name
        params = [p for p in match.group(2).split(',') if p.strip()]
        assert len(params) == len(prototype.argtypes), name
        for i, (param, argtype) in enumerate(zip(params,
                                                 prototype.argtypes)):
            assert ours(argtype) == kind(param), (name, i, param)


@needs_header
def test_constants_match_the_header():
    for name in ('CUBLAS_STATUS_SUCCESS', 'CUBLAS_STATUS_NOT_INITIALIZED',
                 'CUBLAS_OP_N', 'CUBLAS_OP_T', 'CUBLAS_DEFAULT_MATH',
                 'CUBLAS_PEDANTIC_MATH', 'CUBLAS_TF32_TENSOR_OP_MATH',
                 'CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION',
                 'CUBLAS_COMPUTE_32F', 'CUBLAS_GEMM_DEFAULT'):
        value = re.search(r'\b' + name + r'\s*=\s*(-?\d+)', HEADER)
        assert value and int(value.group(1)) == getattr(cublas, name), name
