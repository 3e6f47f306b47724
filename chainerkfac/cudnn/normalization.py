"""Batch normalization, as CuPy 13's ``cupyx.cudnn`` and with its
signatures (Chainer 7.8.1's ``F.batch_normalization``,
``F.fixed_batch_normalization`` and ``F.group_normalization``).

Training runs ``cudnnBatchNormalizationForwardTrainingEx`` (BN only, no
fused activation; the unused z / y / dz descriptors are ``x``'s and their
data NULL, as CuPy 13 passed them), which updates the running mean and
variance in place (``running = decay · running + (1 − decay) · batch``, the
variance unbiased) and saves the batch mean and inverse standard deviation
for the backward pass. Its workspace and reserve space are asked of cuDNN on every
call (CuPy 13 asked only for NHWC float16); the reserve space is handed to
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
from chainerkfac.cudnn import runtime


def _x_descriptor(d, x, is_for_conv2d):
    if is_for_conv2d:
        return d.tensor(x.shape, x.dtype)
    channels = x.shape[-1] if x.ndim else 1
    return d.tensor_4d(x.size // channels, channels, 1, 1, x.dtype)


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


def _forward_training(x, gamma, beta, running_mean, running_var, mean,
                      inv_std, eps, decay, is_for_conv2d, cudnn_mode, debug,
                      d_layout):
    _check_layout('batch_normalization_forward_training', d_layout)
    if (mean is None) != (inv_std is None):
        raise ValueError('Both mean and inv_std must be None if one is.')
    with runtime.call(x.dtype) as c:
        lib, arrays, handle = c.lib, c.arrays, c.handle
        x = arrays.contiguous(x)
        y = arrays.empty(x.shape, x.dtype)
        x_desc = _x_descriptor(c.d, x, is_for_conv2d)
        bn_desc, param_dtype = c.d.derived_bn(x_desc, cudnn_mode)
        gamma = arrays.contiguous(gamma.astype(param_dtype, copy=False))
        beta = arrays.contiguous(beta.astype(param_dtype, copy=False))
        mean_tmp = running_mean.astype(param_dtype, copy=False)
        var_tmp = running_var.astype(param_dtype, copy=False)
        if mean is None:
            mean = arrays.empty(gamma.shape, param_dtype)
            inv_std = arrays.empty(gamma.shape, param_dtype)
        ops = C.CUDNN_BATCHNORM_OPS_BN
        workspace = arrays.alloc(lib.size(
            'cudnnGetBatchNormalizationForwardTrainingExWorkspaceSize',
            handle, cudnn_mode, ops, x_desc, x_desc, x_desc, bn_desc, None))
        reserve = arrays.alloc(lib.size(
            'cudnnGetBatchNormalizationTrainingExReserveSpaceSize',
            handle, cudnn_mode, ops, None, x_desc))
        lib.call('cudnnBatchNormalizationForwardTrainingEx', handle,
                 cudnn_mode, ops, c.one, c.zero, x_desc, arrays.pointer(x),
                 x_desc, None, x_desc, arrays.pointer(y), bn_desc,
                 arrays.pointer(gamma), arrays.pointer(beta), 1.0 - decay,
                 arrays.pointer(mean_tmp), arrays.pointer(var_tmp), eps,
                 arrays.pointer(mean), arrays.pointer(inv_std), None,
                 workspace.ptr, workspace.nbytes, reserve.ptr, reserve.nbytes)
        _check_overflow(lib, handle, cudnn_mode, debug)
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
    with runtime.call(x.dtype) as c:
        arrays = c.arrays
        x = arrays.contiguous(x)
        y = arrays.empty(x.shape, x.dtype)
        x_desc = _x_descriptor(c.d, x, is_for_conv2d)
        bn_desc, param_dtype = c.d.derived_bn(x_desc, cudnn_mode)
        gamma, beta, mean, var = (
            arrays.contiguous(a.astype(param_dtype, copy=False))
            for a in (gamma, beta, mean, var))
        c.lib.call('cudnnBatchNormalizationForwardInference', c.handle,
                   cudnn_mode, c.one, c.zero, x_desc, arrays.pointer(x),
                   x_desc, arrays.pointer(y), bn_desc, arrays.pointer(gamma),
                   arrays.pointer(beta), arrays.pointer(mean),
                   arrays.pointer(var), eps)
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
    with runtime.call(x.dtype) as c:
        lib, arrays, handle = c.lib, c.arrays, c.handle
        x, gy = arrays.contiguous(x), arrays.contiguous(gy)
        gx = arrays.empty(x.shape, x.dtype)
        x_desc = _x_descriptor(c.d, x, is_for_conv2d)
        bn_desc, param_dtype = c.d.derived_bn(x_desc, cudnn_mode)
        gamma_cast = arrays.contiguous(gamma.astype(param_dtype, copy=False))
        ggamma = arrays.empty(gamma_cast.shape, param_dtype)
        gbeta = arrays.empty(gamma_cast.shape, param_dtype)
        ops = C.CUDNN_BATCHNORM_OPS_BN
        workspace = arrays.alloc(lib.size(
            'cudnnGetBatchNormalizationBackwardExWorkspaceSize', handle,
            cudnn_mode, ops, x_desc, x_desc, x_desc, x_desc, x_desc, bn_desc,
            None))
        reserve_ptr, reserve_nbytes = ((reserve_space.ptr,
                                        reserve_space.nbytes)
                                       if reserve_space is not None
                                       else (None, 0))
        lib.call('cudnnBatchNormalizationBackwardEx', handle, cudnn_mode, ops,
                 c.one, c.zero, c.one, c.zero, x_desc, arrays.pointer(x),
                 x_desc, None,
                 x_desc, arrays.pointer(gy), x_desc, None, x_desc,
                 arrays.pointer(gx), bn_desc, arrays.pointer(gamma_cast),
                 None, arrays.pointer(ggamma), arrays.pointer(gbeta), eps,
                 arrays.pointer(mean), arrays.pointer(inv_std), None,
                 workspace.ptr, workspace.nbytes, reserve_ptr, reserve_nbytes)
        _check_overflow(lib, handle, cudnn_mode, debug)
    return (gx, ggamma.astype(gamma.dtype, copy=False),
            gbeta.astype(gamma.dtype, copy=False))
