"""How the ctypes bindings (cuDNN, cuBLAS) tell "no library here" from "a
library that lacks a function": only the first may skip the real-library
tests (tests/chainerkfac/test_cudnn_library.py,
tests/chainerkfac/graphs/test_cublas_library.py); the second is an error.
Runs on any machine: the "library" that opens is the C math library under
NVIDIA's file names."""
import ctypes.util
import os
import sys

import pytest

from chainerkfac import _binding
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


def test_mapped_files_know_a_soname_by_its_resolved_name(tmp_path):
    # /proc/self/maps names the file a soname's link resolves to
    maps = tmp_path / 'maps'
    maps.write_text(
        '7f00-7f10 r-xp 00000000 08:01 1 /usr/local/cuda/lib64/'
        'libcublas.so.13.0.0.19\n'
        '7f10-7f20 r-xp 00000000 08:01 2 /usr/local/cuda/lib64/'
        'libcublasLt.so.13.0.0.19\n'
        '7f20-7f30 r-xp 00000000 08:01 3 /site/nvidia/cu13/lib/'
        'libcusolver.so.12\n'
        '7f30-7f40 rw-p 00000000 00:00 0\n'
        '7f40-7f50 r-xp 00000000 08:01 4 /opt/libcublas.so.130\n')
    assert _binding.mapped_files(cublas.SONAMES, str(maps)) == [
        '/usr/local/cuda/lib64/libcublas.so.13.0.0.19']
    assert _binding.mapped_files(('libcusolver.so',), str(maps)) == [
        '/site/nvidia/cu13/lib/libcusolver.so.12']
    assert _binding.mapped_files(cublas.SONAMES,
                                 str(tmp_path / 'none')) == []


@pytest.mark.parametrize('package, soname', [
    (('nvidia', 'cu13'), 'libcublas.so.13'),     # CUDA 13's nvidia-cublas
    (('nvidia', 'cublas'), 'libcublas.so.12'),   # nvidia-cublas-cu12
])
def test_cublas_wheels_are_candidates(tmp_path, monkeypatch, package,
                                      soname):
    folder = tmp_path.joinpath(*package, 'lib')
    folder.mkdir(parents=True)
    (folder / soname).write_bytes(b'')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cublas, '_loaded', lambda: [])
    monkeypatch.setattr(cublas, '_pathfinder', lambda: [])
    before = {m for m in sys.modules if m.split('.')[0] == 'nvidia'}
    try:
        assert str(folder) in cublas.wheel_folders()
        found = list(cublas.candidates())
    finally:    # the namespace packages found here are imported
        for name in {m for m in sys.modules
                     if m.split('.')[0] == 'nvidia'} - before:
            del sys.modules[name]
    assert found[0] == str(folder / soname)
    assert found[-len(cublas.SONAMES):] == list(cublas.SONAMES)
