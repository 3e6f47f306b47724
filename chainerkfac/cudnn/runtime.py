"""What the backend's calls share: the bound library, the array module, one
cuDNN handle per device, Chainer's workspace limit and the algorithms
chosen so far.

The functions Chainer calls (:mod:`chainerkfac.cudnn.highlevel`) find it
through :func:`current`; :func:`chainerkfac.cudnn.install` activates one
over CuPy, the tests one over a recording fake library and NumPy arrays.
"""
import contextlib
from typing import Dict, Iterator, NamedTuple, Optional, Tuple

from chainerkfac.cudnn.descriptors import Descriptors, scalars

#: CuPy 13's default (``cupyx.cudnn._max_workspace_size``); Chainer sets
#: another through ``chainer.backends.cuda.set_max_workspace_size``.
DEFAULT_MAX_WORKSPACE_SIZE = 8 * 1024 * 1024


class Workspace(NamedTuple):
    """Device memory handed to cuDNN; ``owner`` keeps it allocated."""

    ptr: int
    nbytes: int
    owner: object


class CupyArrays:
    """What the backend needs from CuPy: arrays, pool memory, the current
    device and stream.

    Parameters
    ----------
    cupy : module
        CuPy (a NumPy-backed twin in the tests).
    """

    def __init__(self, cupy):
        self._cupy = cupy

    def contiguous(self, array):
        return self._cupy.ascontiguousarray(array)

    def empty(self, shape: Tuple[int, ...], dtype):
        return self._cupy.empty(shape, dtype)

    def pointer(self, array) -> int:
        return array.data.ptr

    def alloc(self, nbytes: int) -> Workspace:
        """``nbytes`` from CuPy's memory pool (stream-ordered: the memory
        returns to the pool when ``owner`` is dropped and is reused only
        after the work queued on this stream)."""
        if nbytes == 0:
            return Workspace(0, 0, None)
        memory = self._cupy.cuda.alloc(nbytes)
        return Workspace(memory.ptr, nbytes, memory)

    def device_id(self) -> int:
        return self._cupy.cuda.runtime.getDevice()

    def stream(self) -> int:
        return self._cupy.cuda.get_current_stream().ptr

    def compute_capability(self) -> int:
        """Of the current device, e.g. 90 for an H100."""
        return int(self._cupy.cuda.Device().compute_capability)


class Runtime:
    """The state shared by the backend's calls in this process.

    Parameters
    ----------
    lib : chainerkfac.cudnn.library.Library
    arrays : CupyArrays
    """

    def __init__(self, lib, arrays):
        self.lib = lib
        self.arrays = arrays
        #: Bytes of workspace a convolution may use (Chainer's maximum).
        self.max_workspace_size = DEFAULT_MAX_WORKSPACE_SIZE
        #: Algorithms chosen so far, by :class:`~chainerkfac.cudnn.
        #: algorithms.AlgorithmKey`.
        self.algorithms: Dict[object, object] = {}
        self._handles: Dict[int, int] = {}

    def handle(self, handle: Optional[int] = None) -> int:
        """The current device's cuDNN handle (or ``handle``, one a caller
        made), set to the current stream.

        cuDNN launches on the stream its handle was last given; CuPy's
        current stream changes under ``with stream:``, so every call sets
        it again (a host-side call, no synchronisation), as CuPy 13 did.
        """
        if handle is None:
            device = self.arrays.device_id()
            handle = self._handles.get(device)
            if handle is None:
                handle = self._handles[device] = self.lib.create('')
        self.lib.call('cudnnSetStream', handle, self.arrays.stream())
        return handle


_current: Optional[Runtime] = None


def current() -> Runtime:
    """The active runtime.

    Raises
    ------
    RuntimeError
        The backend was not installed (nothing should have called it).
    """
    if _current is None:
        raise RuntimeError('chainerkfac.cudnn is not installed')
    return _current


class Call(NamedTuple):
    """What one cuDNN call needs (:func:`call`)."""

    lib: object          # chainerkfac.cudnn.library.Library
    arrays: object       # CupyArrays, or the tests' NumPy stand-in
    handle: int          # set to the current stream
    one: object          # alpha = 1 and beta = 0 for the data's dtype
    zero: object
    d: Descriptors       # destroyed when the call's scope closes


@contextlib.contextmanager
def call(dtype, handle: Optional[int] = None) -> Iterator[Call]:
    """The scope of one cuDNN call on data of ``dtype``, in the active
    runtime: its library and arrays, the handle set to the current stream
    (``handle`` if the caller made one), the scalars and the call's
    descriptors."""
    rt = current()
    handle = rt.handle(handle)
    one, zero = scalars(dtype)
    with Descriptors(rt.lib) as d:
        yield Call(rt.lib, rt.arrays, handle, one, zero, d)


def activate(runtime: Optional[Runtime]) -> Optional[Runtime]:
    """Make ``runtime`` the active one; returns the previous one."""
    global _current
    previous, _current = _current, runtime
    return previous
