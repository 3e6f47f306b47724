"""chainerkfac.cudnn against a real cuDNN 9 library on a CPU: every symbol
it binds resolves, its prototypes, structure layout and constants agree
with cuDNN's headers, errors translate, and the descriptor calls work
(they need no GPU).

Skipped, with the reason, where no cuDNN 9 is found (CI has none). To run
them on a CPU machine, put a wheel on the path, never as a dependency:
``pip install --no-deps --target /tmp/cudnn9 nvidia-cudnn-cu13`` and
``PYTHONPATH=/tmp/cudnn9 pytest tests/chainerkfac/test_cudnn_library.py``.
"""
import ctypes
import os
import re
import shutil
import subprocess

import numpy
import pytest

from chainerkfac.cudnn import constants as C
from chainerkfac.cudnn import library
from chainerkfac.cudnn.descriptors import Descriptors


def _load():
    """The cuDNN found here, or why none is. Only "none can be opened"
    skips: a library that opens but lacks a function the backend binds
    raises here, so the module fails to import and the run fails."""
    try:
        return library.load(), None
    except library.LibraryNotFound as error:
        return None, str(error)


LIB, WHY_NOT = _load()
pytestmark = pytest.mark.skipif(
    LIB is None, reason='no cuDNN 9 library here ({}); see the module '
    'docstring to run these'.format(WHY_NOT))


def _include_folder():
    if LIB is None:
        return None
    folder = os.path.join(os.path.dirname(os.path.dirname(LIB.path)),
                          'include')
    return folder if os.path.isfile(os.path.join(folder, 'cudnn_cnn.h')) \
        else None


INCLUDE = _include_folder()
HEADERS = ('cudnn_graph.h', 'cudnn_ops.h', 'cudnn_cnn.h', 'cudnn_adv.h')
needs_headers = pytest.mark.skipif(
    INCLUDE is None, reason="no cuDNN headers beside the library (the "
    "nvidia-cudnn wheels ship them in nvidia/cudnn/include)")


def _header_text():
    text = ''
    for name in HEADERS:
        with open(os.path.join(INCLUDE, name)) as f:
            text += f.read()
    text = re.sub(r'/\*.*?\*/', ' ', text, flags=re.S)
    return re.sub(r'//[^\n]*', ' ', text)


def test_every_symbol_resolves():
    assert set(LIB._functions) == set(library.PROTOTYPES)
    for name, function in LIB._functions.items():
        assert isinstance(function, ctypes._CFuncPtr), name


def test_version():
    version = LIB.version()
    assert version // 10000 == library.MAJOR
    assert LIB.cudart_version() >= 12000


def test_error_translation_without_a_gpu():
    try:
        handle = LIB.create('')
    except library.CuDNNError as error:
        assert error.status == 1001
        assert str(error).startswith(
            'cuDNN Error: CUDNN_STATUS_NOT_INITIALIZED in cudnnCreate')
    else:
        LIB.destroy('', handle)
        pytest.skip('a GPU is here: cudnnCreate succeeds')


def test_error_strings():
    assert LIB.error_string(0) == 'CUDNN_STATUS_SUCCESS'
    assert LIB.error_string(2000) == 'CUDNN_STATUS_BAD_PARAM'


def test_descriptors_for_resnet50_shapes():
    """The host-side descriptor calls with the backend's arguments."""
    with Descriptors(LIB) as d:
        for dtype in (numpy.float16, numpy.float32, numpy.float64):
            x = d.tensor((32, 3, 224, 224), dtype)
            d.tensor((32, 64, 112, 112), dtype)
            d.tensor((1, 64, 1, 1), dtype)
            d.tensor((2, 4, 5, 6, 7), dtype)
            d.filter((64, 3, 7, 7), dtype)
            d.filter((3, 4, 2, 2, 2), dtype)
            d.filter((64, 8, 3, 3), dtype)
            for math in (C.CUDNN_DEFAULT_MATH, C.CUDNN_FMA_MATH,
                         C.CUDNN_TENSOR_OP_MATH):
                d.convolution((3, 3), (2, 2), (1, 1), 1, dtype, math)
                d.convolution((1, 1), (1, 1), (2, 2), 8, dtype, math)
                d.convolution((0, 1, 1), (2, 1, 1), (1, 1, 2), 1, dtype,
                              math)
            d.pooling((3, 3), (2, 2), (1, 1), C.CUDNN_POOLING_MAX)
            d.pooling((2, 2, 2), (2, 2, 2), (0, 0, 0),
                      C.CUDNN_POOLING_AVERAGE_COUNT_EXCLUDE_PADDING)
            d.activation(C.CUDNN_ACTIVATION_CLIPPED_RELU, 6.0)
            d.as_4d(numpy.zeros((8, 12), dtype))
            for mode in (C.CUDNN_BATCHNORM_SPATIAL,
                         C.CUDNN_BATCHNORM_SPATIAL_PERSISTENT,
                         C.CUDNN_BATCHNORM_PER_ACTIVATION):
                _, param = d.derived_bn(x, mode)
                assert param == (numpy.float32 if dtype == numpy.float16
                                 else dtype)
        with pytest.raises(library.CuDNNError, match='BAD_PARAM'):
            d.tensor_4d(0, -1, 1, 1, numpy.float32)


@needs_headers
def test_prototypes_match_the_headers():
    text = _header_text()
    pointer_types = set(re.findall(
        r'typedef\s+struct\s+\w+\s*\*\s*(\w+)', text)) | {'cudaStream_t'}
    enum_types = set(re.findall(r'typedef\s+enum\s*\{[^}]*\}\s*(\w+)', text))

    def ctype_of(declaration):
        declaration = ' '.join(declaration.replace('const', ' ').split())
        if '*' in declaration or '[' in declaration:
            return 'pointer'
        words = declaration.split()
        base = ' '.join(words[:-1]) if len(words) > 1 else words[0]
        if base in pointer_types:
            return 'pointer'
        if base in enum_types or base == 'int':
            return ctypes.c_int
        return {'size_t': ctypes.c_size_t, 'double': ctypes.c_double,
                'float': ctypes.c_float,
                'unsigned long long': ctypes.c_ulonglong}[base]

    def ours(argtype):
        if argtype in (ctypes.c_void_p, ctypes.c_char_p) or \
                issubclass(argtype, ctypes._Pointer):
            return 'pointer'
        return argtype

    for name, prototype in library.PROTOTYPES.items():
        match = re.search(r'([\w\s\*]+?)\s*CUDNNWINAPI\s+' + name +
                          r'\s*\(([^)]*)\)', text)
        assert match, name
        result = match.group(1).split()[-1] if '*' not in match.group(1) \
            else 'char*'
        expected_result = {'cudnnStatus_t': ctypes.c_int,
                           'size_t': ctypes.c_size_t, 'char*': ctypes.c_char_p,
                           'void': None}[result]
        assert prototype.restype is expected_result, name
        params = [p for p in match.group(2).split(',')
                  if p.strip() not in ('', 'void')]
        assert len(params) == len(prototype.argtypes), name
        for i, (param, argtype) in enumerate(zip(params, prototype.argtypes)):
            assert ours(argtype) == ctype_of(param), (name, i, param)


@needs_headers
def test_constants_match_the_headers():
    text = _header_text()
    values = {}
    for body in re.findall(r'typedef\s+enum\s*\{([^}]*)\}', text):
        nxt = 0
        for entry in body.split(','):
            entry = entry.replace('CUDNN_DEPRECATED_ENUM', '').strip()
            if not entry:
                continue
            name, _, value = entry.partition('=')
            value = value.strip()
            if value:   # a number, or an earlier name
                nxt = values[value] if value in values else \
                    int(value.rstrip('uU'), 0)
            values[name.strip()] = nxt
            nxt += 1
    epsilon = re.search(r'#define\s+CUDNN_BN_MIN_EPSILON\s+([\d.eE+-]+)',
                        text)
    values['CUDNN_BN_MIN_EPSILON'] = float(epsilon.group(1))
    ours = {k: v for k, v in vars(C).items() if k.startswith('CUDNN_')}
    assert ours
    for name, value in ours.items():
        assert values[name] == value, name


@needs_headers
@pytest.mark.skipif(shutil.which('gcc') is None, reason='no gcc here')
def test_algo_perf_layout_matches_the_header(tmp_path):
    # cuDNN's headers include two CUDA headers for a few type names only
    (tmp_path / 'cuda_runtime_api.h').write_text(
        'typedef struct CUstream_st *cudaStream_t;\n'
        'typedef struct CUgraph_st *cudaGraph_t;\n')
    (tmp_path / 'library_types.h').write_text(
        'typedef enum { MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL } '
        'libraryPropertyType;\n')
    fields = ('algo', 'status', 'time', 'memory', 'determinism', 'mathType')
    source = ['#include <stdio.h>', '#include <stddef.h>',
              '#include "cudnn_cnn.h"', 'int main(void) {']
    for struct in ('cudnnConvolutionFwdAlgoPerf_t',
                   'cudnnConvolutionBwdFilterAlgoPerf_t',
                   'cudnnConvolutionBwdDataAlgoPerf_t'):
        source.append('printf("%zu{}\\n", sizeof({}){});'.format(
            ' %zu' * len(fields), struct,
            ''.join(', offsetof({}, {})'.format(struct, f) for f in fields)))
    source.append('return 0; }')
    (tmp_path / 'layout.c').write_text('\n'.join(source))
    build = subprocess.run(
        ['gcc', '-w', '-I', str(tmp_path), '-I', INCLUDE, 'layout.c', '-o',
         'layout'], cwd=tmp_path, capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    out = subprocess.run([str(tmp_path / 'layout')], capture_output=True,
                         text=True, check=True).stdout.split('\n')
    ours = [ctypes.sizeof(library.AlgoPerf)] + [
        getattr(library.AlgoPerf, f).offset for f in fields]
    for line in out[:3]:
        assert [int(v) for v in line.split()] == ours
