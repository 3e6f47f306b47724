"""Fused GPU kernels of the per-step work, each beside its NumPy twin.

A K-FAC step touches every parameter a few times: the regularised gradient
of eq. (13), the update of eqs. (19)-(20), the check that no direction is
NaN or Inf; and a refresh step reads every BatchNormalization's input and
output gradient for the per-sample gradients of its (γ, β). Written as array expressions, each is several CuPy kernels per
parameter (ResNet-50 has 161): hundreds of launches and, for the finite
check, a host synchronisation per array. Here each is one kernel per
parameter (three with eq. 20's norm) and the finite check is one kernel
and one synchronisation for all arrays of a step.

The NumPy twins compute the same expressions in the same order; the tests
compare the two (CPU vs GPU in float64). The scalars (γ, η, m) may be
host floats or 0-d arrays on the arrays' device, which the kernels read
when they run (a replayed CUDA graph then takes the values of its step:
:mod:`chainerkfac.graphs.hyper`). Importing this module does not import
CuPy.
"""
import functools
from typing import Sequence

import numpy

from chainer.backend import get_array_module

#: ε of eq. (20).
RESCALE_EPS = 1e-9


def regularized_grad(grad, weight, damping: float, mean: float = 0.0):
    """∇E = ∇L + γ (w − μ) of eq. (13)."""
    xp = get_array_module(grad)
    if xp is numpy:
        damping = _host_scalar(damping, grad.dtype)
        # One temporary (the kernel's order: g + d·(w − μ)).
        out = weight - mean if mean else weight * damping
        if mean:
            out *= damping
        out += grad
        return out
    return _kernels().regularized(grad, weight, _scalar(damping, grad.dtype),
                                  grad.dtype.type(mean))


def momentum_step(weight, velocity, direction, lr: float, momentum: float,
                  rescale_norm=None) -> None:
    """Eqs. (19)-(20) in place: ``new = w + (m v − η G)``, optionally
    ``new ← rescale_norm · new / (‖new‖ + ε)``; then ``v ← new − w`` and
    ``w ← new``."""
    xp = get_array_module(weight)
    if xp is numpy:
        _momentum_step_cpu(weight.reshape(-1), velocity.reshape(-1),
                           numpy.ascontiguousarray(direction).reshape(-1),
                           _host_scalar(lr, weight.dtype),
                           _host_scalar(momentum, weight.dtype), rescale_norm)
        return
    kernels = _kernels()
    dtype = weight.dtype.type
    lr = _scalar(lr, weight.dtype)
    momentum = _scalar(momentum, weight.dtype)
    if rescale_norm is None:
        kernels.momentum(direction, lr, momentum, weight, velocity)
        return
    # The unscaled new weight goes into ``velocity`` first: its norm is
    # needed before the rescaled weight can be written.
    kernels.unscaled(weight, direction, lr, momentum, velocity)
    norm = kernels.norm(velocity)
    kernels.rescaled(norm, dtype(rescale_norm), dtype(RESCALE_EPS), weight,
                     velocity)


#: Elements per piece of :func:`_momentum_step_cpu`: its temporaries stay
#: in the cache. (Whole-array temporaries of a large parameter cost a pass
#: of page faults each and the memory traffic of every intermediate: 0.22 s
#: for AlexNet's fc6, 38M weights, on one core, against 0.11 s for Chainer's
#: MomentumSGD update.)
PIECE = 1 << 15


def _momentum_step_cpu(weight, velocity, direction, lr, momentum,
                       rescale_norm) -> None:
    """:func:`momentum_step` on flat NumPy arrays, piece by piece, with the
    kernels' arithmetic element for element (same operations, same
    order): the unscaled new weight, then with eq. (20) its norm over the
    whole array and the rescaled one."""
    pieces = ([slice(None)] if weight.size <= PIECE else
              [slice(start, start + PIECE)
               for start in range(0, weight.size, PIECE)])
    for piece in pieces:
        new = momentum * velocity[piece]
        new -= lr * direction[piece]
        new += weight[piece]
        if rescale_norm is None:
            numpy.subtract(new, weight[piece], out=velocity[piece])
            weight[piece] = new
        else:
            velocity[piece] = new
    if rescale_norm is None:
        return
    factor = rescale_norm / (numpy.linalg.norm(velocity) + RESCALE_EPS)
    for piece in pieces:
        new = velocity[piece] * factor
        numpy.subtract(new, weight[piece], out=velocity[piece])
        weight[piece] = new


def _scalar(value, dtype):
    """A kernel's scalar argument of ``dtype``: a host number rounded to
    it, or a 0-d device array cast to it on the device."""
    if isinstance(value, (int, float, numpy.generic)):
        return numpy.dtype(dtype).type(value)
    return value.astype(dtype, copy=False)


def _host_scalar(value, dtype):
    """A NumPy operand: a Python number as it is (NumPy rounds it to the
    array's dtype), a NumPy scalar or 0-d array rounded to ``dtype``
    first, so that it computes as the Python number would (NumPy 2 would
    otherwise promote a float32 array to float64)."""
    if isinstance(value, (numpy.ndarray, numpy.generic)):
        return numpy.dtype(dtype).type(value)
    return value


def all_finite(arrays: Sequence) -> bool:
    """Whether every element of every array is finite.

    On the GPU: one kernel over all float32 / float64 arrays (a table of
    their pointers) and one host synchronisation.
    """
    arrays = [a for a in arrays if a is not None and a.size]
    if not arrays:
        return True
    xp = get_array_module(arrays[0])
    if xp is numpy:
        return all(bool(numpy.isfinite(a).all()) for a in arrays)
    bad = xp.zeros(1, numpy.int32)
    by_dtype = {}
    for array in arrays:
        by_dtype.setdefault(numpy.dtype(array.dtype), []).append(
            xp.ascontiguousarray(array))
    keep = []   # keep contiguous copies alive until the kernels ran
    for dtype, group in by_dtype.items():
        kernel = _kernels().finite.get(dtype)
        if kernel is None:
            flags = [xp.isfinite(a).all() for a in group]
            bad |= ~xp.stack(flags).all()
            continue
        pointers = xp.asarray(numpy.array([a.data.ptr for a in group],
                                          numpy.uint64))
        sizes = xp.asarray(numpy.array([a.size for a in group], numpy.int64))
        keep.append((group, pointers, sizes))
        blocks = int(min(64, max(1, max(a.size for a in group) // 1024)))
        kernel((blocks, len(group)), (256,),
               (pointers, sizes, bad))
    return not bool(bad.get()[0])


def bn_sample_grads(x, gy, mean, inv_std, dtype):
    """Per-sample gradients of a BatchNormalization's (γ, β), unscaled:
    ``rows[n] = [Σ_l gy x̂, Σ_l gy]`` over the locations ``l`` of each
    channel, ``x̂ = (x − μ)·σ⁻¹``, formed as ``σ⁻¹ (Σ gy x − μ Σ gy)``
    without ``x̂``; shape ``(N, 2C)`` in ``dtype``.

    ``x`` and ``gy`` are ``(N, C, L)``; ``mean`` and ``inv_std`` the
    batch's ``(C,)`` statistics. On the GPU (float32 or float64 data) one
    kernel reads ``x`` and ``gy`` once and writes the rows: a block per
    ``(n, c)``, the two sums in ``dtype`` (the generic path was a
    reduction, a product the size of ``x`` and a second reduction, then
    four small kernels). Elsewhere, and for float16 data, the array
    expressions (NumPy's ``einsum`` makes no temporary).
    """
    xp = get_array_module(x)
    dtype = numpy.dtype(dtype)
    mean = mean.astype(dtype, copy=False)
    inv_std = inv_std.astype(dtype, copy=False)
    # (not for an empty array: CuPy launches at least one block)
    if xp is not numpy and x.dtype == gy.dtype == dtype and \
            dtype in _BN_CTYPES and x.size:
        n, c, length = x.shape
        x = xp.ascontiguousarray(x)
        gy = xp.ascontiguousarray(gy)
        rows = xp.empty((n, 2 * c), dtype)
        threads = 64 if length <= 256 else 256
        _kernels().bn_sample_grads[dtype](
            (n * c,), (threads,),
            (x, gy, xp.ascontiguousarray(mean), xp.ascontiguousarray(inv_std),
             rows, numpy.int32(c), numpy.int64(length)))
        return rows
    g_beta = gy.sum(axis=2, dtype=dtype)
    if xp is numpy:
        products = numpy.einsum('ncl,ncl->nc', gy, x, dtype=dtype)
    else:
        products = (gy.astype(dtype, copy=False) * x).sum(axis=2)
    g_gamma = (products - mean * g_beta) * inv_std
    return xp.concatenate([g_gamma, g_beta], axis=1)


_BN_CTYPES = {numpy.dtype(numpy.float32): ('f32', 'float'),
              numpy.dtype(numpy.float64): ('f64', 'double')}

# One block of ``blockDim.x`` (64 or 256) threads per (n, c) row: strided
# sums, then a tree in shared memory; thread 0 writes both entries.
_BN_SOURCE = r'''
extern "C" __global__ void chainerkfac_bn_sample_grads_{name}(
        const {ctype}* x, const {ctype}* gy, const {ctype}* mean,
        const {ctype}* inv_std, {ctype}* rows, const int channels,
        const long long length) {{
    __shared__ {ctype} s_gx[256];
    __shared__ {ctype} s_g[256];
    const long long row = blockIdx.x;
    const int c = (int) (row % channels);
    const long long n = row / channels;
    const {ctype}* xr = x + row * length;
    const {ctype}* gr = gy + row * length;
    {ctype} sum_gx = 0, sum_g = 0;
    for (long long i = threadIdx.x; i < length; i += blockDim.x) {{
        const {ctype} g = gr[i];
        sum_g += g;
        sum_gx += g * xr[i];
    }}
    const int t = threadIdx.x;
    s_gx[t] = sum_gx;
    s_g[t] = sum_g;
    __syncthreads();
    for (int half = blockDim.x / 2; half > 0; half >>= 1) {{
        if (t < half) {{
            s_gx[t] += s_gx[t + half];
            s_g[t] += s_g[t + half];
        }}
        __syncthreads();
    }}
    if (t == 0) {{
        rows[n * 2 * channels + c] = (s_gx[0] - mean[c] * s_g[0]) *
            inv_std[c];
        rows[n * 2 * channels + channels + c] = s_g[0];
    }}
}}
'''


_FINITE_SOURCE = r'''
extern "C" __global__ void all_finite_{name}(
        const unsigned long long* pointers, const long long* sizes,
        int* bad) {{
    const {ctype}* x = (const {ctype}*) pointers[blockIdx.y];
    const long long size = sizes[blockIdx.y];
    const long long stride = (long long) gridDim.x * blockDim.x;
    for (long long i = (long long) blockIdx.x * blockDim.x + threadIdx.x;
         i < size; i += stride) {{
        if (!isfinite(x[i])) {{
            *bad = 1;
            return;
        }}
    }}
}}
'''


@functools.lru_cache(maxsize=None)
def _kernels():
    import cupy

    class Kernels:
        regularized = cupy.ElementwiseKernel(
            'T g, T w, T d, T mu', 'T out', 'out = g + d * (w - mu)',
            'chainerkfac_regularized_grad')
        momentum = cupy.ElementwiseKernel(
            'T d, T lr, T m', 'T w, T v',
            'T step = m * v - lr * d; T new_w = w + step; '
            'v = new_w - w; w = new_w;',
            'chainerkfac_momentum_step')
        unscaled = cupy.ElementwiseKernel(
            'T w, T d, T lr, T m', 'T v',
            'v = w + (m * v - lr * d)',
            'chainerkfac_unscaled_step')
        norm = cupy.ReductionKernel(
            'T x', 'T y', 'x * x', 'a + b', 'y = sqrt(a)', '0',
            'chainerkfac_norm')
        rescaled = cupy.ElementwiseKernel(
            'T norm, T target, T eps', 'T w, T v',
            'T scaled = v * (target / (norm + eps)); v = scaled - w; '
            'w = scaled;',
            'chainerkfac_rescaled_step')
        bn_sample_grads = {
            dtype: cupy.RawKernel(_BN_SOURCE.format(name=name, ctype=ctype),
                                  'chainerkfac_bn_sample_grads_' + name)
            for dtype, (name, ctype) in _BN_CTYPES.items()}
        finite = {
            numpy.dtype(numpy.float32): cupy.RawKernel(
                _FINITE_SOURCE.format(name='f32', ctype='float'),
                'all_finite_f32'),
            numpy.dtype(numpy.float64): cupy.RawKernel(
                _FINITE_SOURCE.format(name='f64', ctype='double'),
                'all_finite_f64'),
        }

    return Kernels()
