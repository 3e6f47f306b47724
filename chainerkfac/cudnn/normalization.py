"""Batch normalization, as CuPy 13's ``cupyx.cudnn`` and with its
signatures (Chainer 7.8.1's ``F.batch_normalization``,
``F.fixed_batch_normalization`` and ``F.group_normalization``).

Training runs ``cudnnBatchNormalizationForwardTrainingEx`` (BN only, no
fused activation; the unused z / y / dz descriptors are ``x``'s and their
data NULL, as CuPy 13 passed them), which updates the running mean and
variance in place (``running = decay · running + (1 − decay) · batch``, the
variance unbiased) and saves the batch mean and inverse standard deviation
for the backward pass. Its workspace and reserve sizes are asked of cuDNN
once per shape (the plan, :mod:`chainerkfac.cudnn.plans`; CuPy 13 asked
only for NHWC float16); the workspace is the runtime's buffer for the
current stream, the reserve space a new allocation per call, handed to
Chainer, which gives it back to :func:`batch_normalization_backward`.

``is_for_conv2d`` describes ``x`` as NCHW (``CUDNN_BATCHNORM_SPATIAL`` or
``_SPATIAL_PERSISTENT``, the latter under Chainer's
``cudnn_fast_batch_normalization``); otherwise ``x`` is ``(..., C)`` seen as
``(N, C, 1, 1)`` per activation. Scale, bias and statistics are in the
dtype cuDNN derives (float32 for float16 data), cast there and back when
Chainer's differ.
"""
import ctypes
import warnings

from chainerkfac.cudnn import constants as C
from chainerkfac.cudnn import not_served
from chainerkfac.cudnn import plans
from chainerkfac.cudnn import runtime
from chainerkfac.cudnn.descriptors import scalars


def _x_descriptor(d, shape, dtype, is_for_conv2d):
    if is_for_conv2d:
        return d.tensor(shape, dtype)
    channels = shape[-1] if shape else 1
    size = 1
    for extent in shape:
        size *= extent
    return d.tensor_4d(size // channels, channels, 1, 1, dtype)


def _check_layout(what, d_layout):
    if d_layout != C.CUDNN_TENSOR_NCHW:
        raise not_served.layout(what)


def _check_overflow(lib, handle, mode, debug):
    """The persistent kernel may overflow; Chainer's debug mode asks."""
    if not debug or mode != C.CUDNN_BATCHNORM_SPATIAL_PERSISTENT:
        return
    status = ctypes.c_int()
    lib.call('cudnnQueryRuntimeError', handle, ctypes.byref(status),
             C.CUDNN_ERRQUERY_BLOCKING, None)
    if status.value != C.CUDNN_STATUS_SUCCESS:
        warnings.warn('A numerical overflow might have happened in cuDNN '
                      'batch normalization (status: {})'.format(
                          lib.error_string(status.value)))


def _build(d, rt, shape, dtype, is_for_conv2d, mode, training):
    """The plan of BN on ``x`` of ``shape``: its descriptor, the derived
    one of the parameters and their dtype, and (``training``) the
    workspace and reserve sizes of the forward and backward calls."""
    lib = rt.lib
    plan = plans.Plan(d)
    plan.x = _x_descriptor(d, shape, dtype, is_for_conv2d)
    plan.bn, plan.param_dtype = d.derived_bn(plan.x, mode)
    if training:
        handle, ops, x = rt.handle(), C.CUDNN_BATCHNORM_OPS_BN, plan.x
        plan.forward_workspace = lib.size(
            'cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize',
            handle, mode, ops, x, x, x, plan.bn, None)
        plan.reserve = lib.size(
            'cudnnGetBatchNormalizationTrainingExReserveSpaceSize', handle,
            mode, ops, None, x)
        plan.backward_workspace = lib.size(
            'cudnnGetBatchNormalizationBackwardExWorkspaceSize', handle,
            mode, ops, x, x, x, x, x, plan.bn, None)
    return plan


def _plan(x, is_for_conv2d, mode, training):
    rt = runtime.current()
    key = ('batch_normalization', x.shape, x.dtype.char, bool(is_for_conv2d),
           mode, training, rt.arrays.device_id())
    return rt, rt.plans.get(key, _build, rt, x.shape, x.dtype, is_for_conv2d,
                            mode, training)


def _forward_training(x, gamma, beta, running_mean, running_var, mean,
                      inv_std, eps, decay, is_for_conv2d, cudnn_mode, debug,
                      d_layout):
    _check_layout('batch_normalization_forward_training', d_layout)
    if (mean is None) != (inv_std is None):
        raise ValueError('Both mean and inv_std must be None if one is.')
    arrays = runtime.current().arrays
    x = arrays.contiguous(x)
    rt, plan = _plan(x, is_for_conv2d, cudnn_mode, True)
    param_dtype = plan.param_dtype
    y = arrays.empty(x.shape, x.dtype)
    gamma = arrays.contiguous(gamma.astype(param_dtype, copy=False))
    beta = arrays.contiguous(beta.astype(param_dtype, copy=False))
    mean_tmp = running_mean.astype(param_dtype, copy=False)
    var_tmp = running_var.astype(param_dtype, copy=False)
    if mean is None:
        mean = arrays.empty(gamma.shape, param_dtype)
        inv_std = arrays.empty(gamma.shape, param_dtype)
    one, zero = scalars(x.dtype)
    workspace = rt.workspace(plan.forward_workspace)
    # The reserve space travels to the backward pass: one per call.
    reserve = arrays.alloc(plan.reserve)
    handle, p = rt.handle(), arrays.pointer
    rt.lib.call('cudnnBatchNormalizationForwardTrainingEx', handle,
                cudnn_mode, C.CUDNN_BATCHNORM_OPS_BN, one, zero, plan.x,
                p(x), plan.x, None, plan.x, p(y), plan.bn, p(gamma), p(beta),
                1.0 - decay, p(mean_tmp), p(var_tmp), eps, p(mean),
                p(inv_std), None, workspace.ptr, workspace.nbytes,
                reserve.ptr, reserve.nbytes)
    _check_overflow(rt.lib, handle, cudnn_mode, debug)
    if mean_tmp is not running_mean:
        running_mean[...] = mean_tmp
        running_var[...] = var_tmp
    return (reserve if reserve.nbytes else None), y, mean, inv_std


def batch_normalization_forward_training(
        x, gamma, beta, running_mean, running_var, mean, inv_std, eps, decay,
        is_for_conv2d, cudnn_mode, debug, d_layout=C.CUDNN_TENSOR_NCHW):
    """BN of a training step.

    Returns
    -------
    y, save_mean, save_inv_std
        When ``mean`` and ``inv_std`` are None (they are then allocated);
        else ``y`` alone, the statistics written into them.
    """
    _, y, mean_out, inv_std_out = _forward_training(
        x, gamma, beta, running_mean, running_var, mean, inv_std, eps, decay,
        is_for_conv2d, cudnn_mode, debug, d_layout)
    return (y, mean_out, inv_std_out) if mean is None else y


def batch_normalization_forward_training_ex(
        x, gamma, beta, running_mean, running_var, mean, inv_std, eps, decay,
        is_for_conv2d, cudnn_mode, debug, d_layout=C.CUDNN_TENSOR_NCHW):
    """As :func:`batch_normalization_forward_training`, with cuDNN's
    reserve space (or None) first, for
    :func:`batch_normalization_backward`."""
    reserve, y, mean_out, inv_std_out = _forward_training(
        x, gamma, beta, running_mean, running_var, mean, inv_std, eps, decay,
        is_for_conv2d, cudnn_mode, debug, d_layout)
    if mean is None:
        return reserve, y, mean_out, inv_std_out
    return reserve, y


def batch_normalization_forward_inference(
        x, gamma, beta, mean, var, eps, is_for_conv2d, cudnn_mode,
        d_layout=C.CUDNN_TENSOR_NCHW):
    """``y = gamma (x − mean) / sqrt(var + eps) + beta`` with fixed
    statistics."""
    _check_layout('batch_normalization_forward_inference', d_layout)
    arrays = runtime.current().arrays
    x = arrays.contiguous(x)
    rt, plan = _plan(x, is_for_conv2d, cudnn_mode, False)
    y = arrays.empty(x.shape, x.dtype)
    gamma, beta, mean, var = (
        arrays.contiguous(a.astype(plan.param_dtype, copy=False))
        for a in (gamma, beta, mean, var))
    one, zero = scalars(x.dtype)
    p = arrays.pointer
    rt.lib.call('cudnnBatchNormalizationForwardInference', rt.handle(),
                cudnn_mode, one, zero, plan.x, p(x), plan.x, p(y), plan.bn,
                p(gamma), p(beta), p(mean), p(var), eps)
    return y


def batch_normalization_backward(
        x, gamma, gy, mean, inv_std, eps, is_for_conv2d, cudnn_mode, debug,
        d_layout=C.CUDNN_TENSOR_NCHW, *, reserve_space=None):
    """Gradients of BN of a training step from the saved statistics.

    Returns
    -------
    gx, ggamma, gbeta
        ``ggamma`` and ``gbeta`` in ``gamma``'s dtype.
    """
    _check_layout('batch_normalization_backward', d_layout)
    arrays = runtime.current().arrays
    x, gy = arrays.contiguous(x), arrays.contiguous(gy)
    rt, plan = _plan(x, is_for_conv2d, cudnn_mode, True)
    param_dtype = plan.param_dtype
    gx = arrays.empty(x.shape, x.dtype)
    gamma_cast = arrays.contiguous(gamma.astype(param_dtype, copy=False))
    ggamma = arrays.empty(gamma_cast.shape, param_dtype)
    gbeta = arrays.empty(gamma_cast.shape, param_dtype)
    workspace = rt.workspace(plan.backward_workspace)
    reserve_ptr, reserve_nbytes = ((reserve_space.ptr, reserve_space.nbytes)
                                   if reserve_space is not None
                                   else (None, 0))
    one, zero = scalars(x.dtype)
    handle, p = rt.handle(), arrays.pointer
    rt.lib.call('cudnnBatchNormalizationBackwardEx', handle, cudnn_mode,
                C.CUDNN_BATCHNORM_OPS_BN, one, zero, one, zero, plan.x, p(x),
                plan.x, None, plan.x, p(gy), plan.x, None, plan.x, p(gx),
                plan.bn, p(gamma_cast), None, p(ggamma), p(gbeta), eps,
                p(mean), p(inv_std), None, workspace.ptr, workspace.nbytes,
                reserve_ptr, reserve_nbytes)
    _check_overflow(rt.lib, handle, cudnn_mode, debug)
    return (gx, ggamma.astype(gamma.dtype, copy=False),
            gbeta.astype(gamma.dtype, copy=False))
