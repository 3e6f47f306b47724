"""How chainerkfac.cudnn tells "no cuDNN here" from "a cuDNN that lacks a
function": only the first may skip the real-library tests
(tests/chainerkfac/test_cudnn_library.py); the second is an error. Runs on
any machine: the "library" that opens is the C math library under
cuDNN's file names."""
import ctypes.util
import os

import pytest

from chainerkfac.cudnn import library


def test_no_library_anywhere_is_not_found(tmp_path):
    with pytest.raises(library.LibraryNotFound, match='no libcudnn.so.9 '
                       'found: tried ' + str(tmp_path)):
        library.load([str(tmp_path)])


def test_a_library_that_opens_but_lacks_functions_is_not_skippable(
        tmp_path):
    libm = ctypes.util.find_library('m')
    if libm is None:
        pytest.skip('no C math library to stand in for cuDNN')
    # find_library gives a soname; ctypes opens it by that name, so link it
    # through its full path from the loader's cache.
    target = ctypes.CDLL(libm)._name
    path = next((line.split(None, 5)[-1].strip()
                 for line in open('/proc/self/maps')
                 if line.rstrip().endswith('/' + os.path.basename(target))),
                None)
    if path is None:
        pytest.skip('cannot locate {} on disk'.format(libm))
    for name in library.SUB_LIBRARIES + (library.SONAME,):
        os.symlink(path, str(tmp_path / name))
    with pytest.raises(OSError, match='does not export cudnn') as caught:
        library.load([str(tmp_path)])
    assert not isinstance(caught.value, library.LibraryNotFound)
