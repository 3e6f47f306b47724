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

**Plans.** The descriptors, the algorithm and its workspace size are built
once per shape and direction (:mod:`chainerkfac.cudnn.plans`); a call is
then the launch alone, with its workspace from the runtime's buffer for the
current stream (:meth:`~chainerkfac.cudnn.runtime.Runtime.workspace`).
"""
from chainerkfac.cudnn import algorithms
from chainerkfac.cudnn import constants as C
from chainerkfac.cudnn import not_served
from chainerkfac.cudnn import plans
from chainerkfac.cudnn import runtime
from chainerkfac.cudnn.algorithms import AlgorithmKey
from chainerkfac.cudnn.descriptors import scalars
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


def _describe(value):
    if hasattr(value, 'shape') and hasattr(value, 'dtype'):
        return 'shape {} {}'.format(tuple(value.shape), value.dtype)
    return repr(value)


def _add_context(error, what, described):
    """A cuDNN error gets the call's shapes and parameters."""
    error.add_info('in {}: {}'.format(what, ', '.join(
        '{}={}'.format(k, _describe(v)) for k, v in described.items())))


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


def _build(d, rt, direction, timed, deterministic, tensor_core, x, W, y,
           pad, stride, dilation, groups, bias, arrays):
    """The plan of one direction on one shape, its descriptors made with
    ``d`` (``x``, ``W``, ``y`` as the forward convolution sees them: input,
    weights, output): descriptors, the algorithm (cached per
    :class:`AlgorithmKey`: timed with the maximum workspace if ``timed``,
    else cuDNN's heuristics) and the convolution descriptor set to the
    algorithm's own math type (cuDNN needs the pair to match). ``arrays``
    are the call's pointers in cuDNN's operand order, for the timed
    search."""
    lib = rt.lib
    math = math_type(x.dtype, tensor_core)
    plan = plans.Plan(d)
    plan.x, plan.y = d.tensor(x.shape, x.dtype), d.tensor(y.shape, y.dtype)
    plan.w = d.filter(W.shape, W.dtype)
    plan.conv = d.convolution(pad, stride, dilation, groups, x.dtype, math)
    descs = {'forward': (plan.x, plan.w, plan.y),
             'backward_filter': (plan.x, plan.y, plan.w),
             'backward_data': (plan.w, plan.y, plan.x)}[direction]
    find, heuristics, _ = _CALLS[direction]
    handle = rt.handle()

    def ask():
        if timed:
            workspace = rt.arrays.alloc(rt.max_workspace_size)
            first, second, out = zip(descs, arrays)
            return algorithms.query(
                lib, find, (handle,) + first + second + (plan.conv,) + out,
                (workspace.ptr, workspace.nbytes))
        return algorithms.query(lib, heuristics, (
            handle, descs[0], descs[1], plan.conv, descs[2]))

    key = AlgorithmKey(
        direction, timed, rt.arrays.device_id(), tuple(x.shape),
        tuple(W.shape), tuple(y.shape), x.dtype.name, pad, stride, dilation,
        int(groups), math, deterministic, rt.max_workspace_size)
    algo = algorithms.cached(rt.algorithms, key, ask)
    lib.call('cudnnSetConvolutionMathType', plan.conv, algo.math_type)
    plan.algo, plan.workspace = algo.algo, algo.memory
    # The bias is added to the call's output: y (forward), x (backward
    # data).
    channels = (y if direction == 'forward' else x).shape[1]
    plan.b = (d.tensor((1, channels) + (1,) * (x.ndim - 2), x.dtype)
              if bias else None)
    return plan


def _plan(direction, timed, deterministic, tensor_core, x, W, y, pad,
          stride, dilation, groups, bias, arrays):
    rt = runtime.current()
    key = (direction, x.shape, W.shape, y.shape, x.dtype.char, pad, stride,
           dilation, groups, timed, deterministic, tensor_core, bias,
           rt.arrays.device_id(), rt.max_workspace_size)
    return rt, rt.plans.get(
        key, _build, rt, direction, timed, deterministic, tensor_core, x, W,
        y, pad, stride, dilation, groups, bias, arrays)


def _launch(rt, plan, direction, first, second, out, one, zero):
    """One convolution call: ``first``, ``second`` and ``out`` are (plan
    descriptor, pointer) pairs in cuDNN's operand order: ``x, W → y``
    (forward), ``x, gy → gW`` (backward filter), ``W, gy → gx`` (backward
    data)."""
    workspace = rt.workspace(plan.workspace)
    rt.lib.call(_CALLS[direction][2], rt.handle(), one, *first, *second,
                plan.conv, plan.algo, workspace.ptr, workspace.nbytes, zero,
                *out)


def _add_bias(rt, plan, b, y, one):
    """``y += b`` broadcast over every axis but the channels (axis 1)."""
    arrays = rt.arrays
    b = arrays.contiguous(b)
    rt.lib.call('cudnnAddTensor', rt.handle(), one, plan.b, arrays.pointer(b),
                one, plan.y, arrays.pointer(y))


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
    what = 'convolution_forward'
    _check_layouts(what, d_layout, w_layout)
    _check_output(what, y)
    try:
        arrays = runtime.current().arrays
        x, W = arrays.contiguous(x), arrays.contiguous(W)
        p = arrays.pointer
        pointers = (p(x), p(W), p(y))
        rt, plan = _plan('forward', bool(auto_tune), False,
                         tensor_core, x, W, y, tuple(pad), tuple(stride),
                         tuple(dilation), groups, b is not None, pointers)
        one, zero = scalars(x.dtype)
        _launch(rt, plan, 'forward', (plan.x, pointers[0]),
                (plan.w, pointers[1]), (plan.y, pointers[2]), one, zero)
        if b is not None:
            _add_bias(rt, plan, b, y, one)
    except CuDNNError as error:
        _add_context(error, what, dict(
            x=x, W=W, b=b, y=y, pad=pad, stride=stride, dilation=dilation,
            groups=groups, auto_tune=auto_tune, tensor_core=tensor_core))
        raise


def convolution_backward_filter(x, gy, gW, pad, stride, dilation, groups, *,
                                deterministic, auto_tune, tensor_core,
                                d_layout=C.CUDNN_TENSOR_NCHW,
                                w_layout=C.CUDNN_TENSOR_NCHW):
    """``gW`` = the gradient of the weights from ``x`` and ``gy``.

    ``deterministic`` (``chainer.config.cudnn_deterministic``) takes only
    deterministic algorithms, from the heuristics (never timed), as CuPy 13.
    """
    what = 'convolution_backward_filter'
    _check_layouts(what, d_layout, w_layout)
    _check_output(what, gW)
    try:
        arrays = runtime.current().arrays
        x, gy = arrays.contiguous(x), arrays.contiguous(gy)
        p = arrays.pointer
        pointers = (p(x), p(gy), p(gW))
        rt, plan = _plan('backward_filter',
                         bool(auto_tune and not deterministic),
                         bool(deterministic), tensor_core, x, gW, gy,
                         tuple(pad), tuple(stride), tuple(dilation), groups,
                         False, pointers)
        one, zero = scalars(x.dtype)
        _launch(rt, plan, 'backward_filter', (plan.x, pointers[0]),
                (plan.y, pointers[1]), (plan.w, pointers[2]), one, zero)
    except CuDNNError as error:
        _add_context(error, what, dict(
            x=x, gy=gy, gW=gW, pad=pad, stride=stride, dilation=dilation,
            groups=groups, deterministic=deterministic, auto_tune=auto_tune,
            tensor_core=tensor_core))
        raise


def convolution_backward_data(W, x, b, y, pad, stride, dilation, groups, *,
                              deterministic, auto_tune, tensor_core,
                              d_layout=C.CUDNN_TENSOR_NCHW,
                              w_layout=C.CUDNN_TENSOR_NCHW):
    """``y = deconv(x, W) (+ b)``: the transposed convolution, i.e. the
    gradient of a convolution's input (``x`` has the convolution output's
    shape, ``y`` its input's)."""
    what = 'convolution_backward_data'
    _check_layouts(what, d_layout, w_layout)
    _check_output(what, y)
    try:
        arrays = runtime.current().arrays
        x, W = arrays.contiguous(x), arrays.contiguous(W)
        p = arrays.pointer
        pointers = (p(W), p(x), p(y))
        # The plan is the forward convolution's: input y, output x.
        rt, plan = _plan('backward_data',
                         bool(auto_tune and not deterministic),
                         bool(deterministic), tensor_core, y, W, x,
                         tuple(pad), tuple(stride), tuple(dilation), groups,
                         b is not None, pointers)
        one, zero = scalars(x.dtype)
        _launch(rt, plan, 'backward_data', (plan.w, pointers[0]),
                (plan.y, pointers[1]), (plan.x, pointers[2]), one, zero)
        if b is not None:
            rt.lib.call('cudnnAddTensor', rt.handle(), one, plan.b,
                        arrays.pointer(arrays.contiguous(b)), one, plan.x,
                        pointers[2])
    except CuDNNError as error:
        _add_context(error, what, dict(
            W=W, x=x, b=b, y=y, pad=pad, stride=stride, dilation=dilation,
            groups=groups, deterministic=deterministic, auto_tune=auto_tune,
            tensor_core=tensor_core))
        raise
