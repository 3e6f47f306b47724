"""What the ctypes bindings of NVIDIA's libraries (cuDNN in
:mod:`chainerkfac.cudnn.library`, cuBLAS in :mod:`chainerkfac.graphs.cublas`,
cuSOLVER's ``potri`` in :mod:`chainerkfac.linalg_cuda`) share: binding the
prototypes of an open library, telling "no library here" from "a library
that lacks a function", and finding the build of a library that this
process (CuPy) has loaded already."""
import ctypes
import os
from typing import Callable, Dict, List, Mapping, Optional, Sequence


class LibraryNotFound(OSError):
    """No candidate of a library could be opened at all (as opposed to one
    that opens but lacks a function the binding needs: a plain
    :class:`OSError` naming the functions). Tests of a real library skip on
    this one only."""


def bind_prototypes(cdll: ctypes.CDLL,
                    prototypes: Mapping[str, object]) -> Dict[str, Callable]:
    """The functions of ``prototypes`` (name -> an object with ``argtypes``
    and ``restype``) that ``cdll`` exports, typed; the caller names those
    missing."""
    functions = {}
    for name, prototype in prototypes.items():
        function = getattr(cdll, name, None)
        if function is not None:
            function.argtypes = prototype.argtypes
            function.restype = prototype.restype
            functions[name] = function
    return functions


def mapped_files(sonames: Sequence[str],
                 maps: str = '/proc/self/maps') -> List[str]:
    """The files of ``sonames`` mapped into this process: those named by a
    soname, or by a soname and a version (``/proc/self/maps`` names the
    file a symbolic link resolves to: a CUDA toolkit's
    ``libcublas.so.13`` is ``libcublas.so.13.0.0.19`` there)."""
    try:
        with open(maps) as lines:
            files = {parts[5].strip() for parts in
                     (line.split(None, 5) for line in lines)
                     if len(parts) == 6}
    except OSError:
        return []
    return sorted(f for f in files if any(
        os.path.basename(f) == name or
        os.path.basename(f).startswith(name + '.') for name in sonames))


def pathfinder_path(name: str) -> Optional[str]:
    """The path of NVIDIA library ``name`` (``'cublas'``, ``'cusolver'``)
    as NVIDIA's ``cuda-pathfinder`` finds and loads it — how CuPy 14
    loads the CUDA wheels' libraries — or None (no ``cuda-pathfinder``,
    or no such library where it looks)."""
    try:
        from cuda import pathfinder
        return pathfinder.load_nvidia_dynamic_lib(name).abs_path
    except Exception:  # not installed, or it cannot find the library
        return None
