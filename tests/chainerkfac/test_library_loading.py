"""How the ctypes bindings (cuDNN, cuBLAS) tell "no library here" from "a
library that lacks a function": only the first may skip the real-library
tests (tests/chainerkfac/test_cudnn_library.py,
tests/chainerkfac/graphs/test_cublas_library.py); the second is an error.
Runs on any machine: the "library" that opens is the C math library under
NVIDIA's file names."""
import ctypes.util
import os

import pytest

from chainerkfac._binding import LibraryNotFound
from chainerkfac.cudnn import library as cudnn_library
from chainerkfac.graphs import cublas


def _libm_path():
    libm = ctypes.util.find_library('m')
    if libm is None:
        pytest.skip('no C math library to stand in for the libraries')
    name = os.path.basename(ctypes.CDLL(libm)._name)
    with open('/proc/self/maps') as maps:
        for line in maps:
            if line.rstrip().endswith('/' + name):
                return line.split(None, 5)[-1].strip()
    pytest.skip('cannot locate {} on disk'.format(libm))


def test_no_cudnn_anywhere_is_not_found(tmp_path):
    with pytest.raises(LibraryNotFound, match='no libcudnn.so.9 '
                       'found: tried ' + str(tmp_path)):
        cudnn_library.load([str(tmp_path)])


def test_no_cublas_anywhere_is_not_found(tmp_path):
    with pytest.raises(LibraryNotFound, match='no cuBLAS found'):
        cublas.load([str(tmp_path / 'libcublas.so.12')])


def test_a_cudnn_that_lacks_functions_is_not_skippable(tmp_path):
    path = _libm_path()
    for name in cudnn_library.SUB_LIBRARIES + (cudnn_library.SONAME,):
        os.symlink(path, str(tmp_path / name))
    with pytest.raises(OSError, match='does not export cudnn') as caught:
        cudnn_library.load([str(tmp_path)])
    assert not isinstance(caught.value, LibraryNotFound)


def test_a_cublas_that_lacks_functions_is_not_skippable(tmp_path):
    link = str(tmp_path / 'libcublas.so.12')
    os.symlink(_libm_path(), link)
    with pytest.raises(OSError, match='does not export cublas') as caught:
        cublas.load([link])
    assert not isinstance(caught.value, LibraryNotFound)
