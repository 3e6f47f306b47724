"""Finding, loading and binding cuDNN 9 (``libcudnn.so.9``) with ctypes.

:data:`PROTOTYPES` lists every C function the backend calls, with its
argument types as in cuDNN 9's headers. :func:`load` opens the library,
binds them all (a missing symbol is an :class:`OSError` naming it, so an
incomplete cuDNN is refused when the backend is installed, not on the first
convolution) and returns a :class:`Library`, whose :meth:`Library.call`
turns a non-zero ``cudnnStatus_t`` into a :class:`CuDNNError`.

Where the library comes from (:func:`candidates`): first the folder of the
``nvidia-cudnn-cu13`` / ``nvidia-cudnn-cu12`` wheel (``nvidia/cudnn/lib``
on ``sys.path``: the GPU extras install it, PyTorch does too), then the
system's loader path (``LD_LIBRARY_PATH``, ``ld.so.cache``). ``libcudnn.so.9``
is a shim that opens its sub-libraries by name when first needed; we open
``libcudnn_graph``, ``libcudnn_ops`` and ``libcudnn_cnn`` first with
``RTLD_GLOBAL`` from the same folder, so that a broken install (a missing
sub-library, a missing ``libz``) is found at once and the shim finds the
libraries already loaded.
"""
import ctypes
import importlib.util
import os
from typing import (Callable, Dict, Iterator, List, Mapping, NamedTuple,
                    Optional)

from chainerkfac._binding import LibraryNotFound, bind_prototypes

#: cuDNN major version whose legacy API this backend binds.
MAJOR = 9
SONAME = 'libcudnn.so.9'
#: Loaded before the shim, in dependency order (ops needs graph, cnn both).
SUB_LIBRARIES = ('libcudnn_graph.so.9', 'libcudnn_ops.so.9',
                 'libcudnn_cnn.so.9')


class AlgoPerf(ctypes.Structure):
    """``cudnnConvolution{Fwd,BwdFilter,BwdData}AlgoPerf_t`` (one layout)."""

    _fields_ = [('algo', ctypes.c_int), ('status', ctypes.c_int),
                ('time', ctypes.c_float), ('memory', ctypes.c_size_t),
                ('determinism', ctypes.c_int), ('mathType', ctypes.c_int),
                ('reserved', ctypes.c_int * 3)]


_p = ctypes.c_void_p          # handles, descriptors, device pointers
_i = ctypes.c_int             # enums and ints
_s = ctypes.c_size_t
_d = ctypes.c_double
_pp = ctypes.POINTER(ctypes.c_void_p)
_pi = ctypes.POINTER(ctypes.c_int)
_ps = ctypes.POINTER(ctypes.c_size_t)
_perf = ctypes.POINTER(AlgoPerf)


class Prototype(NamedTuple):
    argtypes: tuple
    restype: object = ctypes.c_int   # cudnnStatus_t


#: C name -> prototype, as in cuDNN 9.x's headers (all in libcudnn.so.9).
PROTOTYPES: Dict[str, Prototype] = {
    # cudnn_graph.h
    'cudnnGetVersion': Prototype((), ctypes.c_size_t),
    'cudnnGetCudartVersion': Prototype((), ctypes.c_size_t),
    'cudnnGetErrorString': Prototype((_i,), ctypes.c_char_p),
    'cudnnGetLastErrorString': Prototype((ctypes.c_char_p, _s), None),
    'cudnnCreate': Prototype((_pp,)),
    'cudnnDestroy': Prototype((_p,)),
    'cudnnSetStream': Prototype((_p, _p)),
    'cudnnQueryRuntimeError': Prototype((_p, _pi, _i, _p)),
    # cudnn_ops.h: tensors and filters
    'cudnnCreateTensorDescriptor': Prototype((_pp,)),
    'cudnnSetTensor4dDescriptor': Prototype((_p, _i, _i, _i, _i, _i, _i)),
    'cudnnSetTensorNdDescriptor': Prototype((_p, _i, _i, _pi, _pi)),
    'cudnnGetTensor4dDescriptor': Prototype((_p,) + (_pi,) * 9),
    'cudnnDestroyTensorDescriptor': Prototype((_p,)),
    'cudnnCreateFilterDescriptor': Prototype((_pp,)),
    'cudnnSetFilter4dDescriptor': Prototype((_p, _i, _i, _i, _i, _i, _i)),
    'cudnnSetFilterNdDescriptor': Prototype((_p, _i, _i, _i, _pi)),
    'cudnnDestroyFilterDescriptor': Prototype((_p,)),
    'cudnnAddTensor': Prototype((_p, _p, _p, _p, _p, _p, _p)),
    # pooling, activation, softmax
    'cudnnCreatePoolingDescriptor': Prototype((_pp,)),
    'cudnnSetPooling2dDescriptor': Prototype((_p,) + (_i,) * 8),
    'cudnnSetPoolingNdDescriptor': Prototype((_p, _i, _i, _i, _pi, _pi, _pi)),
    'cudnnDestroyPoolingDescriptor': Prototype((_p,)),
    'cudnnPoolingForward': Prototype((_p,) * 8),
    'cudnnPoolingBackward': Prototype((_p,) * 12),
    'cudnnCreateActivationDescriptor': Prototype((_pp,)),
    'cudnnSetActivationDescriptor': Prototype((_p, _i, _i, _d)),
    'cudnnDestroyActivationDescriptor': Prototype((_p,)),
    'cudnnActivationForward': Prototype((_p,) * 8),
    'cudnnActivationBackward': Prototype((_p,) * 12),
    'cudnnSoftmaxForward': Prototype((_p, _i, _i) + (_p,) * 6),
    'cudnnSoftmaxBackward': Prototype((_p, _i, _i) + (_p,) * 8),
    # batch normalization
    'cudnnDeriveBNTensorDescriptor': Prototype((_p, _p, _i)),
    'cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize': Prototype(
        (_p, _i, _i, _p, _p, _p, _p, _p, _ps)),
    'cudnnGetBatchNormalizationTrainingExReserveSpaceSize': Prototype(
        (_p, _i, _i, _p, _p, _ps)),
    'cudnnBatchNormalizationForwardTrainingEx': Prototype(
        (_p, _i, _i) + (_p,) * 11 + (_d, _p, _p, _d, _p, _p, _p, _p, _s, _p,
                                     _s)),
    'cudnnGetBatchNormalizationBackwardExWorkspaceSize': Prototype(
        (_p, _i, _i) + (_p,) * 7 + (_ps,)),
    'cudnnBatchNormalizationBackwardEx': Prototype(
        (_p, _i, _i) + (_p,) * 19 + (_d, _p, _p, _p, _p, _s, _p, _s)),
    'cudnnBatchNormalizationForwardInference': Prototype(
        (_p, _i) + (_p,) * 11 + (_d,)),
    # dropout
    'cudnnCreateDropoutDescriptor': Prototype((_pp,)),
    'cudnnDestroyDropoutDescriptor': Prototype((_p,)),
    'cudnnDropoutGetStatesSize': Prototype((_p, _ps)),
    'cudnnSetDropoutDescriptor': Prototype(
        (_p, _p, ctypes.c_float, _p, _s, ctypes.c_ulonglong)),
    'cudnnDropoutGetReserveSpaceSize': Prototype((_p, _ps)),
    'cudnnDropoutForward': Prototype((_p,) * 7 + (_s,)),
    'cudnnDropoutBackward': Prototype((_p,) * 7 + (_s,)),
    # cudnn_cnn.h: convolution
    'cudnnCreateConvolutionDescriptor': Prototype((_pp,)),
    'cudnnSetConvolution2dDescriptor': Prototype((_p,) + (_i,) * 8),
    'cudnnSetConvolutionNdDescriptor': Prototype((_p, _i, _pi, _pi, _pi, _i,
                                                  _i)),
    'cudnnSetConvolutionMathType': Prototype((_p, _i)),
    'cudnnSetConvolutionGroupCount': Prototype((_p, _i)),
    'cudnnDestroyConvolutionDescriptor': Prototype((_p,)),
    'cudnnGetConvolutionForwardAlgorithm_v7': Prototype(
        (_p, _p, _p, _p, _p, _i, _pi, _perf)),
    'cudnnFindConvolutionForwardAlgorithmEx': Prototype(
        (_p,) * 8 + (_i, _pi, _perf, _p, _s)),
    'cudnnConvolutionForward': Prototype(
        (_p,) * 7 + (_i, _p, _s, _p, _p, _p)),
    'cudnnGetConvolutionBackwardFilterAlgorithm_v7': Prototype(
        (_p, _p, _p, _p, _p, _i, _pi, _perf)),
    'cudnnFindConvolutionBackwardFilterAlgorithmEx': Prototype(
        (_p,) * 8 + (_i, _pi, _perf, _p, _s)),
    'cudnnConvolutionBackwardFilter': Prototype(
        (_p,) * 7 + (_i, _p, _s, _p, _p, _p)),
    'cudnnGetConvolutionBackwardDataAlgorithm_v7': Prototype(
        (_p, _p, _p, _p, _p, _i, _pi, _perf)),
    'cudnnFindConvolutionBackwardDataAlgorithmEx': Prototype(
        (_p,) * 8 + (_i, _pi, _perf, _p, _s)),
    'cudnnConvolutionBackwardData': Prototype(
        (_p,) * 7 + (_i, _p, _s, _p, _p, _p)),
}


class CuDNNError(RuntimeError):
    """A cuDNN call returned a status other than ``CUDNN_STATUS_SUCCESS``.

    Parameters
    ----------
    status : int
        The ``cudnnStatus_t`` (cuDNN 9 numbering, e.g. 2000 for
        ``CUDNN_STATUS_BAD_PARAM``).
    message : str
        What failed: the function, the status's name, cuDNN's last error
        text.
    """

    def __init__(self, status: int, message: str):
        super().__init__(status, message)
        self.status = status
        self.message = message
        self._infos: List[str] = []

    def add_info(self, info: str) -> None:
        """Append a line of context (shapes, parameters) to the message."""
        self._infos.append(info)

    def __str__(self):
        return 'cuDNN Error: {}{}'.format(
            self.message, ''.join('\n  ' + i for i in self._infos))


class Library:
    """The bound functions of one cuDNN, and where it came from.

    Parameters
    ----------
    functions : mapping
        C name -> callable, for every name of :data:`PROTOTYPES` (ctypes
        functions for a real library; recording fakes in the tests).
    path : str
        The ``libcudnn.so.9`` that was opened (or the fake's name).
    """

    def __init__(self, functions: Mapping[str, Callable], path: str):
        missing = sorted(set(PROTOTYPES) - set(functions))
        if missing:
            raise OSError('{} does not export {}'.format(
                path, ', '.join(missing)))
        self._functions = dict(functions)
        self.path = path

    def call(self, name: str, *args) -> None:
        """Call the C function ``name``; raise :class:`CuDNNError` unless it
        returns ``CUDNN_STATUS_SUCCESS``."""
        status = self._functions[name](*args)
        if status != 0:
            raise CuDNNError(status, '{} in {}{}'.format(
                self.error_string(status), name, self._last_error()))

    def version(self) -> int:
        """``cudnnGetVersion()``: major·10000 + minor·100 + patch."""
        return int(self._functions['cudnnGetVersion']())

    def cudart_version(self) -> int:
        """The CUDA runtime version cuDNN was built for (e.g. 13000)."""
        return int(self._functions['cudnnGetCudartVersion']())

    def error_string(self, status: int) -> str:
        text = self._functions['cudnnGetErrorString'](status)
        return text.decode() if isinstance(text, bytes) else str(text)

    def _last_error(self) -> str:
        buffer = ctypes.create_string_buffer(512)
        self._functions['cudnnGetLastErrorString'](buffer, len(buffer))
        text = buffer.value.decode(errors='replace').strip()
        return ': ' + text if text else ''

    def create(self, kind: str) -> int:
        """``cudnnCreate<kind>`` (e.g. ``'TensorDescriptor'``): the new
        object's address."""
        out = ctypes.c_void_p()
        self.call('cudnnCreate' + kind, ctypes.byref(out))
        return out.value

    def destroy(self, kind: str, value: int) -> None:
        self.call('cudnnDestroy' + kind, value)

    def size(self, name: str, *args) -> int:
        """Call a ``Get...Size`` function whose last argument is the
        ``size_t *`` result."""
        out = ctypes.c_size_t()
        self.call(name, *args, ctypes.byref(out))
        return out.value


def wheel_folders() -> List[str]:
    """``nvidia/cudnn/lib`` of the ``nvidia-cudnn-cu*`` wheels on
    ``sys.path`` (``nvidia.cudnn`` is a namespace package: no
    ``__file__``), without importing them."""
    try:
        spec = importlib.util.find_spec('nvidia.cudnn')
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    folders = [os.path.join(p, 'lib')
               for p in (spec.submodule_search_locations or ())]
    return [f for f in folders
            if os.path.isfile(os.path.join(f, SONAME))]


def candidates() -> Iterator[Optional[str]]:
    """Folders to load cuDNN from, in order; ``None`` is the system's
    loader path."""
    yield from wheel_folders()
    yield None


def _open(folder: Optional[str]) -> ctypes.CDLL:
    def path(name):
        return name if folder is None else os.path.join(folder, name)
    for name in SUB_LIBRARIES:
        ctypes.CDLL(path(name), mode=ctypes.RTLD_GLOBAL)
    return ctypes.CDLL(path(SONAME), mode=ctypes.RTLD_GLOBAL)


def bind(cdll: ctypes.CDLL, path: str) -> Library:
    """Bind every function of :data:`PROTOTYPES` from an open library
    (:class:`Library` names those it lacks)."""
    return Library(bind_prototypes(cdll, PROTOTYPES), path)


def load(folders=None) -> Library:
    """Open the first cuDNN 9 found in ``folders`` (default
    :func:`candidates`) and bind it.

    Raises
    ------
    LibraryNotFound
        Nothing loadable was found; the message says what was tried.
    OSError
        A library was opened but does not export every function of
        :data:`PROTOTYPES`; the message names them.
    """
    tried = []
    for folder in candidates() if folders is None else folders:
        where = folder or 'the system loader path'
        try:
            cdll = _open(folder)
        except OSError as error:
            tried.append('{} ({})'.format(where, error))
            continue
        return bind(cdll, os.path.join(folder, SONAME) if folder
                    else _loaded_path(cdll))
    raise LibraryNotFound('no {} found: tried {}'.format(
        SONAME, '; '.join(tried)))


def _loaded_path(cdll: ctypes.CDLL) -> str:
    """Where the dynamic loader found a library opened by its soname."""
    try:
        with open('/proc/self/maps') as maps:
            for line in maps:
                if line.rstrip().endswith('/' + SONAME):
                    return line.split(None, 5)[-1].strip()
    except OSError:
        pass
    return cdll._name
