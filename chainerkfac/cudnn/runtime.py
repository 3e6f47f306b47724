"""What the backend's calls share: the bound library, the array module, one
cuDNN handle per thread and device, Chainer's workspace limit, the
algorithms chosen so far, the per-shape plans and the workspace buffers.

The functions Chainer calls (:mod:`chainerkfac.cudnn.highlevel`) find it
through :func:`current`; :func:`chainerkfac.cudnn.install` activates one
over CuPy, the tests one over a recording fake library and NumPy arrays.
"""
import threading
from typing import Dict, List, NamedTuple, Optional, Tuple

from chainerkfac.cudnn import plans

#: CuPy 13's default (``cupyx.cudnn._max_workspace_size``); Chainer sets
#: another through ``chainer.backends.cuda.set_max_workspace_size``.
DEFAULT_MAX_WORKSPACE_SIZE = 8 * 1024 * 1024


class Workspace(NamedTuple):
    """Device memory handed to cuDNN; ``owner`` keeps it allocated."""

    ptr: int
    nbytes: int
    owner: object


#: The streams CUDA does not capture: the legacy default stream (CuPy's
#: null stream, 0; cudaStreamLegacy, 1) and the per-thread default one
#: (cudaStreamPerThread, 2). Chainer's eager steps run on the first.
UNCAPTURED_STREAMS = (0, 1, 2)


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
    plan_capacity : int
        Plans kept (:data:`chainerkfac.cudnn.plans.CAPACITY`).
    """

    def __init__(self, lib, arrays, plan_capacity: int = plans.CAPACITY):
        self.lib = lib
        self.arrays = arrays
        #: Bytes of workspace a convolution may use (Chainer's maximum).
        self.max_workspace_size = DEFAULT_MAX_WORKSPACE_SIZE
        #: Algorithms chosen so far, by :class:`~chainerkfac.cudnn.
        #: algorithms.AlgorithmKey` (a few numbers each, as CuPy 13's).
        self.algorithms: Dict[object, object] = {}
        #: Per-shape plans (:mod:`chainerkfac.cudnn.plans`).
        self.plans = plans.PlanCache(lib, plan_capacity)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._handles: List[int] = []
        self._workspaces: Dict[Tuple[int, int], Workspace] = {}
        #: grown-out buffers, with their (device, stream)
        self._retired: List[Tuple[Tuple[int, int], Workspace]] = []

    def handle(self, handle: Optional[int] = None) -> int:
        """This thread's cuDNN handle on the current device (or
        ``handle``, one a caller made), on the current stream.

        cuDNN launches on the stream its handle was last given, and CuPy's
        current stream changes under ``with stream:``; each thread has its
        own handles (one per device), so no other thread can move them to
        another stream between this call and the launch, and each handle
        remembers its stream: ``cudnnSetStream`` runs only when the stream
        changed. A caller's own handle is set every time.
        """
        stream = self.arrays.stream()
        if handle is not None:
            self.lib.call('cudnnSetStream', handle, stream)
            return handle
        mine = getattr(self._local, 'handles', None)
        if mine is None:
            mine = self._local.handles = {}
        device = self.arrays.device_id()
        entry = mine.get(device)
        if entry is None:
            entry = mine[device] = [self.lib.create(''), None]
            with self._lock:
                self._handles.append(entry[0])
        if entry[1] != stream:
            self.lib.call('cudnnSetStream', entry[0], stream)
            entry[1] = stream
        return entry[0]

    def handles(self) -> List[int]:
        """Every handle made so far, of all threads."""
        with self._lock:
            return list(self._handles)

    def workspace(self, nbytes: int) -> Workspace:
        """At least ``nbytes`` of device memory for a call on the current
        stream: one buffer per device and stream, kept and reused by every
        call there (the calls on one stream run one after another), grown
        when a call needs more. On a stream a CUDA graph may have been
        captured on, a grown-out buffer is kept too (the graph may still
        use it) until :meth:`release_stream` or :meth:`release_workspaces`;
        on the default streams, which CUDA does not capture
        (:data:`UNCAPTURED_STREAMS`: the eager steps'), it goes back to
        the pool (stream-ordered: after the calls queued)."""
        if nbytes == 0:
            return Workspace(0, 0, None)
        key = (self.arrays.device_id(), self.arrays.stream())
        workspace = self._workspaces.get(key)
        if workspace is None or workspace.nbytes < nbytes:
            with self._lock:
                if workspace is not None and \
                        key[1] not in UNCAPTURED_STREAMS:
                    self._retired.append((key, workspace))
                workspace = self._workspaces[key] = self.arrays.alloc(
                    nbytes)
        return workspace

    def release_stream(self, stream: int) -> None:
        """Let go of the workspaces of ``stream`` (its buffer and the
        grown-out ones): a closed :class:`chainerkfac.graphs.StepGraph`'s
        side stream, whose graphs no longer exist. Kept, they would hold
        memory of that graph's pool after it is gone."""
        with self._lock:
            for key in [k for k in self._workspaces if k[1] == stream]:
                del self._workspaces[key]
            self._retired = [(k, w) for k, w in self._retired
                             if k[1] != stream]

    def release_workspaces(self) -> None:
        """Let the memory pool have the workspaces back (no captured graph
        may use them any more)."""
        with self._lock:
            self._workspaces.clear()
            self._retired.clear()

    def close(self) -> None:
        """Destroy every plan's descriptors and every handle (at exit)."""
        self.plans.close()
        self.release_workspaces()
        with self._lock:
            handles, self._handles = self._handles, []
        self._local = threading.local()
        for handle in handles:
            self.lib.destroy('', handle)


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


def activate(runtime: Optional[Runtime]) -> Optional[Runtime]:
    """Make ``runtime`` the active one; returns the previous one."""
    global _current
    previous, _current = _current, runtime
    return previous
