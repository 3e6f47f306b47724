"""Convolution forward, backward filter and backward data, as CuPy 13's
``cupyx.cudnn`` and with its signatures (Chainer 7.8.1 calls them from
``F.convolution_2d`` / ``_nd`` and ``F.deconvolution_2d`` / ``_nd``).

**Math type.** Chainer passes ``chainer.config.use_cudnn_tensor_core``
(``'auto'`` unless set) as ``tensor_core``; the convolution descriptor's
math type follows from it and the data type:

* float32, ``'auto'`` / ``'always'``: ``CUDNN_DEFAULT_MATH``, which lets
  cuDNN use TF32 tensor cores on Ampere and later GPUs (PyTorch's default,
  ``torch.backends.cudnn.allow_tf32 = True``): inputs rounded to a 10-bit
  mantissa, accumulation in float32;
* float32, ``'never'``: ``CUDNN_FMA_MATH``, exact float32 arithmetic
  (PyTorch's ``allow_tf32 = False``); only algorithms cuDNN reports in
  FMA math are taken;
* float16 with tensor cores available (compute capability 7.0 or later;
  CuPy 13 tested for exactly 7.0, the V100) and not ``'never'``:
  ``CUDNN_TENSOR_OP_MATH``;
* otherwise (float64, float16 with ``'never'``): ``CUDNN_DEFAULT_MATH``.

After the algorithm is chosen the descriptor takes the algorithm's own math
type, as CuPy 13 did (cuDNN needs the pair to match).
"""
import contextlib

from chainerkfac.cudnn import algorithms
from chainerkfac.cudnn import constants as C
from chainerkfac.cudnn import not_served
from chainerkfac.cudnn import runtime
from chainerkfac.cudnn.algorithms import AlgorithmKey
from chainerkfac.cudnn.library import CuDNNError

_TENSOR_CORE_MODES = ('always', 'auto', 'never')


def is_tensor_core_available(dtype) -> bool:
    """Whether convolutions of ``dtype`` may use tensor cores in
    ``'auto'`` mode (float16 on compute capability 7.0 or later)."""
    return (dtype.char == 'e' and
            runtime.current().arrays.compute_capability() >= 70)


def math_type(dtype, tensor_core: str) -> int:
    """The convolution descriptor's math type (module docstring)."""
    if tensor_core not in _TENSOR_CORE_MODES:
        raise ValueError('tensor_core must be either of "always", "auto", or '
                         '"never" (got {!r})'.format(tensor_core))
    if tensor_core == 'never':
        return C.CUDNN_FMA_MATH if dtype.char == 'f' else C.CUDNN_DEFAULT_MATH
    if is_tensor_core_available(dtype):
        return C.CUDNN_TENSOR_OP_MATH
    return C.CUDNN_DEFAULT_MATH


def _check_layouts(what, d_layout, w_layout):
    if d_layout != C.CUDNN_TENSOR_NCHW or w_layout != C.CUDNN_TENSOR_NCHW:
        raise not_served.layout(what)


def _check_output(what, array):
    if not array.flags.c_contiguous:
        raise ValueError('{} supports c-contiguous output arrays only'.format(
            what))


@contextlib.contextmanager
def _call(what, out, d_layout, w_layout, dtype, tensor_core_mode,
          **described):
    """The scope of one convolution call: the layouts and the output
    checked, the math type chosen, then :func:`runtime.call`; a cuDNN error
    gets the call's shapes and parameters (``described``) added. Yields the
    call and the math type."""
    _check_layouts(what, d_layout, w_layout)
    _check_output(what, out)
    math = math_type(dtype, tensor_core_mode)
    try:
        with runtime.call(dtype) as c:
            yield c, math
    except CuDNNError as error:
        error.add_info('in {}: {}'.format(what, ', '.join(
            '{}={}'.format(k, _describe(v)) for k, v in described.items())))
        raise


def _describe(value):
    if hasattr(value, 'shape') and hasattr(value, 'dtype'):
        return 'shape {} {}'.format(tuple(value.shape), value.dtype)
    return repr(value)


def _key(direction, timed, x, W, y, pad, stride, dilation, groups, math,
         deterministic):
    rt = runtime.current()
    return AlgorithmKey(
        direction, bool(timed), rt.arrays.device_id(), tuple(x.shape),
        tuple(W.shape), tuple(y.shape), x.dtype.name, tuple(pad),
        tuple(stride), tuple(dilation), int(groups), math,
        bool(deterministic), rt.max_workspace_size)


#: Per direction: cuDNN's timed search, its heuristics and the launch. The
#: three take their operands in one order: two inputs, the convolution
#: descriptor, the output.
_CALLS = {
    'forward': ('cudnnFindConvolutionForwardAlgorithmEx',
                'cudnnGetConvolutionForwardAlgorithm_v7',
                'cudnnConvolutionForward'),
    'backward_filter': ('cudnnFindConvolutionBackwardFilterAlgorithmEx',
                        'cudnnGetConvolutionBackwardFilterAlgorithm_v7',
                        'cudnnConvolutionBackwardFilter'),
    'backward_data': ('cudnnFindConvolutionBackwardDataAlgorithmEx',
                      'cudnnGetConvolutionBackwardDataAlgorithm_v7',
                      'cudnnConvolutionBackwardData'),
}


def _convolve(c, direction, key, first, second, conv_desc, out):
    """Choose the algorithm (cached per ``key``: timed with the maximum
    workspace if ``key.timed``, else cuDNN's heuristics) and launch one
    convolution call in the scope ``c`` (:func:`runtime.call`). ``first``,
    ``second`` and ``out`` are (descriptor, pointer) pairs in cuDNN's
    operand order: ``x, W → y`` (forward), ``x, gy → gW`` (backward
    filter), ``W, gy → gx`` (backward data)."""
    rt = runtime.current()
    find, heuristics, launch = _CALLS[direction]

    def ask():
        if key.timed:
            workspace = c.arrays.alloc(rt.max_workspace_size)
            return algorithms.query(
                c.lib, find,
                (c.handle,) + first + second + (conv_desc,) + out,
                (workspace.ptr, workspace.nbytes))
        return algorithms.query(c.lib, heuristics, (
            c.handle, first[0], second[0], conv_desc, out[0]))

    algo = algorithms.cached(rt.algorithms, key, ask)
    # The descriptor takes the algorithm's own math type (cuDNN needs the
    # pair to match).
    c.lib.call('cudnnSetConvolutionMathType', conv_desc, algo.math_type)
    workspace = c.arrays.alloc(algo.memory)
    c.lib.call(launch, c.handle, c.one, *first, *second, conv_desc,
               algo.algo, workspace.ptr, workspace.nbytes, c.zero, *out)


def _add_bias(c, b, y, y_desc):
    """``y += b`` broadcast over every axis but the channels (axis 1)."""
    b = c.arrays.contiguous(b)
    b_desc = c.d.tensor((1, b.size) + (1,) * (y.ndim - 2), b.dtype)
    c.lib.call('cudnnAddTensor', c.handle, c.one, b_desc,
               c.arrays.pointer(b), c.one, y_desc, c.arrays.pointer(y))


def convolution_forward(x, W, b, y, pad, stride, dilation, groups, *,
                        auto_tune, tensor_core,
                        d_layout=C.CUDNN_TENSOR_NCHW,
                        w_layout=C.CUDNN_TENSOR_NCHW):
    """``y = conv(x, W) (+ b)`` into the preallocated ``y``.

    Parameters
    ----------
    x, W, b, y : cupy.ndarray
        Input ``(N, C, ...)``, weights ``(K, C / groups, k...)``, bias
        ``(K,)`` or None, output ``(N, K, ...)`` (C-contiguous).
    pad, stride, dilation : tuple of int
    groups : int
    auto_tune : bool
        Time the algorithms on these arrays (``chainer.config.autotune``).
    tensor_core : str
        ``chainer.config.use_cudnn_tensor_core``: the math type.
    """
    with _call('convolution_forward', y, d_layout, w_layout, x.dtype,
               tensor_core, x=x, W=W, b=b, y=y, pad=pad, stride=stride,
               dilation=dilation, groups=groups, auto_tune=auto_tune,
               tensor_core=tensor_core) as (c, math):
        x, W = c.arrays.contiguous(x), c.arrays.contiguous(W)
        d = c.d
        x_desc, y_desc = d.tensor(x.shape, x.dtype), d.tensor(y.shape, y.dtype)
        w_desc = d.filter(W.shape, W.dtype)
        conv_desc = d.convolution(pad, stride, dilation, groups, x.dtype, math)
        _convolve(c, 'forward', _key(
            'forward', auto_tune, x, W, y, pad, stride, dilation, groups,
            math, False), (x_desc, c.arrays.pointer(x)),
            (w_desc, c.arrays.pointer(W)), conv_desc,
            (y_desc, c.arrays.pointer(y)))
        if b is not None:
            _add_bias(c, b, y, y_desc)


def convolution_backward_filter(x, gy, gW, pad, stride, dilation, groups, *,
                                deterministic, auto_tune, tensor_core,
                                d_layout=C.CUDNN_TENSOR_NCHW,
                                w_layout=C.CUDNN_TENSOR_NCHW):
    """``gW`` = the gradient of the weights from ``x`` and ``gy``.

    ``deterministic`` (``chainer.config.cudnn_deterministic``) takes only
    deterministic algorithms, from the heuristics (never timed), as CuPy 13.
    """
    with _call('convolution_backward_filter', gW, d_layout, w_layout,
               x.dtype, tensor_core, x=x, gy=gy, gW=gW, pad=pad,
               stride=stride, dilation=dilation, groups=groups,
               deterministic=deterministic, auto_tune=auto_tune,
               tensor_core=tensor_core) as (c, math):
        x, gy = c.arrays.contiguous(x), c.arrays.contiguous(gy)
        d = c.d
        x_desc = d.tensor(x.shape, x.dtype)
        gy_desc = d.tensor(gy.shape, gy.dtype)
        w_desc = d.filter(gW.shape, gW.dtype)
        conv_desc = d.convolution(pad, stride, dilation, groups, x.dtype, math)
        _convolve(c, 'backward_filter', _key(
            'backward_filter', auto_tune and not deterministic, x, gW, gy,
            pad, stride, dilation, groups, math, deterministic),
            (x_desc, c.arrays.pointer(x)), (gy_desc, c.arrays.pointer(gy)),
            conv_desc, (w_desc, c.arrays.pointer(gW)))


def convolution_backward_data(W, x, b, y, pad, stride, dilation, groups, *,
                              deterministic, auto_tune, tensor_core,
                              d_layout=C.CUDNN_TENSOR_NCHW,
                              w_layout=C.CUDNN_TENSOR_NCHW):
    """``y = deconv(x, W) (+ b)``: the transposed convolution, i.e. the
    gradient of a convolution's input (``x`` has the convolution output's
    shape, ``y`` its input's)."""
    with _call('convolution_backward_data', y, d_layout, w_layout, x.dtype,
               tensor_core, W=W, x=x, b=b, y=y, pad=pad, stride=stride,
               dilation=dilation, groups=groups, deterministic=deterministic,
               auto_tune=auto_tune, tensor_core=tensor_core) as (c, math):
        x, W = c.arrays.contiguous(x), c.arrays.contiguous(W)
        d = c.d
        x_desc, y_desc = d.tensor(x.shape, x.dtype), d.tensor(y.shape, y.dtype)
        w_desc = d.filter(W.shape, W.dtype)
        conv_desc = d.convolution(pad, stride, dilation, groups, x.dtype, math)
        _convolve(c, 'backward_data', _key(
            'backward_data', auto_tune and not deterministic, y, W, x, pad,
            stride, dilation, groups, math, deterministic),
            (w_desc, c.arrays.pointer(W)), (x_desc, c.arrays.pointer(x)),
            conv_desc, (y_desc, c.arrays.pointer(y)))
        if b is not None:
            _add_bias(c, b, y, y_desc)
