"""What the ctypes bindings of NVIDIA's libraries (cuDNN in
:mod:`chainerkfac.cudnn.library`, cuBLAS in :mod:`chainerkfac.graphs.cublas`)
share: binding the prototypes of an open library, and telling "no library
here" from "a library that lacks a function"."""
import ctypes
from typing import Callable, Dict, Mapping


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
