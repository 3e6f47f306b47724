"""cuDNN descriptors, made together and destroyed together.

A :class:`Descriptors` makes the descriptors of one plan
(:mod:`chainerkfac.cudnn.plans`: one shape of one operation) and destroys
them all when the plan is dropped, or at once when building the plan fails,
so nothing leaks when cuDNN refuses a shape. Arrays are C-contiguous (the
callers make them so) and NCHW.
"""
import ctypes
from typing import List, Sequence, Tuple

import numpy

from chainerkfac.cudnn import constants as C

_DATA_TYPES = {'f': C.CUDNN_DATA_FLOAT, 'd': C.CUDNN_DATA_DOUBLE,
               'e': C.CUDNN_DATA_HALF}
_DTYPES = {v: numpy.dtype(k) for k, v in _DATA_TYPES.items()}


def data_type(dtype) -> int:
    """The ``cudnnDataType_t`` of a NumPy dtype (float16/32/64 only)."""
    try:
        return _DATA_TYPES[numpy.dtype(dtype).char]
    except KeyError:
        raise TypeError('Dtype {} is not supported in cuDNN'.format(
            numpy.dtype(dtype))) from None


def dtype_of(cudnn_type: int) -> numpy.dtype:
    """The NumPy dtype of a ``cudnnDataType_t`` of :func:`data_type`."""
    return _DTYPES[cudnn_type]


def c_strides(shape: Sequence[int]) -> List[int]:
    """Strides in elements of a C-contiguous array of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return strides[::-1]


def _scalars(ctype) -> Tuple[object, object]:
    return ctypes.byref(ctype(1.0)), ctypes.byref(ctype(0.0))


# Made once: cuDNN only reads them, on the host, during a call.
_SCALARS = {'d': _scalars(ctypes.c_double), 'f': _scalars(ctypes.c_float),
            'e': _scalars(ctypes.c_float)}


def scalars(dtype) -> Tuple[object, object]:
    """``(one, zero)`` as cuDNN's ``alpha`` / ``beta`` for data of
    ``dtype``: ``double`` for float64, ``float`` otherwise."""
    return _SCALARS.get(numpy.dtype(dtype).char, _SCALARS['f'])


def _ints(values) -> ctypes.Array:
    values = [int(v) for v in values]
    return (ctypes.c_int * len(values))(*values)


class Descriptors:
    """Creates descriptors on ``lib`` and destroys them all on exit.

    Parameters
    ----------
    lib : chainerkfac.cudnn.library.Library
    """

    def __init__(self, lib):
        self._lib = lib
        self._made: List[Tuple[str, int]] = []

    def __enter__(self) -> 'Descriptors':
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Destroy every descriptor made so far (the newest first)."""
        made, self._made = self._made, []
        for kind, value in reversed(made):
            self._lib.destroy(kind, value)

    def _new(self, kind: str) -> int:
        value = self._lib.create(kind)
        self._made.append((kind, value))
        return value

    def tensor(self, shape: Sequence[int], dtype) -> int:
        """A C-contiguous NCHW tensor (4-D), or N-d with C strides."""
        desc = self._new('TensorDescriptor')
        if len(shape) == 4:
            self._lib.call('cudnnSetTensor4dDescriptor', desc,
                           C.CUDNN_TENSOR_NCHW, data_type(dtype), *shape)
        else:
            self._lib.call('cudnnSetTensorNdDescriptor', desc,
                           data_type(dtype), len(shape), _ints(shape),
                           _ints(c_strides(shape)))
        return desc

    def tensor_4d(self, n: int, c: int, h: int, w: int, dtype) -> int:
        """A 4-D NCHW tensor of the given extents (an array of any shape
        viewed as ``n x c x h x w``)."""
        desc = self._new('TensorDescriptor')
        self._lib.call('cudnnSetTensor4dDescriptor', desc,
                       C.CUDNN_TENSOR_NCHW, data_type(dtype), n, c, h, w)
        return desc

    def as_4d(self, array) -> int:
        """``array`` seen as ``(shape[0], size / shape[0], 1, 1)`` (for
        element-wise calls)."""
        first = array.shape[0] if array.ndim else 1
        return self.tensor_4d(first, array.size // max(first, 1), 1, 1,
                              array.dtype)

    def derived_bn(self, x_desc: int, mode: int) -> Tuple[int, numpy.dtype]:
        """The descriptor of BN's scale, bias, mean and variance for input
        ``x_desc`` in ``mode``, and their dtype as cuDNN derived it."""
        desc = self._new('TensorDescriptor')
        self._lib.call('cudnnDeriveBNTensorDescriptor', desc, x_desc, mode)
        values = [ctypes.c_int() for _ in range(9)]
        self._lib.call('cudnnGetTensor4dDescriptor', desc,
                       *[ctypes.byref(v) for v in values])
        return desc, dtype_of(values[0].value)

    def filter(self, shape: Sequence[int], dtype) -> int:
        """Convolution weights ``(out, in / groups, k...)``, NCHW."""
        desc = self._new('FilterDescriptor')
        if len(shape) == 4:
            self._lib.call('cudnnSetFilter4dDescriptor', desc,
                           data_type(dtype), C.CUDNN_TENSOR_NCHW, *shape)
        else:
            self._lib.call('cudnnSetFilterNdDescriptor', desc,
                           data_type(dtype), C.CUDNN_TENSOR_NCHW, len(shape),
                           _ints(shape))
        return desc

    def convolution(self, pad: Sequence[int], stride: Sequence[int],
                    dilation: Sequence[int], groups: int, dtype,
                    math_type: int) -> int:
        """A cross-correlation (Chainer's convolution) computing in the
        data's precision (float32 for float16 data, as CuPy 13)."""
        if not len(pad) == len(stride) == len(dilation):
            raise ValueError('pad, stride and dilation must be of the same '
                             'length (got {}, {}, {})'.format(
                                 pad, stride, dilation))
        compute = data_type(dtype)
        if compute == C.CUDNN_DATA_HALF:
            compute = C.CUDNN_DATA_FLOAT
        desc = self._new('ConvolutionDescriptor')
        if len(pad) == 2:
            self._lib.call('cudnnSetConvolution2dDescriptor', desc,
                           pad[0], pad[1], stride[0], stride[1], dilation[0],
                           dilation[1], C.CUDNN_CROSS_CORRELATION, compute)
        else:
            self._lib.call('cudnnSetConvolutionNdDescriptor', desc, len(pad),
                           _ints(pad), _ints(stride), _ints(dilation),
                           C.CUDNN_CROSS_CORRELATION, compute)
        self._lib.call('cudnnSetConvolutionMathType', desc, math_type)
        if groups > 1:
            self._lib.call('cudnnSetConvolutionGroupCount', desc, groups)
        return desc

    def pooling(self, ksize: Sequence[int], stride: Sequence[int],
                pad: Sequence[int], mode: int) -> int:
        if not len(ksize) == len(stride) == len(pad):
            raise ValueError('ksize, stride, and pad must be of same length')
        desc = self._new('PoolingDescriptor')
        if len(ksize) == 2:
            self._lib.call('cudnnSetPooling2dDescriptor', desc, mode,
                           C.CUDNN_NOT_PROPAGATE_NAN, ksize[0], ksize[1],
                           pad[0], pad[1], stride[0], stride[1])
        else:
            self._lib.call('cudnnSetPoolingNdDescriptor', desc, mode,
                           C.CUDNN_NOT_PROPAGATE_NAN, len(ksize),
                           _ints(ksize), _ints(pad), _ints(stride))
        return desc

    def activation(self, mode: int, coef: float) -> int:
        desc = self._new('ActivationDescriptor')
        self._lib.call('cudnnSetActivationDescriptor', desc, mode,
                       C.CUDNN_NOT_PROPAGATE_NAN, float(coef))
        return desc
