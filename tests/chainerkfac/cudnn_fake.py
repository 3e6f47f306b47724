"""A recording stand-in for cuDNN 9 and a NumPy stand-in for CuPy, so that
the backend's Python (descriptors, algorithm choice and cache, workspace,
streams, errors) runs on a CPU.

:class:`FakeCudnn` accepts exactly the calls of
:data:`chainerkfac.cudnn.library.PROTOTYPES`: each argument goes through
its ctypes type's ``from_param`` as a real call would, so a wrong count or
type fails here too. It writes the outputs a caller reads (new descriptor
addresses, sizes, algorithm lists, a derived BN descriptor's type) and
records every call with its arguments decoded (:class:`Call`).
"""
import ctypes
from typing import Dict, List, NamedTuple, Tuple

import numpy

from chainerkfac.cudnn import constants as C
from chainerkfac.cudnn import library
from chainerkfac.cudnn import runtime

#: cuDNN 9's text for the statuses the tests use.
STATUS_NAMES = {0: 'CUDNN_STATUS_SUCCESS',
                1001: 'CUDNN_STATUS_NOT_INITIALIZED',
                2000: 'CUDNN_STATUS_BAD_PARAM',
                3000: 'CUDNN_STATUS_NOT_SUPPORTED',
                5000: 'CUDNN_STATUS_EXECUTION_FAILED'}
NOT_SUPPORTED = 3000


class Call(NamedTuple):
    name: str
    args: Tuple


def perf(algo, memory=0, status=0, determinism=C.CUDNN_DETERMINISTIC,
         math_type=C.CUDNN_DEFAULT_MATH, time=1.0):
    """One entry of an algorithm answer."""
    return library.AlgoPerf(algo, status, time, memory, determinism,
                            math_type)


def _decode(value):
    """A recorded argument: scalars behind ``byref`` (alpha, beta) as their
    value, int arrays as tuples, outputs as 'out', algorithm arrays as
    'perf'."""
    if isinstance(value, ctypes.Array):
        if value._type_ is library.AlgoPerf:
            return 'perf'
        return tuple(value)
    obj = getattr(value, '_obj', None)
    if obj is not None:
        if isinstance(obj, (ctypes.c_float, ctypes.c_double)):
            return obj.value
        return 'out'
    return value


class FakeCudnn:
    """Records calls; see the module docstring.

    Attributes a test sets before the calls: ``answers`` (C name of a
    ``Get..._v7`` / ``Find...Ex`` function -> list of :func:`perf`),
    ``sizes`` (C name of a ``...Size`` function -> bytes), ``failures``
    (C name -> status to return), ``last_error`` (cuDNN's last error text).
    """

    def __init__(self, version=92801, cudart=13000):
        self.version = version
        self.cudart = cudart
        self.calls: List[Call] = []
        self.answers: Dict[str, list] = {}
        self.sizes: Dict[str, int] = {}
        self.failures: Dict[str, int] = {}
        self.last_error = ''
        self.live = set()            # descriptors and handles not destroyed
        self.tensors = {}            # descriptor -> (data type, dims)
        self.math = {}               # convolution descriptor -> math type
        self._next = 0x1000

    def library(self) -> library.Library:
        return library.Library(
            {name: self._function(name) for name in library.PROTOTYPES},
            'fake libcudnn.so.9')

    def named(self, name: str) -> List[Call]:
        return [c for c in self.calls if c.name == name]

    def names(self) -> List[str]:
        return [c.name for c in self.calls]

    def _function(self, name):
        prototype = library.PROTOTYPES[name]

        def function(*args):
            assert len(args) == len(prototype.argtypes), (
                '{} takes {} arguments, got {}'.format(
                    name, len(prototype.argtypes), len(args)))
            for argtype, arg in zip(prototype.argtypes, args):
                argtype.from_param(arg)   # raises as a real call would
            return self._run(name, args)
        return function

    def _run(self, name, args):
        if name == 'cudnnGetVersion':
            return self.version
        if name == 'cudnnGetCudartVersion':
            return self.cudart
        if name == 'cudnnGetErrorString':
            return STATUS_NAMES.get(args[0], 'CUDNN_UNKNOWN_STATUS').encode()
        if name == 'cudnnGetLastErrorString':
            text = self.last_error.encode()[:args[1] - 1]
            ctypes.memmove(args[0], text + b'\0', len(text) + 1)
            return None
        self.calls.append(Call(name, tuple(_decode(a) for a in args)))
        if name in self.failures:
            return self.failures[name]
        if name.startswith('cudnnCreate'):
            self._next += 0x10
            args[0]._obj.value = self._next
            self.live.add(self._next)
        elif name.startswith('cudnnDestroy'):
            self.live.remove(args[0])
        elif name == 'cudnnSetTensor4dDescriptor':
            self.tensors[args[0]] = (args[2], tuple(args[3:7]))
        elif name == 'cudnnSetTensorNdDescriptor':
            self.tensors[args[0]] = (args[1], tuple(args[3])[:args[2]])
        elif name == 'cudnnDeriveBNTensorDescriptor':
            x_type, dims = self.tensors[args[1]]
            self.tensors[args[0]] = (
                C.CUDNN_DATA_FLOAT if x_type == C.CUDNN_DATA_HALF else x_type,
                (1, dims[1], 1, 1))
        elif name == 'cudnnGetTensor4dDescriptor':
            data_type, dims = self.tensors[args[0]]
            for ref, value in zip(args[1:], (data_type,) + dims):
                ref._obj.value = value
        elif name.endswith('Size'):
            args[-1]._obj.value = self.sizes.get(name, 0)
        elif name == 'cudnnSetConvolutionMathType':
            self.math[args[0]] = args[1]
        elif 'Algorithm' in name:
            heuristic = name.startswith('cudnnGet')
            conv = args[3] if heuristic else args[5]
            # by default one algorithm, in the descriptor's math, as cuDNN
            entries = self.answers.get(
                name, [perf(0, math_type=self.math.get(conv, 0))])
            count, returned, results = args[-3:] if heuristic else args[8:11]
            for i, entry in enumerate(entries[:count]):
                results[i] = entry
            returned._obj.value = min(len(entries), count)
        return 0


class NumpyArrays:
    """:class:`chainerkfac.cudnn.runtime.CupyArrays` over NumPy, with the
    device, stream and compute capability set by the test, and every
    workspace allocation recorded."""

    def __init__(self):
        self.device = 0
        self.current_stream = 0x5000
        self.capability = 90
        self.allocations: List[int] = []

    def contiguous(self, array):
        return numpy.ascontiguousarray(array)

    def empty(self, shape, dtype):
        return numpy.empty(shape, dtype)

    def pointer(self, array) -> int:
        return array.ctypes.data

    def alloc(self, nbytes: int) -> runtime.Workspace:
        self.allocations.append(nbytes)
        if nbytes == 0:
            return runtime.Workspace(0, 0, None)
        buffer = numpy.empty(nbytes, numpy.uint8)
        return runtime.Workspace(buffer.ctypes.data, nbytes, buffer)

    def device_id(self) -> int:
        return self.device

    def stream(self) -> int:
        return self.current_stream

    def compute_capability(self) -> int:
        return self.capability
